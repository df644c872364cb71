"""Chain statistics on a chain whose reads, distances and needed tokens are known."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from kvllm.assets import model_path
from kvllm.eval.chains import EDGES, chain_stats
from kvllm.eval.tasks import END_THINK, THINK, Task

PROMPT = "reason: evaluate and report ce.\n bo41\n ku13\n ce = bo + ku\n da = ce + ce\n fa = bo - bo\n " + THINK
# ce is read twice (by da), bo twice and ku once from the prompt, fa never, and ce by the
# answer: the needed writes are ce54 only (da08 and fa00 are read by nothing). The
# restatement and the hedge are tokens no read needs.
TARGET = (
    "\n ce = bo + ku = bo41 + ku13 = ce54\n so ce is 54.\n da = ce + ce = ce54 + ce54 = da08\n"
    " wait, let me double-check that.\n fa = bo - bo = bo41 - bo41 = fa00\n " + END_THINK + "\n ce54"
)


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(model_path())


def test_reads_distances_and_density_of_a_known_chain(tokenizer) -> None:
    stats = chain_stats(tokenizer, [Task("reason", 0, PROMPT, TARGET, "54")])
    assert len(stats.reads["prompt"]) == 4 and len(stats.reads["generated"]) == 2
    # The two reads of ce54: each as far back as the tokens between its digits and the
    # written ones, counted here from the tokenizer's own pieces.
    pieces = tokenizer(TARGET)["input_ids"]
    text = [tokenizer.decode([i]) for i in pieces]
    digit_at = [i for i, piece in enumerate(text) if piece == "5" and text[i + 1] == "4"]
    written, first_read, second_read = digit_at[0], digit_at[2], digit_at[3]  # digit_at[1]: the restatement
    assert sorted(stats.reads["generated"]) == [first_read - written, second_read - written]
    # Needed: the name and two digits of ce54, three tokens, over the chain of thought's tokens.
    body = TARGET[TARGET.index("\n") : TARGET.index(END_THINK)]
    cot = len(tokenizer(body)["input_ids"])
    assert stats.cot_tokens == [cot]
    assert stats.needed_tokens == 3
    assert stats.summary()["density"] == pytest.approx(3 / cot)


def test_histogram_shares(tokenizer) -> None:
    stats = chain_stats(tokenizer, [Task("reason", 0, PROMPT, TARGET, "54")])
    for source in ("prompt", "generated"):
        shares = stats.histogram(source)
        assert len(shares) == len(EDGES) - 1 and sum(shares) == pytest.approx(1.0)
    # Both generated reads of ce come within one short line: the first bucket.
    assert stats.histogram("generated")[0] == 1.0
