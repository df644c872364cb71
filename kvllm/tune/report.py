"""``kvllm tune``'s report: the recommendation, a table of every run, and one figure."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvllm.tune.choose import Tolerances, failures


def _interval(triple: list[float]) -> str:
    value, lo, hi = triple
    return f"{value:.3f} [{lo:.3f}-{hi:.3f}]"


def verdict(result: dict[str, Any]) -> str:
    """What to run, as ``kvllm serve`` flags, or why nothing here keeps the tolerances."""
    t = result["tolerances"]
    rule = (
        f"answers or agreement >= {t['accuracy']:g} of Full KV's, stop rate >= {t['stop']:g} of Full KV's, "
        f"mean length within {t['length']:.0%} (each at the 95% bound)"
    )
    chosen = result["recommended"]
    if chosen is not None:
        s = chosen["summary"]
        return (
            f"Recommended: `kvllm serve {result['model']} {chosen['flags']}`: {s['kv_held']:.2f} of Full KV's "
            f"generated KV held, goodput {s['goodput_ratio']:.2f}x Full KV's; it keeps {rule}."
        )
    best = result["best_failing"]
    if best is None:
        return "No setting was run."
    s = best["summary"]
    missed = "; ".join(failures(s, Tolerances(**result["tolerances"])))
    return (
        f"No setting keeps the tolerances on this model ({rule}). The best tried, `{best['flags']}`, keeps "
        f"{s['accuracy_ratio'][1]:.3f} of Full KV's answers at the 95% bound, stops {s['stop_ratio'][0]:.2f} as "
        f"often, writes {s['length_ratio'][0]:.2f}x as long, holds {s['kv_held']:.2f} of the KV, and misses: "
        f"{missed}. Serve Full KV (--kv-compression none), or loosen a tolerance knowing what it costs."
    )


def markdown(result: dict[str, Any]) -> str:
    full = result["full"]
    lines = [
        f"# kvllm tune: {result['model']}",
        "",
        f"{result['prompts']} prompts, graded by {result['grader']}. Full KV: accuracy {full['accuracy']:.3f}, "
        f"stop rate {full['stop_rate']:.3f}, {full['mean_tokens']:.0f} tokens a completion, "
        f"{full['seconds']:.1f} s for all of them.",
        "",
        verdict(result),
        "",
        "| setting | KV held | KV tokens held / request | accuracy / Full KV's [95% CI] | stop rate / Full KV's "
        "| length / Full KV's | goodput / Full KV's | passes |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for c in sorted(result["candidates"], key=lambda c: (c["setting"]["method"], -c["setting"]["retention"])):
        s = c["summary"]
        lines.append(
            f"| `{c['key']}` | {s['kv_held']:.2f} | {s['kv_held_tokens']:.0f} vs {full['mean_tokens']:.0f} "
            f"| {_interval(s['accuracy_ratio'])} | {_interval(s['stop_ratio'])} | {_interval(s['length_ratio'])} "
            f"| {s['goodput_ratio']:.2f}x | {'yes' if s['passes'] else 'no'} |"
        )
    return "\n".join(lines) + "\n\n![accuracy and goodput against KV held](tune.png)\n"


def figure(result: dict[str, Any], path: Path) -> None:
    """Accuracy (against Full KV's) and goodput against the KV held, a curve per method."""
    import matplotlib.pyplot as plt

    from kvllm.plots import save_figure

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    methods = sorted({c["setting"]["method"] for c in result["candidates"]})
    for method in methods:
        runs = sorted((c for c in result["candidates"] if c["setting"]["method"] == method),
                      key=lambda c: c["summary"]["kv_held"])  # fmt: skip
        held = [c["summary"]["kv_held"] for c in runs]
        left.plot(held, [c["summary"]["accuracy_ratio"][0] for c in runs], marker="o", label=method)
        right.plot(held, [c["summary"]["goodput_ratio"] for c in runs], marker="o", label=method)
    left.axhline(result["tolerances"]["accuracy"], color="grey", linestyle=":", label="tolerance")
    right.axhline(1.0, color="grey", linestyle=":", label="Full KV")
    left.set(xlabel="generated KV held (Full KV = 1)", ylabel="accuracy / Full KV's")
    right.set(xlabel="generated KV held (Full KV = 1)", ylabel="goodput / Full KV's")
    left.legend(fontsize=7)
    right.legend(fontsize=7)
    save_figure(fig, path, title=f"kvllm tune: {result['model']}")


def write(result: dict[str, Any], out: Path) -> Path:
    """``report.md`` and ``tune.png`` in ``out``; returns the report's path."""
    figure(result, out / "tune.png")
    path = out / "report.md"
    path.write_text(markdown(result))
    return path
