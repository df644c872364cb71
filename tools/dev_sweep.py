"""Every knob variant tried, on development seeds only: the accuracy record's "Tuning record".

Teacher-forced (every method sees Full KV's tokens, so a difference is the selection),
trace, 48 steps, 8 constants, at one retention, on the shipped model; or, with
``--model M --family reason --mode reference-forced --variants second-model``, the
sweep of the paper's baselines and Kara on another model and family (every method sees
the tasks' own chains). Each variant runs as its own
``kvllm eval`` cell (the grid's code: same cache, policy, rounds, grading) in
``OUT/<variant>/``; the Full-KV free cell runs once and is shared. Writes ``OUT/sweep.md``:
each variant's generated-read lookup fidelity with its bootstrap interval, the memory
held, and its paired difference to the method's default on the same problems.

    python tools/dev_sweep.py --out /tmp/dev-sweep --n 64 --retention 0.2 [--methods kara-vpool,...]
    python tools/dev_sweep.py --out /tmp/sweep-6l --n 32 --family reason --mode reference-forced \
        --variants second-model --model kara-reasoner-6l

Development seeds (100000 on) never overlap the reported test seeds (0 on), so what this
chooses is reported on problems it never saw.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from kvllm import CompressionConfig
from kvllm.cli.options import load_model, trained_op
from kvllm.eval.grid import run_grid
from kvllm.eval.problems import task_problems
from kvllm.eval.stats import bootstrap_ratio, paired_difference
from kvllm.eval.tasks import Difficulty, default_difficulty

# The first seed of `kvllm eval --split dev` (its --dev-seeds default).
DEV_FIRST_SEED = 100_000

# A variant: (method, parameter overrides, window, buffer).
Variant = tuple[str, dict, int, int]


def at(method: str, *params: dict, window: int = 128, buffer: int = 32) -> list[Variant]:
    """``method`` with each of ``params`` in turn, at one window and buffer."""
    return [(method, p, window, buffer) for p in params]


# Knob sets that both sweeps below run; each starts with the method's default ({}).
KARA_KNOBS = ({}, {"rho": 0.25}, {"rho": 0.75}, {"beta": 0.0}, {"beta": 2.0}, {"max_gap": 4}, {"max_gap": 32})
OBS_WINDOWS = ({}, {"obs_window": 64}, {"obs_window": 128})  # PyramidKV's and AdaKV's

# The shipped model's trace sweep, in the order the rounds ran; the first of each method is its default.
VARIANTS: list[Variant] = [
    *at("kara", *KARA_KNOBS),
    *at("kara", {}, window=64, buffer=16),
    *at("kara", {}, window=128, buffer=64),
    *at("kara", {}, window=256, buffer=64),
    *at("kara-far", {}, {"band": 4}, {"band": 16}),
    *at("snapkv", {}, {"obs_window": 8}, {"obs_window": 16}, {"obs_window": 64}),
    *at("snapkv", {"pool_kernel": 1}, {"pool_kernel": 3}, {"pool_kernel": 15}),
    *at("chunkkv", {}, {"chunk_size": 5}, {"chunk_size": 10}, {"chunk_size": 40}),
    *at("rkv", {}, {"lam": 0.0}, {"lam": 0.03}, {"lam": 0.15}, {"lam": 0.3}),
    # Second round, after the first showed the observation window matters most.
    *at("snapkv", {"obs_window": 96}, {"obs_window": 128}, {"obs_window": 160}, {"obs_window": 64, "pool_kernel": 3}),
    *at("chunkkv", {"chunk_size": 2}, {"chunk_size": 3}, {"chunk_size": 5, "obs_window": 64}),
    *at("pyramidkv", *OBS_WINDOWS),
    *at("adakv", *OBS_WINDOWS),
    *at("rkv", {"obs_window": 32}, {"obs_window": 64}),
    # Third round: the best single knobs together.
    *at("rkv", {"obs_window": 32, "lam": 0.3}, {"obs_window": 64, "lam": 0.3}),
    *at("chunkkv", {"chunk_size": 2, "obs_window": 96}),
    *at("snapkv", {"obs_window": 96, "pool_kernel": 3}),
    # kara-late (docs/design.md), after the observation window mattered for SnapKV.
    *at("kara-late", {}, {"obs_window": 32}, {"obs_window": 96}, {"obs_window": 128}),
    # The best value-aware Kara's knobs, beside the kvpress scorer it trails.
    *at("kara-vpool", {}, {"pool_kernel": 1}, {"pool_kernel": 5}, {"pool_kernel": 7}),
    *at("kara-vpool", {"rho": 0.25}, {"rho": 0.75}, {"max_gap": 4}, {"max_gap": 32}, {"beta": 0.0}),
    # Its second round: the two knobs that helped, together, and rho=1 (every top token an endpoint).
    *at("kara-vpool", {"rho": 0.75, "max_gap": 4}, {"rho": 1.0}, {"rho": 1.0, "max_gap": 4}),
    *at("kara-vpool", {"pool_kernel": 7, "rho": 0.75, "max_gap": 4}),
    # Its third round: the kernel around that best, on the non-modal grade.
    *at("kara-vpool", {"pool_kernel": 5, "rho": 0.75, "max_gap": 4}, {"pool_kernel": 9, "rho": 0.75, "max_gap": 4}),
    *at("kara-vpool", {"pool_kernel": 7, "rho": 1.0}),
    *at("noncausal-attn", {}),
    # The further methods with knobs, each default first (non-modal criterion).
    # knorm, keydiff, tova, noncausal-attn and qfilter have none.
    *at("lagkv", {}, {"lag_size": 16}, {"lag_size": 64}),
    *at("compactor", {}, {"blending": 0.0}, {"blending": 0.3}, {"sketch_dimension": 96}),
    *at("expected-attention", {}, {"n_future_positions": 128}, {"n_future_positions": 2048}),
    *at("expected-attention", {"use_covariance": False}),
    # The value-aware and two-way Karas at kara-vpool's tuned knobs, where they apply.
    *at("kara-vnorm", {}, {"rho": 0.75, "max_gap": 4}),
    *at("kara-pool", {}, {"pool_kernel": 7, "rho": 0.75, "max_gap": 4}),
    *at("kara-twoway", {}, {"rho": 0.75, "max_gap": 4}),
    *at("kara", {"rho": 0.75, "max_gap": 4}),
]


# The second model: the single knobs of the paper's baselines and Kara from the first rounds
# above, and the pairs that won there, fixed before any of them ran on the second model.
SECOND_MODEL_VARIANTS: list[Variant] = [
    *at("kara", *KARA_KNOBS, {"rho": 0.75, "max_gap": 4}),
    *at("snapkv", {}, {"obs_window": 16}, {"obs_window": 64}, {"obs_window": 96}, {"obs_window": 160}),
    *at("snapkv", {"pool_kernel": 1}, {"pool_kernel": 15}),
    *at("chunkkv", {}, {"chunk_size": 2}, {"chunk_size": 5}, {"chunk_size": 40}, {"chunk_size": 2, "obs_window": 96}),
    *at("pyramidkv", *OBS_WINDOWS),
    *at("adakv", *OBS_WINDOWS),
]
VARIANT_SETS = {"trace": VARIANTS, "second-model": SECOND_MODEL_VARIANTS}


def label(method: str, params: dict, window: int, buffer: int) -> str:
    knobs = [f"{k}={v}" for k, v in params.items()]
    if (window, buffer) != (128, 32):
        knobs.append(f"W={window},b={buffer}")
    return method + (" " + " ".join(knobs) if knobs else " (default)")


def sweep_difficulty(family: str, model: Path | None) -> Difficulty:
    """Trace as in the grid (48 steps, 8 constants), reason at its defaults, each on the
    operator ``model`` was trained on, as in ``kvllm eval``: on another one its arithmetic,
    and the reads of its results, fail (a first sweep of ``kara-reasoner-6l`` v2 ran on
    ``add``, which it never learned, and Full KV read back 0.891 of the values, not 1.000)."""
    difficulty = Difficulty(constants=8, steps=48) if family == "trace" else default_difficulty(family)
    return dataclasses.replace(difficulty, op=trained_op(model))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("dev-sweep"))
    parser.add_argument("--n", type=int, default=64)
    parser.add_argument("--retention", type=float, default=0.2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--methods", default="", help="Only these methods' variants (commas); default: all.")
    parser.add_argument("--model", type=Path, default=None, help="A model directory; default: the shipped one.")
    parser.add_argument("--family", choices=("trace", "reason"), default="trace")
    parser.add_argument("--mode", choices=("teacher-forced", "reference-forced"), default="teacher-forced")
    parser.add_argument("--variants", choices=sorted(VARIANT_SETS), default="trace")
    args = parser.parse_args()
    only = set(filter(None, args.methods.split(",")))

    tok, lm = load_model(args.model)
    difficulty = sweep_difficulty(args.family, args.model)
    problems = {args.family: task_problems(args.family, args.n, difficulty, tok, DEV_FIRST_SEED)}
    full_dir = args.out / "full"
    # Teacher-forced cells force the free Full-KV cell's completions (shared below);
    # reference-forced ones force the tasks' own chains, and Full KV reads them too.
    full = run_grid(
        lm, tok, problems, [], [1.0], CompressionConfig(period=16), full_dir,
        batch_size=args.batch_size, mode="free" if args.mode == "teacher-forced" else args.mode,
    )[0]  # fmt: skip
    rows, defaults = [], {}
    for method, params, window, buffer in (v for v in VARIANT_SETS[args.variants] if not only or v[0] in only):
        base = CompressionConfig(window=window, buffer=buffer, period=16)
        name = label(method, params, window, buffer)
        out = args.out / name.replace(" ", "_").replace("(", "").replace(")", "")
        out.mkdir(parents=True, exist_ok=True)
        if args.mode == "teacher-forced" and not (out / "results.jsonl").exists():
            # Full KV compresses nothing, so its completions serve every W and b.
            shared = dataclasses.replace(full, window=window, buffer=buffer)
            (out / "results.jsonl").write_text(json.dumps(dataclasses.asdict(shared)) + "\n")
        cells = run_grid(
            lm, tok, problems, [method], [args.retention], base, out,
            batch_size=args.batch_size, mode=args.mode, params={method: params},
        )  # fmt: skip
        cell = next(c for c in cells if c.method == method)
        right = [p["right"]["generated"] for p in cell.problems]
        total = [p["reads"]["generated"] for p in cell.problems]
        defaults.setdefault(method, (right, total))
        diff = paired_difference(right, total, *defaults[method])
        row = (name, cell.fidelity_generated, bootstrap_ratio(right, total), cell.fidelity_nonmodal, cell.held_mean)
        rows.append((*row, diff, cell.seconds))
        print(json.dumps({"variant": name, "fidelity": cell.fidelity_generated, "held": cell.held_mean}), flush=True)
    lines = [
        f"Development seeds {DEV_FIRST_SEED}-{DEV_FIRST_SEED + args.n - 1}, {args.family} {difficulty.steps} steps, "
        f"op {difficulty.op}, "
        f"{args.mode}, model {args.model or 'shipped'}, "
        f"r={args.retention}, P=16. Full KV: {full.fidelity_generated:.3f}. Non-modal: the reads off each "
        "chain's modal value (kvllm/eval/lookup.py).",
        "",
        "| variant | generated-read fidelity [95% CI] | non-modal | held (time-avg) "
        "| minus the default [95% paired CI] | s |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, fid, (lo, hi), nonmodal, held, (d, dlo, dhi), secs in rows:
        diff = "-" if name.endswith("(default)") else f"{d:+.3f} [{dlo:+.3f}, {dhi:+.3f}]"
        other = "-" if nonmodal is None else f"{nonmodal:.3f}"
        lines.append(f"| {name} | {fid:.3f} [{lo:.3f}-{hi:.3f}] | {other} | {held:.2f} | {diff} | {secs:.0f} |")
    (args.out / "sweep.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
