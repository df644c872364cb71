from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from kvllm.bench import sweep as sweep_mod
from kvllm.bench.sweep import Sweep, run_sweep
from kvllm.bench.throughput import Engine, Spec, Workload
from kvllm.config import CompressionConfig

SHORT = Workload(output_tokens=512)


def test_systems_alternate_and_rotate_between_repeats(tmp_path: Path) -> None:
    s = Sweep(
        model="m", out=tmp_path, systems=("vanilla", "kara", "plugin-off"), pools=(64,), repeats=3, workload=SHORT
    )
    order = [spec.system for spec in s.specs()]
    assert order == ["vanilla", "kara", "plugin-off", "kara", "plugin-off", "vanilla", "plugin-off", "vanilla", "kara"]
    kara = next(spec for spec in s.specs() if spec.system == "kara")
    assert kara.config() is not None and kara.config().policy == "periodic" and kara.config().retention == 0.2
    systems = ("snapkv-threshold", "snapkv-periodic", "kara-projected")
    snap, periodic, projected = (
        spec.config() for spec in Sweep(model="m", out=tmp_path, systems=systems, prompt_tokens=150).specs()[:3]
    )
    assert (snap.method, snap.policy, snap.admission) == ("snapkv", "threshold", "projected")
    assert (periodic.method, periodic.policy, periodic.admission) == ("snapkv", "periodic", "projected")
    assert (projected.method, projected.policy, projected.admission) == ("kara", "periodic", "projected")
    # `kara` is what `kvllm serve` runs by default: vLLM's admission rule.
    assert kara.config().admission == "vllm" == CompressionConfig().admission
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
        ({"pools": (8,)}, "--output-tokens/--output-max 2048 is invalid for a pool of 8 blocks"),
        ({"pools": ("8 requests",)}, "--pool '8 requests' is invalid"),
        ({"workload": Workload(output_tokens=10000)}, "--output-tokens/--output-max 10000 is invalid for this model"),
        ({"pools": ("16x", "max"), "concurrency": (16,)}, "two pools resolve to the same"),
    ],
)
def test_bad_sweeps_fail_before_any_engine(tmp_path: Path, kwargs: dict[str, Any], match: str) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 8192}))
    with pytest.raises(ValueError, match=match):
        Sweep(model=str(tmp_path), out=tmp_path, prompt_tokens=150, **kwargs).specs()


def test_relative_pools_hold_whole_uncompressed_requests(tmp_path: Path) -> None:
    s = Sweep(model="m", out=tmp_path, pools=("8x", "max", 100), concurrency=(4, 16), prompt_tokens=150)
    per_request = -(-(150 + 2048) // 32)  # 69 blocks
    assert [spec.engine.pool_blocks for spec in s.specs()[:: 3 * len(s.systems)]] == [
        8 * per_request + 1,
        16 * per_request + 1,
        100,
    ]
    assert s.specs()[0].engine.label == "8x"


def test_bad_workload_and_engine() -> None:
    with pytest.raises(ValueError, match=r"output_tokens=1 \(--output-tokens\)"):
        Workload(output_tokens=1)
    with pytest.raises(ValueError, match=r"output_max=100 \(--output-max\)"):
        Workload(output_tokens=200, output_max=100)
    mix = Workload(output_tokens=1024, output_max=4096).lengths(64)
    assert mix == Workload(output_tokens=1024, output_max=4096).lengths(64)  # same mix for every system
    assert min(mix) >= 1024 and max(mix) <= 4096 and len(set(mix)) > 32
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
    s = Sweep(
        model="m", out=tmp_path, systems=("vanilla", "kara"), concurrency=(2, 4), pools=(64,), repeats=1, workload=SHORT
    )
    with pytest.raises(RuntimeError):
        run_sweep(s)
    assert ran == [("vanilla", 0), ("kara", 0)]
    rows = run_sweep(s)
    assert ran[2:] == [("kara", 0)]  # vanilla was complete; kara had one cell of two
    cells = sorted((r["system"], r["concurrency"]) for r in rows)
    assert cells == [("kara", 2), ("kara", 4), ("vanilla", 2), ("vanilla", 4)]


def test_snapkv_threshold_budget_matches_karas_footprint() -> None:
    from kvllm.bench.throughput import matched_threshold_budget
    from kvllm.policy import physical_growth

    kara = CompressionConfig()
    budget = matched_threshold_budget(kara, 2048, 64)
    snap = kara.replace(method="snapkv", policy="threshold", threshold_budget=budget, threshold_interval=64)
    # Once saturated, SnapKV-threshold's generated slots average what Kara holds at the end.
    assert abs(physical_growth(snap, 2048)[-512:].mean() - physical_growth(kara, 2048)[-1]) < 2
