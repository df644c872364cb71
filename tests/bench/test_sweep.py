from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from kvllm.bench import sweep as sweep_mod
from kvllm.bench.sweep import Sweep, run_sweep
from kvllm.bench.throughput import Engine, Spec, Workload


def test_systems_alternate_and_rotate_between_repeats(tmp_path: Path) -> None:
    s = Sweep(model="m", out=tmp_path, systems=("vanilla", "kara", "plugin-off"), pools=(64,), repeats=3)
    order = [spec.system for spec in s.specs()]
    assert order == ["vanilla", "kara", "plugin-off", "kara", "plugin-off", "vanilla", "plugin-off", "vanilla", "kara"]
    kara = next(spec for spec in s.specs() if spec.system == "kara")
    assert kara.config() is not None and kara.config().policy == "periodic" and kara.config().retention == 0.2
    snap = Sweep(model="m", out=tmp_path, systems=("snapkv-threshold",)).specs()[0].config()
    assert snap.method == "snapkv" and snap.policy == "threshold"
    assert next(spec for spec in s.specs() if spec.system == "vanilla").config() is None
    # What crosses to the bench process comes back as the same spec.
    assert all(Spec.from_dict(json.loads(json.dumps(asdict(spec)))) == spec for spec in s.specs())


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"systems": ("fast",)}, "systems=.*fast"),
        ({"repeats": 0}, "repeats=0"),
        ({"retention": 1.5}, "retention"),
        ({"concurrency": (0,)}, "concurrency="),
        ({"pools": (8,)}, "output_tokens=512 is invalid for a pool of 8 blocks"),
    ],
)
def test_bad_sweeps_fail_before_any_engine(tmp_path: Path, kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Sweep(model="m", out=tmp_path, **kwargs).specs()


def test_bad_workload_and_engine() -> None:
    with pytest.raises(ValueError, match=r"Workload\.output_tokens=1"):
        Workload(output_tokens=1)
    with pytest.raises(ValueError, match=r"Engine\.pool_blocks=1"):
        Engine(pool_blocks=1)


def test_finished_groups_are_skipped_and_partial_ones_rerun(tmp_path: Path, monkeypatch) -> None:
    ran: list[tuple[str, int]] = []

    def fake(spec: Spec, on_row) -> None:
        ran.append((spec.system, spec.repeat))
        for c in spec.concurrency:
            if (spec.system, spec.repeat, c) == ("kara", 0, 4) and len(ran) == 2:
                raise RuntimeError("killed")  # the first run dies after one cell
            on_row({"system": spec.system, "pool_blocks": 64, "repeat": spec.repeat, "concurrency": c, "tok_s": 1.0})

    monkeypatch.setattr(sweep_mod, "_run_spec", fake)
    s = Sweep(model="m", out=tmp_path, systems=("vanilla", "kara"), concurrency=(2, 4), pools=(64,), repeats=1)
    with pytest.raises(RuntimeError):
        run_sweep(s)
    assert ran == [("vanilla", 0), ("kara", 0)]
    rows = run_sweep(s)
    assert ran[2:] == [("kara", 0)]  # vanilla was complete; kara had one cell of two
    cells = sorted((r["system"], r["concurrency"]) for r in rows)
    assert cells == [("kara", 2), ("kara", 4), ("vanilla", 2), ("vanilla", 4)]
