"""The accuracy grid: methods x retentions x problem families, on the reference backend.

Every finished cell is appended to ``results.jsonl`` at once, so an interrupted run
resumes where it stopped. Retention 1.0 keeps every token whatever the method, so it is
run once per family as the ``full`` (Full KV) cell and shared by every method's curve.

Each problem is graded by exact match and by lookup fidelity (:mod:`kvllm.eval.lookup`).
A cell runs in one of three modes:

- **free**: the model's own tokens;
- **teacher-forced**: the Full-KV free cell's completions are forced through the same
  compressing cache (same rounds), so every method sees the same tokens and no error
  compounds;
- **reference-forced**: the task's own completion (its true chain of thought, written by
  the generator) is forced instead. Every read is then of a value the arithmetic really
  produced (a model that cannot add, or writes ``00`` everywhere, cannot lower the
  floor), and a model is graded only on what compression endangers: reading a value back.
  This is how a model whose free chains go astray (``kara-reasoner-6l`` v1) still
  serves as a testbed, and it needs no free cell.

Only the forced modes can run the ``oracle`` selector (:mod:`kvllm.eval.oracle`); the
``bound`` (:mod:`kvllm.eval.bound`) runs in every mode.
"""

from __future__ import annotations

import csv
import hashlib
import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvllm.config import CompressionConfig
from kvllm.eval.problems import Problem

FULL = "full"
# A folder's stored cells resume only for the model that computed them.
MODEL_FILE = "model.json"
ORACLE = "oracle"
BOUND = "bound"
#: Selectors in place of a method (kvllm.eval.oracle, kvllm.eval.bound): they take no
#: params and are not in the method registry.
SELECTORS = (ORACLE, BOUND)
#: The selectors that read the forced sequence's future, so run in forced cells only.
FORCED_ONLY = (ORACLE,)
MODES = ("free", "teacher-forced", "reference-forced")
FORCED_MODES = MODES[1:]
# Methods default to every registered one that needs no calibration file (kvllm.cli.options.METHODS).
DEFAULT_RETENTIONS = (0.1, 0.2, 0.3, 0.5, 1.0)


@dataclass(frozen=True)
class CellResult:
    """One cell: exact-match accuracy, lookup fidelity, memory held, per-problem records.

    ``fidelity_generated``/``fidelity_prompt`` pool the reads of every problem; the
    per-problem counts in ``problems`` give intervals and paired differences
    (:mod:`kvllm.eval.stats`). ``fidelity_nonmodal`` pools the generated reads whose value
    is not their chain's modal one, ``floor`` is the share of generated reads that are, and
    ``modal_result_share`` the share of results equal to their chain's most common one
    (:mod:`kvllm.eval.lookup`); cells written before these existed have ``None``.
    ``held_mean``/``held_end`` average over problems the KV
    slots held for generated tokens over generated tokens, over decoding and at the end.
    Free cells of the trace-format families also carry the statement grade
    (:mod:`kvllm.eval.statements`): ``statements`` pools statements right over the
    program's statements plus the extra ones, ``stopped`` and ``answered`` are shares of
    problems, ``cap_hits`` counts completions that used their whole token budget.
    """

    method: str
    retention: float
    family: str
    n: int
    correct: int
    accuracy: float
    mean_new_tokens: float
    mean_kept: float  # physical / logical length at the end, prompt included, averaged
    seconds: float
    per_problem: list[bool]
    mode: str = "free"
    window: int = 128
    buffer: int = 32
    fidelity_generated: float | None = None
    fidelity_prompt: float | None = None
    recall: float | None = None
    held_mean: float | None = None
    held_end: float | None = None
    fidelity_nonmodal: float | None = None
    floor: float | None = None
    modal_result_share: float | None = None
    statements: float | None = None
    stopped: float | None = None
    answered: float | None = None
    cap_hits: int | None = None
    problems: list[dict] = field(default_factory=list)
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> tuple[str, float, str, str, int, int]:
        return (self.method, self.retention, self.family, self.mode, self.window, self.buffer)

    def read_counts(self, source: str = "generated") -> tuple[list[int], list[int]]:
        """Per problem, the reads of ``source`` (generated or prompt) graded right, and all of them."""
        return [p["right"][source] for p in self.problems], [p["reads"][source] for p in self.problems]


