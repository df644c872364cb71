"""One engine, two grades: a goodput run's statement grade inside vLLM (batched, under
preemption) against ``kvllm eval``'s transformers backend on the same seeds and settings.

A goodput system and an eval cell match when they run the same method at the same
retention, window and buffer under the periodic policy, ``kvllm eval``'s only one
(``vanilla-*`` matches the Full-KV cell). Both are greedy,
so where the two engines compute the same thing they write the same chain, up to the
shorter of their two token caps; where they do not, the statement grades must still
agree within their paired interval, or the selection depends on the scheduler, which is
a bug.
"""

from __future__ import annotations

import gzip
import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvllm.bench.goodput import VANILLA, completions_path
from kvllm.eval import grid
from kvllm.eval.grid import FULL, CellResult
from kvllm.eval.stats import paired_difference


def _texts(path: Path, key: str) -> dict[int, str]:
    if not path.exists():
        return {}
    with gzip.open(path, "rt") as f:
        return {int(r[key]): r["text"] for r in map(json.loads, f)}


def _match(row: dict[str, Any], cells: Sequence[CellResult]) -> CellResult | None:
    """The free eval cell that ran what ``row``'s system ran, on its family. A calibrated
    method matches nothing: rows keep its file's path, not what the file held when they
    ran, so two runs cannot be known to have read the same one."""
    comp = row.get("compression")
    if comp and "calibration" in comp.get("params", {}):
        return None
    if comp and comp.get("policy", "periodic") != "periodic":  # kvllm eval runs the periodic policy only
        return None
    for cell in cells:
        if cell.mode != "free" or cell.statements is None or cell.family != row["family"]:
            continue
        if row["system"] in VANILLA:
            if cell.method == FULL:
                return cell
        elif comp and (comp["method"], comp["retention"], comp["window"], comp["buffer"]) == (
            cell.method,
            cell.retention,
            cell.window,
            cell.buffer,
        ):
            return cell
    return None


def _pooled(records: dict[int, dict[str, Any]], seeds: Sequence[int]) -> tuple[list[int], list[int]]:
    """Per seed, statements right and graded (the program's plus the chain's extra ones)."""
    return [records[s]["right"] for s in seeds], [records[s]["statements"] + records[s]["extra"] for s in seeds]


def first_difference(a: str, b: str) -> int | None:
    """The first line (0-based) at which two chains differ; ``None`` when they are equal,
    or when one is the start of the other (the two runs' token caps differ: the same
    chain stopped at two lengths)."""
    if a.startswith(b) or b.startswith(a):
        return None
    la, lb = a.splitlines(), b.splitlines()
    return next((i for i, (x, y) in enumerate(zip(la, lb, strict=False)) if x != y), min(len(la), len(lb)))


def agreement(goodput: Path, accuracy: Path) -> list[dict[str, Any]]:
    """Per goodput system (first pool and concurrency) with a matching eval cell: the
    seeds both graded, how many chains are token-identical, and both statement grades."""
    from kvllm.bench.goodput import load_rows

    rows = load_rows(goodput)
    cells = list(grid.load_results(accuracy / "results.jsonl").values())
    if not rows or not cells:
        return []
    first = min((r["pool"], r["concurrency"]) for r in rows)
    out = []
    for system in sorted({r["system"] for r in rows}):
        mine = sorted(
            (r for r in rows if r["system"] == system and (r["pool"], r["concurrency"]) == first),
            key=lambda r: r["repeat"],
        )
        cell = _match(mine[0], cells) if mine else None
        if cell is None:
            continue
        hf = {int(p["uid"]): p["statements"] for p in cell.problems}
        seeds = sorted(set(hf) & {r["seed"] for r in mine[0]["records"]})
        by_repeat = [{r["seed"]: r for r in row["records"]} for row in mine]

        v_right, v_total = _pooled(by_repeat[0], seeds)
        h_right, h_total = [hf[s]["right"] for s in seeds], [hf[s]["total"] for s in seeds]
        shares = [sum(r) / sum(n) for r, n in (_pooled(rec, seeds) for rec in by_repeat)]
        ours = _texts(completions_path(goodput, mine[0]), "seed")
        theirs = _texts(grid.completions_path(accuracy, cell.key), "uid")
        both = [s for s in seeds if s in ours and s in theirs]
        diverge = [first_difference(ours[s], theirs[s]) for s in both]
        out.append(
            {
                "system": system,
                "cell": f"{cell.method} r={cell.retention:g} W={cell.window} b={cell.buffer}",
                "seeds": len(seeds),
                "compared": len(diverge),
                "identical": sum(d is None for d in diverge),
                "same_length": sum(ours[s] == theirs[s] for s in both),
                "first_difference": statistics.median(d for d in diverge if d is not None)
                if any(d is not None for d in diverge)
                else None,
                "vllm": (sum(v_right) / sum(v_total), min(shares), max(shares)),
                "hf": sum(h_right) / sum(h_total),
                "difference": paired_difference(v_right, v_total, h_right, h_total),
                "stopped": (sum(by_repeat[0][s]["stopped"] for s in seeds), sum(hf[s]["stopped"] for s in seeds)),
            }
        )
    return out


def markdown(entries: Sequence[dict[str, Any]]) -> str:
    """The agreement table, a row per matched system."""
    lines = [
        "| system (vLLM) | cell (transformers) | seeds | chains identical (of them, to the same length) "
        "| where the others differ (line, median) "
        "| statements right, vLLM [min-max over repeats] | transformers | vLLM - transformers [95% paired CI] "
        "| stopped right, vLLM / transformers |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for e in entries:
        v, v_lo, v_hi = e["vllm"]
        d, d_lo, d_hi = e["difference"]
        line = "-" if e["first_difference"] is None else f"{e['first_difference']:g}"
        lines.append(
            f"| `{e['system']}` | {e['cell']} | {e['seeds']} | {e['identical']}/{e['compared']} ({e['same_length']}) "
            f"| {line} "
            f"| {v:.3f} [{v_lo:.3f}-{v_hi:.3f}] | {e['hf']:.3f} | {d:+.3f} [{d_lo:+.3f}, {d_hi:+.3f}] "
            f"| {e['stopped'][0]}/{e['seeds']} / {e['stopped'][1]}/{e['seeds']} |"
        )
    return "\n".join(lines) + "\n"
