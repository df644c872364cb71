"""The goodput report: per-system accuracy and cost, the iso-accuracy table, and the plot.

Accuracy is graded on the first repeat's completions (greedy: the repeats write the
same, up to a near tie), each task against the same task under vanilla vLLM at its
defaults (the baseline): paired bootstrap intervals resample tasks. Speed ratios are
taken within each repeat, against the baseline of that repeat, then averaged (with the
smallest and largest over repeats).
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # headless: files only
import matplotlib.pyplot as plt

from kvllm.bench.goodput import BASELINE, LIMIT, VANILLA
from kvllm.eval.stats import paired_ratio, wilson
from kvllm.plots import save_figure

# A system keeps Full KV's accuracy when both its statements right and its stopped right
# are at least this share of the baseline's (answers alone can rise
# under compression, so they are reported, not required).
ISO_ACCURACY = 0.98
SPEEDS = ("statements_right_s", "answers_right_s", "tok_s")


def method_of(system: str) -> str:
    """A system's curve: its name without the retention and window (``kara@0.5/256/64`` -> ``kara``)."""
    return system.split("@")[0]


def summarize(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per (pool, concurrency, system): accuracy with intervals, and speed ratios."""
    by = {(r["pool"], r["concurrency"], r["system"], r["repeat"]): r for r in rows}
    out = []
    for pool, c in sorted({(r["pool"], r["concurrency"]) for r in rows}):
        base0 = by.get((pool, c, BASELINE, 0))
        if base0 is None:
            continue
        systems = sorted({k[2] for k in by if k[:2] == (pool, c)}, key=_order)
        for system in systems:
            mine = sorted((v for k, v in by.items() if k[:3] == (pool, c, system)), key=lambda r: r["repeat"])
            first = next((r for r in mine if r["repeat"] == 0), mine[0])
            entry = {
                "pool": pool, "concurrency": c, "system": system, "method": method_of(system),
                "repeats": len(mine), "retention": (first.get("compression") or {}).get("retention", 1.0),
                "window": (first.get("compression") or {}).get("window"),
                "buffer": (first.get("compression") or {}).get("buffer"),
                "pool_blocks": first["pool_blocks"], "cap": first["cap"],
            }  # fmt: skip
            entry.update(_accuracy(first, base0))
            for name in ("seconds", "tok_s", "statements_right_s", "answers_right_s", "preemptions", "compress_share"):
                values = [r[name] for r in mine]
                entry[name] = statistics.fmean(values)
                entry[f"{name}_range"] = (min(values), max(values))
            entry["compress_share_max"] = max(r["compress_share"] for r in mine)
            for name in SPEEDS:
                entry[f"{name}_ratio"] = _ratio(by, mine, (pool, c, BASELINE), name)
            # Wall time for the same tasks over the baseline's (< 1 is faster).
            entry["wall_ratio"] = _ratio(by, mine, (pool, c, BASELINE), "seconds")
            out.append(entry)
    return out


def _order(system: str) -> tuple[int, str]:
    return (VANILLA.index(system) if system in VANILLA else len(VANILLA), system)


def _accuracy(row: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    mine, theirs = row["records"], base["records"]
    if [r["seed"] for r in mine] != [r["seed"] for r in theirs]:
        raise ValueError(f"{row['system']} and {BASELINE} graded different tasks")
    n = len(mine)
    right = [r["right"] for r in mine]
    total = [r["statements"] + r["extra"] for r in mine]
    share, lo, hi = paired_ratio(
        right, total, [r["right"] for r in theirs], [r["statements"] + r["extra"] for r in theirs]
    )
    stopped = sum(r["stopped"] for r in mine)
    answers = sum(r["answered"] for r in mine)
    base_stopped = sum(r["stopped"] for r in theirs)
    base_tokens = statistics.fmean(r["tokens"] for r in theirs)
    return {
        "tasks": n,
        "statements_share": sum(right) / sum(total),
        "statements_ratio": (share, lo, hi),  # of the baseline's, paired over tasks
        "stopped_right": stopped,
        # NaN when the baseline never stopped right: then no system can be said to keep it.
        "stopped_ratio": stopped / base_stopped if base_stopped else float("nan"),
        "answers_right": answers,
        "answers_ci": wilson(answers, n),
        "answers_ratio": answers / max(1, sum(r["answered"] for r in theirs)),
        "mean_tokens": statistics.fmean(r["tokens"] for r in mine),
        "length_ratio": statistics.fmean(r["tokens"] for r in mine) / base_tokens,
        "cap_hits": sum(r["cap_hit"] for r in mine),
        "held_end": statistics.fmean(r["held_end"] for r in mine),
        "longest_baseline_chain": max(r["tokens"] for r in theirs),
    }


def _ratio(
    by: dict[tuple, dict[str, Any]], mine: list[dict[str, Any]], base: tuple, name: str
) -> tuple[float, float, float]:
    """Mean of the within-repeat ratios to the baseline, and their min and max (a system
    that scored 0 in a repeat counts as 0; a baseline that scored 0 gives no ratio)."""
    ratios = []
    for r in mine:
        b = by.get((*base, r["repeat"]))
        if b is not None and b[name]:
            ratios.append(r[name] / b[name])
    if not ratios:
        return (float("nan"),) * 3
    return (statistics.fmean(ratios), min(ratios), max(ratios))


def keeps_accuracy(entry: dict[str, Any]) -> bool:
    """Statements right and stopped right both at least :data:`ISO_ACCURACY` of the baseline's."""
    return entry["statements_ratio"][0] >= ISO_ACCURACY and entry["stopped_ratio"] >= ISO_ACCURACY


def iso_accuracy(summary: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (pool, concurrency, method): its fastest cell that keeps Full KV's accuracy
    (goodput in statements right per second), or ``None`` with its most accurate cell."""
    groups: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for e in summary:
        if e["system"] not in VANILLA:
            groups[(e["pool"], e["concurrency"], e["method"])].append(e)
    out = []
    for (pool, c, method), entries in groups.items():
        kept = [e for e in entries if keeps_accuracy(e)]
        best = max(kept, key=lambda e: e["statements_right_s_ratio"][0]) if kept else None
        closest = max(entries, key=lambda e: (e["statements_ratio"][0], e["stopped_ratio"]))
        out.append({"pool": pool, "concurrency": c, "method": method, "best": best, "closest": closest})
    return out


def _f(x: float, digits: int = 2) -> str:
    return "-" if x != x else f"{x:.{digits}f}"


def _r(t: tuple[float, float, float], digits: int = 2) -> str:
    return f"{_f(t[0], digits)} [{_f(t[1], digits)}-{_f(t[2], digits)}]"


def markdown(summary: Sequence[dict[str, Any]], command: str = "") -> str:
    """``summary.md``: the iso-accuracy table, then every cell."""
    lines = ["# Goodput", ""]
    if command:
        lines += ["```bash", command, "```", ""]
    lines += [
        f"Accuracy keeps Full KV's when statements right and stopped right are both >= {ISO_ACCURACY:.2f} of "
        f"{BASELINE}'s (paired over the same tasks). Goodput is statements right per second; every ratio is to "
        f"{BASELINE} in the same repeat (mean [min-max] over repeats).",
        "",
        "## At Full KV's accuracy",
        "",
        "| pool | C | method | cell | statements right / Full KV's | stopped right | goodput / vLLM "
        "| wall time / vLLM's | answers right | chain / Full KV's |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    limits = {(e["pool"], e["concurrency"]): e for e in summary if e["system"] == LIMIT}
    for row in iso_accuracy(summary):
        e, note = row["best"], ""
        if e is None:
            e, note = row["closest"], " (none keeps it; the most accurate)"
        lines.append(
            f"| {row['pool']} | {row['concurrency']} | {row['method']} | {e['system']}{note} | "
            f"{_r(e['statements_ratio'], 3)} | {e['stopped_right']}/{e['tasks']} | "
            f"{_r(e['statements_right_s_ratio'])} | {_f(e['wall_ratio'][0])} | {e['answers_right']}/{e['tasks']} "
            f"| {_f(e['length_ratio'])} |"
        )
    for (pool, c), e in limits.items():
        lines.append(
            f"\nThe limit ({LIMIT}: vLLM with a pool that never preempts) serves "
            f"{_r(e['statements_right_s_ratio'])}x {BASELINE}'s goodput (pool {pool}, C={c})."
        )
    lines += [
        "",
        "## Every cell",
        "",
        "| pool | C | system | statements right [95% CI] | / Full KV's | stopped | answers right | mean chain "
        "| / Full KV's | cap hits | held at end | wall s | tok/s | goodput (right/s) | / vLLM | answers/s / vLLM "
        "| preemptions | rounds' share (max) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for e in summary:
        a_lo, a_hi = e["answers_ci"]
        lines.append(
            f"| {e['pool']} | {e['concurrency']} | {e['system']} | {_f(e['statements_share'], 3)} | "
            f"{_r(e['statements_ratio'], 3)} | {e['stopped_right']}/{e['tasks']} | {e['answers_right']}/{e['tasks']} "
            f"[{_f(a_lo)}-{_f(a_hi)}] | {e['mean_tokens']:.0f} | {_f(e['length_ratio'])} | {e['cap_hits']} | "
            f"{_f(e['held_end'])} | {e['seconds']:.0f} | {e['tok_s']:.0f} | {e['statements_right_s']:.1f} | "
            f"{_r(e['statements_right_s_ratio'])} | {_r(e['answers_right_s_ratio'])} | {e['preemptions']:.0f} | "
            f"{e['compress_share']:.3f} ({e['compress_share_max']:.3f}) |"
        )
    longest = max(e["longest_baseline_chain"] for e in summary)
    cap = summary[0]["cap"]
    verdict = "" if cap >= 1.5 * longest else " (under 1.5x: a chain that runs long is not fully charged)"
    lines += ["", f"Full KV's longest chain: {longest} tokens; the cap, {cap}, is {cap / longest:.2f}x it{verdict}."]
    return "\n".join(lines) + "\n"


def plot(summary: Sequence[dict[str, Any]], path: Path, title: str = "") -> Path:
    """Accuracy as a share of Full KV's (x) against goodput over vLLM's (y), a curve per method."""
    groups = sorted({(e["pool"], e["concurrency"]) for e in summary})
    fig, axes = plt.subplots(1, len(groups), figsize=(6.5 * len(groups), 4.5), squeeze=False)
    for ax, (pool, c) in zip(axes[0], groups, strict=True):
        cells = [e for e in summary if (e["pool"], e["concurrency"]) == (pool, c)]
        methods = sorted({e["method"] for e in cells if e["system"] not in VANILLA})
        for i, method in enumerate(methods):
            points = sorted(
                ((e["statements_ratio"][0], e["statements_right_s_ratio"][0], e["system"]) for e in cells
                 if e["method"] == method),
                key=lambda p: p[0],
            )  # fmt: skip
            ax.plot([p[0] for p in points], [p[1] for p in points], "o-", color=f"C{i}", label=method)
            for x, y, system in points:
                ax.annotate(system.split("@")[-1], (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points")
        for e in cells:
            if e["system"] in VANILLA:
                ax.plot([e["statements_ratio"][0]], [e["statements_right_s_ratio"][0]], "k*" if e["system"] == BASELINE
                        else "k^", label=e["system"])  # fmt: skip
        ax.axvline(ISO_ACCURACY, color="grey", linestyle=":", label=f"{ISO_ACCURACY:.2f} of Full KV")
        ax.axhline(1.0, color="grey", linewidth=0.5)
        ax.set_xlabel("statements right, share of Full KV's")
        ax.set_ylabel("goodput (statements right/s) over vLLM's")
        ax.set_title(f"pool {pool}, C={c}", fontsize=9)
        ax.legend(fontsize=7)
    return save_figure(fig, path, title=title or "Goodput against accuracy")


def write_report(rows: Sequence[dict[str, Any]], out: Path, command: str = "") -> list[dict[str, Any]]:
    """``summary.json``, ``summary.md`` and ``goodput.png`` under ``out``."""
    summary = summarize(rows)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out / "summary.md").write_text(markdown(summary, command))
    plot(summary, out / "goodput.png")
    return summary