class StoredCellsMismatch(ValueError):
    """An output folder holds cells that another model or other params computed."""


def cells(
    methods: Sequence[str], retentions: Sequence[float], families: Sequence[str], mode: str = "free"
) -> list[tuple[str, float, str, str]]:
    """The distinct (method, retention, family, mode) cells, Full KV once per family and mode.

    Teacher-forced cells force the free Full-KV cell's completions, so it always runs
    with them; reference-forced cells force the tasks' own and need no free cell.
    """
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is invalid: must be one of {', '.join(MODES)}")
    out: list[tuple[str, float, str, str]] = []
    for family in families:
        if mode != "reference-forced" and (any(r >= 1.0 for r in retentions) or mode == "teacher-forced"):
            out.append((FULL, 1.0, family, "free"))
        if mode != "free" and any(r >= 1.0 for r in retentions):
            out.append((FULL, 1.0, family, mode))
        out += [(m, r, family, mode) for m in methods for r in retentions if r < 1.0]
    return out


def load_results(path: Path) -> dict[tuple, CellResult]:
    if not path.exists():
        return {}
    results = {}
    for line in path.read_text().splitlines():
        if line.strip():
            r = CellResult(**json.loads(line))
            results[r.key] = r
    return results


def run_accuracy_cell(
    model,
    tokenizer,
    problems: Sequence[Problem],
    config: CompressionConfig | None,
    *,
    batch_size: int,
    window: int = 128,
    samples: int = 1,
    temperature: float = 0.0,
    top_p: float = 1.0,
    forced: Sequence[Sequence[int]] | None = None,
    selector: str | None = None,
    keep_ids: bool = False,
    on_problem: Callable[[int], None] | None = None,
) -> list[dict]:
    """One record per problem (and sample): exact match, lookups, memory held.

    With ``forced`` (a token list per problem), teacher-forced: lookups are graded on the
    model's argmax at the forced completion's digits; ``selector`` (one of
    :data:`SELECTORS`) swaps the method for the oracle (forced only), fed with a Full-KV
    pass over each forced sequence, or for the reachable bound, fed with the other
    problems' (free-running, their reference chains'). ``keep_ids``
    stores each completion's token ids in its record (the Full-KV cell's, to force them).
    """
    from kvllm.hf import generate  # transformers is heavy; `kvllm --help` should not wait

    if selector in FORCED_ONLY and forced is None:
        raise ValueError(f"the {selector} runs teacher-forced only")
    if selector == BOUND and forced is None and not all(p.reference for p in problems):
        raise ValueError("the bound runs free only on generated tasks: it scores roles on their reference chains")
    # Only the selectors read the prompts' ids (their Full-KV passes run over prompt + forced).
    prompt_ids = [tokenizer(p.prompt)["input_ids"] for p in problems] if selector is not None else []
    bound_inputs = None
    if selector == BOUND:
        # Free-running, the other problems' reference chains stand in for the forced ones.
        passes = forced or reference_ids(tokenizer, problems)
        bound_inputs = _bound_inputs(model, tokenizer, prompt_ids, passes, window)
    records = []
    for sample in range(samples):
        for lo in range(0, len(problems), batch_size):
            batch = problems[lo : lo + batch_size]
            batch_forced = None if forced is None else [list(f) for f in forced[lo : lo + batch_size]]
            method = None
            if selector == ORACLE:
                from kvllm.eval.oracle import Oracle, full_attention

                ids = [p + f for p, f in zip(prompt_ids[lo : lo + batch_size], batch_forced, strict=True)]
                method = Oracle(full_attention(model, ids))
            elif selector == BOUND:
                from kvllm.eval.bound import FreeRoleBound, RoleBound

                roles, scores = bound_inputs
                if forced is None:
                    lens = [len(p) for p in prompt_ids[lo : lo + batch_size]]
                    method = FreeRoleBound(tokenizer, lens, scores[lo : lo + batch_size])
                else:
                    method = RoleBound(roles[lo : lo + batch_size], scores[lo : lo + batch_size])
            out = generate(
                model,
                tokenizer,
                [p.prompt for p in batch],
                config,
                max(p.max_new_tokens for p in batch),
                temperature=temperature,
                top_p=top_p,
                seed=sample * 1_000_003 + lo,
                forced=batch_forced,
                method=method,
            )
            for i, (p, text, ids, st) in enumerate(zip(batch, out.texts, out.token_ids, out.stats, strict=True)):
                records.append(_record(tokenizer, p, text, ids, st, window, out.predictions, i, keep_ids))
            if on_problem is not None:
                on_problem(len(batch))
    return records


