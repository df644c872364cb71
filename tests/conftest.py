"""Shared fixtures: a locally trained tokenizer and random-weight model builders."""

from __future__ import annotations

import pytest
from transformers import PreTrainedTokenizerFast

from kvllm.testing import train_tokenizer


@pytest.fixture(scope="session")
def tokenizer() -> PreTrainedTokenizerFast:
    return train_tokenizer()
