"""tools/dev_sweep.py: the tasks it tunes on are the ones the model was trained on."""

from pathlib import Path

import pytest

from tools.dev_sweep import sweep_difficulty


@pytest.mark.parametrize(("model", "op"), [("kara-reasoner-tiny", "add"), ("kara-reasoner-6l", "shift")])
def test_sweep_uses_the_models_operator(model: str, op: str) -> None:
    # kara-reasoner-6l v2 learned `shift`; a sweep on `add` graded it on arithmetic it never saw.
    assert sweep_difficulty("reason", Path(model)).op == op


def test_sweep_difficulties() -> None:
    trace = sweep_difficulty("trace", None)
    assert (trace.steps, trace.constants) == (48, 8)  # the grid's trace (tools/accuracy_grid.sh)
    assert sweep_difficulty("reason", None).steps == 84