def reference_ids(tokenizer, problems: Sequence[Problem]) -> list[list[int]]:
    """Each problem's reference chain of thought as token ids (what reference-forced cells force)."""
    return [tokenizer(p.reference, add_special_tokens=False)["input_ids"] for p in problems]


def _bound_inputs(model, tokenizer, prompt_ids, forced, gap: int) -> tuple[list, list]:
    """Per problem, its tokens' roles and the roles' scores over the other problems."""
    from kvllm.eval.bound import leave_one_out, role_attention, token_roles
    from kvllm.eval.oracle import full_attention

    roles, stats = [], []
    for p, f in zip(prompt_ids, forced, strict=True):
        r = token_roles(tokenizer, len(p), f)
        (attention,) = full_attention(model, [list(p) + list(f)])
        roles.append(r)
        stats.append(role_attention(attention, r, gap))
    return roles, leave_one_out(stats)


def _record(tokenizer, problem: Problem, text: str, ids, stats, window: int, predictions, row: int, keep_ids: bool):
    from kvllm.eval import lookup

    statements = None
    if predictions is not None:
        decoded, owner = lookup.char_to_token(tokenizer, ids)
        t = lookup.forced_tally(tokenizer, problem.prompt, decoded, owner, predictions[row], window)
        recall = lookup.forced_recall(tokenizer, problem.prompt, problem.family, decoded, owner, predictions[row])
    else:
        recall = _recall(problem, text)
        statements = _statements(problem, text)
        _, owner = lookup.char_to_token(tokenizer, ids)
        prompt_ids = tokenizer(problem.prompt)["input_ids"]
        _, prompt_owner = lookup.char_to_token(tokenizer, prompt_ids)
        t = lookup.tally(problem.prompt, text, window, owner, prompt_owner, len(prompt_ids))
    record = {
        "uid": problem.uid,
        "correct": problem.grade(text),
        "recall": recall,
        "reads": t.reads,
        "right": t.right,
        "bucket_reads": t.bucket_reads,
        "bucket_right": t.bucket_right,
        "malformed": t.malformed_lines,
        "modal_reads": t.modal_reads,
        "modal_right": t.modal_right,
        "results": t.results,
        "modal_results": t.modal_results,
        "new_tokens": len(ids),
        "kept": stats.physical_length / stats.logical_length,
        "held_mean": stats.held_mean,
        "held_end": stats.held_end,
        "cap_hit": len(ids) >= problem.max_new_tokens,
    }
    if predictions is None and statements is not None:
        record["statements"] = statements
    if keep_ids:
        record["ids"] = list(ids)
    record["text"] = text  # stored apart from the cell (run_grid)
    return record


