"""Kara under vLLM's default compile mode (``kvllm serve`` without ``--enforce-eager``).

vLLM compiles the model with torch.compile and keeps attention an opaque custom op, so the
query capture inside the attention layer still runs as Python at every step. If it did
not, the ring would hold stale queries and a round would keep other tokens than eager's.
"""

from __future__ import annotations

import pytest

from kvllm.config import CompressionConfig
from kvllm.vllm.engine import runner_of as runner
from tests.vllm.conftest import PROMPTS, engine, greedy, token_ids

KARA = CompressionConfig(window=32, buffer=8, period=4, retention=0.2)


def test_compiled_kara_equals_eager_and_captures_queries(tiny_model: str) -> None:
    prompts, params = PROMPTS[:4], greedy(96)
    outs = {}
    for eager in (True, False):
        with engine(tiny_model, KARA, enforce_eager=eager) as llm:
            outs[eager] = llm.generate(prompts, params)
            compiled = llm.llm.llm_engine.vllm_config.compilation_config.mode
            ring = runner(llm).kv_ring
            assert ring is not None and any(bool(q.abs().sum()) for q in ring.queries)
        if not eager:
            assert compiled != 0, "the engine ran eager: nothing here was compiled"
    rounds = {eager: [o.compression["compressions"] for o in out] for eager, out in outs.items()}
    assert rounds[True] == rounds[False] and min(rounds[True]) >= 2
    assert token_ids(outs[True]) == token_ids(outs[False])


@pytest.mark.slow
def test_compiled_kara_equals_eager_on_the_shipped_reason_tasks() -> None:
    """The shipped reasoning model writes 4 held-out reason chains with Kara at r=0.2,
    greedy, to EOS (up to 1,500 tokens): token for token the same compiled as eager, with
    the same rounds."""
    from kvllm.assets import model_path
    from kvllm.cli.evaluate import family_difficulty
    from kvllm.eval.tasks import make_task
    from kvllm.vllm.llm import generate

    path = str(model_path("kara-reasoner-6l"))
    difficulty = family_difficulty("reason", None, None, 0.5, op="shift")
    prompts = [make_task("reason", seed, difficulty).prompt for seed in range(4)]
    runs = {eager: generate(path, prompts, CompressionConfig(), 1500, enforce_eager=eager) for eager in (True, False)}
    rounds = {eager: [s.compressions for s in g.stats] for eager, g in runs.items()}
    assert rounds[True] == rounds[False] and min(rounds[True]) > 0
    assert runs[True].token_ids == runs[False].token_ids
