"""``kvllm generate``: prompts or held-out tasks through either backend."""

from __future__ import annotations

import time
from typing import Annotated

import typer

from kvllm.cli.options import (
    Backend,
    Buffer,
    D,
    Lazy,
    LazyKeep,
    Model,
    Op,
    Param,
    Period,
    Policy,
    Retention,
    Window,
    console,
    load_model,
    make_config,
    model_path,
    parse_params,
    progress,
    trained_op,
)
from kvllm.eval.tasks import FAMILIES


def generate(
    prompts: Annotated[list[str] | None, typer.Argument(help="One or more prompts, generated as one batch.")] = None,
    task: Annotated[str | None, typer.Option(help=f"Instead of PROMPTS: held-out tasks of {FAMILIES}.")] = None,
    n_tasks: Annotated[int, typer.Option(help="With --task: how many (seeds 0..n-1).")] = 2,
    steps: Annotated[int, typer.Option(help="With --task: program steps (CoT about 18 tokens each).")] = 30,
    op: Op = None,
    model: Model = None,
    backend: Annotated[Backend, typer.Option(help="hf (transformers reference) or vllm (KvLLM proper).")] = Backend.hf,
    method: Annotated[str, typer.Option(help="Selection method, or 'none' for Full KV.")] = D.method,
    retention: Retention = D.retention,
    window: Window = D.window,
    buffer: Buffer = D.buffer,
    period: Period = D.period,
    policy: Policy = D.policy,
    lazy: Lazy = D.lazy,
    lazy_keep: LazyKeep = D.lazy_keep,
    param: Param = None,
    max_new_tokens: Annotated[int, typer.Option(help="Tokens to generate per prompt.")] = 256,
    temperature: Annotated[float, typer.Option(help="0 for greedy.")] = 0.0,
    top_p: Annotated[float, typer.Option(help="Nucleus sampling mass.")] = 1.0,
    seed: Annotated[int, typer.Option(help="Sampling seed.")] = 0,
    ignore_eos: Annotated[bool, typer.Option(help="Generate all max-new-tokens (equal work per run).")] = False,
) -> None:
    """Generate with KV compression and print the texts and the cache statistics."""
    from kvllm.eval.statements import grade, program
    from kvllm.eval.tasks import Difficulty, make_task
    from kvllm.generation import stats_table

    config = None
    if method != "none":
        config = make_config(
            method=method, retention=retention, window=window, buffer=buffer, period=period, policy=policy,
            lazy=lazy, lazy_keep=lazy_keep, params=parse_params(param),
        )  # fmt: skip
    if task is not None and task not in FAMILIES:
        raise typer.BadParameter(f"--task {task!r} is invalid: must be one of {', '.join(FAMILIES)}")
    try:
        difficulty = Difficulty(constants=8, steps=steps, op=op or trained_op(model))
    except ValueError as err:
        raise typer.BadParameter(str(err)) from err
    tasks = [make_task(task, s, difficulty) for s in range(n_tasks)] if task else []
    prompts = [t.prompt for t in tasks] or prompts
    if not prompts:
        raise typer.BadParameter("give PROMPTS or --task")
    sampling = {"temperature": temperature, "top_p": top_p, "seed": seed, "stop_at_eos": not ignore_eos}
    start = time.perf_counter()
    if backend is Backend.vllm:
        from kvllm.vllm.llm import generate as vllm_generate

        result = vllm_generate(str(model_path(model)), prompts, config, max_new_tokens, **sampling)
    else:
        from kvllm.hf import generate as hf_generate

        tok, lm = load_model(model)
        with progress("generating") as bar:
            job = bar.add_task("gen", total=max_new_tokens)
            on_step = lambda n: bar.update(job, completed=n)  # noqa: E731
            result = hf_generate(lm, tok, prompts, config, max_new_tokens, **sampling, on_step=on_step)
    elapsed = time.perf_counter() - start
    for i, text in enumerate(result.texts):
        console.rule(f"prompt {i}")
        console.print(prompts[i] + text, markup=False, highlight=False)
        if tasks:
            prog = program(tasks[i].prompt)
            g = grade(prog, text)
            stop = "stopped at the program's end" if g.stopped else "did not stop at the program's end"
            console.print(
                f"statements right {g.right} of {g.statements} ({g.extra} extra statement lines); {stop}; "
                f"answer {'right' if g.answered else 'wrong'} (the task's answer line: {prog.answer})",
                highlight=False,
            )
    console.print(stats_table(result, f"cache statistics ({method}, retention {retention}, {backend})"))
    total = sum(len(ids) for ids in result.token_ids)
    startup = " (with the engine's start-up)" if backend is Backend.vllm else ""
    console.print(f"{total} tokens in {elapsed:.2f} s{startup}: {total / elapsed:.1f} tokens/s")