def _summarise(
    method: str,
    retention: float,
    family: str,
    mode: str,
    config: CompressionConfig | None,
    base: CompressionConfig,
    records: list[dict],
    seconds: float,
) -> CellResult:
    from kvllm.eval.stats import ratio_of_sums

    def fidelity(source: str) -> float | None:
        total = [r["reads"][source] for r in records]
        return ratio_of_sums([r["right"][source] for r in records], total) if sum(total) else None

    generated = sum(r["reads"]["generated"] for r in records)
    modal = sum(r["modal_reads"] for r in records)
    results = sum(r["results"] for r in records)
    recalls = [r["recall"] for r in records if r["recall"] is not None]
    graded = [r["statements"] for r in records if r.get("statements") is not None]
    n = len(records)
    return CellResult(
        method=method,
        retention=retention,
        family=family,
        n=n,
        correct=sum(r["correct"] for r in records),
        accuracy=sum(r["correct"] for r in records) / n,
        mean_new_tokens=sum(r["new_tokens"] for r in records) / n,
        mean_kept=sum(r["kept"] for r in records) / n,
        seconds=round(seconds, 2),
        per_problem=[r["correct"] for r in records],
        mode=mode,
        window=base.window,
        buffer=base.buffer,
        fidelity_generated=fidelity("generated"),
        fidelity_prompt=fidelity("prompt"),
        recall=sum(recalls) / len(recalls) if recalls else None,
        held_mean=sum(r["held_mean"] for r in records) / n,
        held_end=sum(r["held_end"] for r in records) / n,
        fidelity_nonmodal=(
            (sum(r["right"]["generated"] - r["modal_right"] for r in records) / (generated - modal))
            if generated > modal
            else None
        ),
        floor=modal / generated if generated else None,
        modal_result_share=sum(r["modal_results"] for r in records) / results if results else None,
        statements=sum(g["right"] for g in graded) / sum(g["total"] for g in graded) if graded else None,
        stopped=sum(g["stopped"] for g in graded) / len(graded) if graded else None,
        answered=sum(g["answered"] for g in graded) / len(graded) if graded else None,
        cap_hits=sum(r.get("cap_hit", False) for r in records),
        problems=records,
        params=_resolved(method, config),
    )


