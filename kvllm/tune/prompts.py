"""The prompts ``kvllm tune`` measures: a user's jsonl, or a shipped task family's."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: Fewer prompts than this cannot tell a tolerance of a few percent from noise.
MIN_PROMPTS = 16
#: The first development seed (``kvllm eval --split dev``): tuning never sees a test seed.
DEV_SEED = 100_000


@dataclass(frozen=True)
class TunePrompt:
    """One prompt as the engine gets it (a chat already rendered), with what grades it.

    ``answer`` is the gold answer, if the user gave one; ``task`` a shipped family's task,
    graded by the family's own grade.
    """

    uid: str
    text: str
    answer: str | None = None
    task: Any = None


def load_prompts(path: Path, tokenizer: Any) -> list[TunePrompt]:
    """One prompt a line: ``{"prompt": "..."}`` (plain text) or ``{"messages": [...]}``
    (a chat, rendered with the model's template), each with an optional gold ``"answer"``."""
    prompts = []
    for i, line in enumerate(Path(path).read_text().splitlines()):
        if not line.strip():
            continue
        where = f"{path}:{i + 1}"
        try:
            row = json.loads(line)
        except ValueError as err:
            raise ValueError(f"{where}: not a JSON object: {err}") from err
        if not isinstance(row, dict) or ("prompt" in row) == ("messages" in row):
            raise ValueError(f'{where}: each line needs exactly one of "prompt" (a string) or "messages" (a chat)')
        if "prompt" in row:
            if not isinstance(row["prompt"], str) or not row["prompt"]:
                raise ValueError(f'{where}: "prompt" must be a non-empty string')
            text = row["prompt"]
        else:
            if getattr(tokenizer, "chat_template", None) is None:
                raise ValueError(f'{where}: "messages" needs a chat template, and this model has none')
            text = tokenizer.apply_chat_template(row["messages"], tokenize=False, add_generation_prompt=True)
        answer = row.get("answer")
        prompts.append(TunePrompt(str(row.get("id", i)), text, None if answer is None else str(answer)))
    return check_count(prompts, str(path))


def family_prompts(family: str, n: int, op: str) -> list[TunePrompt]:
    """``n`` tasks of a shipped family at its default difficulty, on development seeds."""
    from kvllm.eval.tasks import FAMILIES, default_difficulty, make_task

    if family not in FAMILIES:
        raise ValueError(f"--family {family!r} is invalid: must be one of {', '.join(FAMILIES)}")
    difficulty = dataclasses.replace(default_difficulty(family), op=op)
    tasks = [make_task(family, DEV_SEED + i, difficulty) for i in range(n)]
    return check_count([TunePrompt(str(t.seed), t.prompt, t.answer, t) for t in tasks], f"--family {family}")


def check_count(prompts: list[TunePrompt], source: str) -> list[TunePrompt]:
    if len(prompts) < MIN_PROMPTS:
        raise ValueError(
            f"{source} has {len(prompts)} prompts: at least {MIN_PROMPTS} are needed to decide, since with fewer "
            "a tolerance of a few percent is within one prompt's noise"
        )
    return prompts
