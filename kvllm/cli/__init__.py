"""The ``kvllm`` command: parses flags, calls the package, prints what it returns.

One module per command; shared flags and helpers in :mod:`kvllm.cli.options`.
"""

from __future__ import annotations

import typer

from kvllm.cli.bench import bench_goodput, bench_selection, bench_serve, bench_soak, bench_throughput
from kvllm.cli.calibrate import calibrate
from kvllm.cli.evaluate import evaluate
from kvllm.cli.generate import generate
from kvllm.cli.serve import serve
from kvllm.cli.tune import tune

app = typer.Typer(help="KvLLM: reasoning-LLM serving with Kara KV-cache compression.", no_args_is_help=True)
bench_app = typer.Typer(help="Benchmarks (speed targets live here, not in unit tests).", no_args_is_help=True)
app.add_typer(bench_app, name="bench")
app.command()(generate)
app.command("eval")(evaluate)
app.command()(calibrate)
app.command()(tune)
# Unknown flags pass through to vLLM.
app.command(
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True}, options_metavar="[MODEL] [OPTIONS]"
)(serve)
bench_app.command("selection")(bench_selection)
bench_app.command("throughput")(bench_throughput)
bench_app.command("goodput")(bench_goodput)
bench_app.command("serve")(bench_serve)
bench_app.command("soak")(bench_soak)


@app.callback()
def main() -> None:
    """KvLLM command line."""