def run_grid(
    model,
    tokenizer,
    problems: dict[str, list[Problem]],
    methods: Sequence[str],
    retentions: Sequence[float],
    base: CompressionConfig,
    out_dir: Path,
    *,
    batch_size: int = 8,
    samples: int = 1,
    temperature: float = 0.0,
    top_p: float = 1.0,
    mode: str = "free",
    params: Mapping[str, dict] | None = None,
    on_progress: Callable[[str, int], None] | None = None,
) -> list[CellResult]:
    """Run every missing cell, append it to ``out_dir/results.jsonl``, and return all cells.

    ``base`` supplies window, buffer, period and the other knobs; each cell overrides
    method and retention, and ``params`` maps a method to its parameter overrides
    (recorded in the cell). The cell key does not hold them: a run with other params
    for a method needs its own ``out_dir``. ``on_progress(cell_name, problems_done)``
    drives a progress bar.
    """
    for m in (m for m in FORCED_ONLY if m in methods and mode not in FORCED_MODES):
        raise ValueError(f"--method {m} is invalid in free cells: it reads the forced sequence")
    if mode == "reference-forced":
        for p in (p for family in problems.values() for p in family if not p.reference):
            raise ValueError(f"problem {p.family}/{p.uid} has no reference completion to force (a math problem?)")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "results.jsonl"
    done = load_results(path)
    _check_folder(out_dir, model, problems, stored=bool(done))
    wanted = cells(methods, retentions, list(problems), mode)
    for m in (m for m in SELECTORS if params and params.get(m)):
        raise ValueError(f"the {m} takes no params")
    for method, retention, family, cell_mode in wanted:
        key = (method, retention, family, cell_mode, base.window, base.buffer)
        config = None
        if method != FULL:
            # The oracle and the bound run under the same policy and rounds; only their selection differs.
            selector = method in SELECTORS
            overrides = {} if selector else (params or {}).get(method, {})
            config = base.replace(method="kara" if selector else method, retention=retention, params=overrides)
        if key in done:
            if done[key].params != _resolved(method, config):
                raise StoredCellsMismatch(
                    f"{out_dir / 'results.jsonl'} holds {method} r={retention} {family} {cell_mode} run with params "
                    f"{done[key].params}, not {_resolved(method, config)}: use another output folder"
                )
            if on_progress is not None:
                on_progress("resumed", len(problems[family]) * samples)
            continue
        forced = None
        if cell_mode == "teacher-forced":
            full = done[(FULL, 1.0, family, "free", base.window, base.buffer)]
            forced = [r["ids"] for r in full.problems]
        elif cell_mode == "reference-forced":
            forced = reference_ids(tokenizer, problems[family])
        name = f"{method} r={retention} {family} {cell_mode}"
        start = time.perf_counter()
        records = run_accuracy_cell(
            model,
            tokenizer,
            problems[family],
            config,
            batch_size=batch_size,
            window=base.window,
            samples=samples,
            temperature=temperature,
            top_p=top_p,
            forced=forced,
            selector=method if method in SELECTORS else None,
            keep_ids=method == FULL and cell_mode == "free",
            on_problem=None if on_progress is None else lambda k, name=name: on_progress(name, k),
        )
        texts = [(r["uid"], r.pop("text")) for r in records]
        if cell_mode == "free":  # every free completion, so that any cell can be inspected
            _store_completions(out_dir, key, texts)
        result = _summarise(method, retention, family, cell_mode, config, base, records, time.perf_counter() - start)
        with path.open("a") as f:
            f.write(json.dumps(asdict(result)) + "\n")
        done[result.key] = result
    # Every stored cell: a folder filled by several runs (other W and b, families,
    # modes) reports all of them.
    results = list(done.values())
    write_tables(results, out_dir)
    return results


def completions_path(out_dir: Path, key: tuple) -> Path:
    """Where a free cell's completions are kept: ``completions/METHOD-rR-FAMILY-WwBb.jsonl.gz``."""
    method, retention, family, _, window, buffer = key
    return out_dir / "completions" / f"{method}-r{retention}-{family}-W{window}b{buffer}.jsonl.gz"


def _store_completions(out_dir: Path, key: tuple, texts: list[tuple[str, str]]) -> None:
    import gzip

    path = completions_path(out_dir, key)
    path.parent.mkdir(exist_ok=True)
    with gzip.open(path, "wt") as f:
        for uid, text in texts:
            f.write(json.dumps({"uid": uid, "text": text}) + "\n")


def model_fingerprint(model) -> str:
    """SHA-256 of a model's weights: names, shapes, dtypes and bytes, in name order."""
    import torch

    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(f"{name} {tuple(tensor.shape)} {tensor.dtype}".encode())
        # As bytes, whatever the dtype (numpy has no bfloat16).
        digest.update(tensor.detach().cpu().contiguous().flatten().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _check_folder(out_dir: Path, model, problems: Mapping[str, Sequence[Problem]], stored: bool) -> None:
    """Refuse to resume ``out_dir`` with another model, or other tasks, than its cells were run with.

    The cell key holds neither, so without this a shipped model retrained in place, or
    a run with another ``--op``, depth or split, would resume the stored cells and report
    them as its own. The first run writes the model's :func:`model_fingerprint` and each
    family's :func:`tasks_fingerprint` to ``model.json``; a later run adds the families it
    brings. A folder of cells from before that file (or its ``tasks``) existed is resumed
    unchecked and left as it is: what ran it is not known here.
    """
    path = out_dir / MODEL_FILE
    fingerprint = model_fingerprint(model)
    tasks = {family: tasks_fingerprint(family_problems) for family, family_problems in problems.items()}
    if not path.exists():
        if not stored:
            record = {"model": _model_name(model), "sha256": fingerprint, "tasks": tasks}
            path.write_text(json.dumps(record, indent=2) + "\n")
        return
    recorded = json.loads(path.read_text())
    if recorded["sha256"] != fingerprint:
        raise StoredCellsMismatch(
            f"{out_dir} holds cells of another model ({recorded.get('model', '?')}, weights sha256 "
            f"{recorded['sha256'][:12]}), not of this one ({fingerprint[:12]}): use another output folder"
        )
    if "tasks" not in recorded:
        return
    for family, digest in tasks.items():
        if recorded["tasks"].get(family, digest) != digest:
            raise StoredCellsMismatch(
                f"{out_dir} holds {family} cells of other tasks (another operator, depth, split or seeds; "
                f"sha256 {recorded['tasks'][family][:12]}, not {digest[:12]}): use another output folder"
            )
    if not tasks.keys() <= recorded["tasks"].keys():  # a family new to the folder
        recorded["tasks"] |= tasks
        path.write_text(json.dumps(recorded, indent=2) + "\n")


def tasks_fingerprint(problems: Sequence[Problem]) -> str:
    """SHA-256 of a family's problems: each one's id, prompt, answer and token budget, in order."""
    digest = hashlib.sha256()
    for p in problems:
        digest.update(json.dumps([p.uid, p.prompt, p.answer, p.max_new_tokens]).encode())
    return digest.hexdigest()


def _model_name(model) -> str:
    """A shipped model's name, else the path it was loaded from (``model.json``'s label)."""
    from kvllm.assets import model_path, shipped

    loaded = Path(str(getattr(model.config, "_name_or_path", "")))
    if loaded.name in shipped() and loaded.resolve() == model_path(loaded.name).resolve():
        return loaded.name
    return str(loaded)


def _resolved(method: str, config: CompressionConfig | None) -> dict[str, Any]:
    """The parameters a method cell runs with, defaults included; none for Full KV, the oracle and the bound."""
    if config is None or method in SELECTORS:
        return {}
    params = asdict(config.method_params)
    if config.lazy > 1:  # lazy retention changes what a cell keeps, as a method parameter would
        params |= {"lazy": config.lazy, "lazy_keep": config.lazy_keep}
    return params


def write_tables(results: Sequence[CellResult], out_dir: Path) -> None:
    """``results.csv`` (one row per cell) and ``results.json`` (without per-problem lists)."""
    fields = [f for f in CellResult.__dataclass_fields__ if f not in ("per_problem", "problems")]
    rows = [{f: getattr(r, f) for f in fields} for r in sorted(results, key=lambda r: r.key)]
    csv_rows = [{**row, "params": json.dumps(row["params"], sort_keys=True)} for row in rows]
    with (out_dir / "results.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(csv_rows)
    (out_dir / "results.json").write_text(json.dumps(rows, indent=1) + "\n")


def _statements(problem: Problem, text: str) -> dict[str, int] | None:
    """The statement grade of a free completion, for a task whose prompt holds a program."""
    from kvllm.eval.statements import grade, program

    if problem.grader != "task":
        return None
    prog = program(problem.prompt)
    if not len(prog):
        return None
    g = grade(prog, text)
    return {"right": g.right, "total": g.statements + g.extra, "stopped": g.stopped, "answered": g.answered}


def _recall(problem: Problem, text: str) -> bool | None:
    """Whether the answer recalls the long-range value the family asks for: gen-needle's
    key (self-recall), reason's first result (answer recall); ``None`` for the others."""
    from kvllm.eval import lookup

    if problem.family == "gen-needle":
        return lookup.self_recall(text)
    if problem.family == "reason":
        return lookup.answer_recall(problem.prompt, text)
    return None
