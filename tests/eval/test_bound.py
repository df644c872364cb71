"""The reachable bound: token roles from the grammar, role scores from other problems."""

from __future__ import annotations

import torch
from transformers import AutoTokenizer

from kvllm.assets import model_path
from kvllm.eval.bound import (
    KINDS,
    PLACES,
    PROMPT_ROLE,
    FreeRoleBound,
    RoleBound,
    leave_one_out,
    role_attention,
    token_roles,
)
from kvllm.eval.tasks import HEDGES
from kvllm.methods import Window

STATEMENTS = [" wa = ta + su = ta14 + su24 = wa38", " we = to + tu = to21 + tu43 = we64"]
STATEMENT, HEDGE, OTHER = 0, next(k for k, (name, _) in enumerate(KINDS) if name == "hedge"), len(KINDS)


def test_every_statement_gets_the_same_roles_counted_from_its_end() -> None:
    # The shipped model's tokenizer: every name and digit one token, as the tasks need.
    tokenizer = AutoTokenizer.from_pretrained(model_path())
    prompt = tokenizer("trace: evaluate and report we.\n ta14\n")["input_ids"]
    completion = tokenizer("\n".join([*STATEMENTS, f" {HEDGES[0]}", " nonsense", ""]))["input_ids"]
    roles = token_roles(tokenizer, len(prompt), completion)
    assert roles.shape == (len(prompt) + len(completion),)
    assert (roles[: len(prompt)] == PROMPT_ROLE).all()
    gen = roles[len(prompt) :].tolist()
    first = len(tokenizer(STATEMENTS[0] + "\n")["input_ids"])
    second = len(tokenizer(STATEMENTS[1] + "\n")["input_ids"])
    assert first == second  # the same grammar, the same token count (digits are tokens)
    # The two statements: the same roles place by place, the newline last (place 0).
    assert gen[:first] == gen[first : 2 * first]
    assert gen[first - 1] == STATEMENT * PLACES
    assert gen[:first] == [STATEMENT * PLACES + p for p in reversed(range(first))]
    kinds = [r // PLACES for r in gen[2 * first :]]
    assert HEDGE in kinds and OTHER in kinds and STATEMENT not in kinds


def test_role_attention_counts_only_queries_at_least_the_gap_later() -> None:
    t, gap = 6, 2
    attention = torch.zeros(1, 1, t, t)
    attention[0, 0, 1, 0] = 9.0  # one token later: too close
    attention[0, 0, 2, 0] = 1.0  # two later: counted
    attention[0, 0, 5, 0] = 2.0
    attention[0, 0, 5, 3] = 4.0
    roles = torch.tensor([0, 1, 1, 0, 1, 2])
    total, count = role_attention(attention, roles, gap)
    assert total[0, 0, :3].tolist() == [3.0 + 4.0, 0.0, 0.0]
    assert count[:3].tolist() == [2.0, 3.0, 1.0]


def test_leave_one_out_is_the_mean_of_the_others() -> None:
    stats = [
        (torch.tensor([[[2.0, 0.0]]]), torch.tensor([1.0, 0.0])),
        (torch.tensor([[[6.0, 3.0]]]), torch.tensor([2.0, 1.0])),
    ]
    first, second = leave_one_out(stats)
    assert first.tolist() == [[[3.0, 3.0]]]  # the second problem's 6/2 and 3/1
    assert second.tolist() == [[[2.0, 0.0]]]  # the first's 2/1; a role it never had scores 0


def _window(span: int, n_compress: int, start: int) -> Window:
    """One row's window of random queries and keys (2 KV heads): the bound reads neither."""
    g = torch.Generator().manual_seed(0)
    return Window(
        queries=torch.randn(1, 1, 2, span, 4, generator=g),
        keys=torch.randn(1, 1, 2, span, 4, generator=g),
        n_compress=n_compress,
        positions=(start,),
    )


def test_the_bound_keeps_the_keys_of_the_best_roles_per_head() -> None:
    span, c, start = 12, 8, 3
    roles = torch.tensor([PROMPT_ROLE] * start + [0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2] + [0, 0])
    # Head 0 favours role 2, head 1 role 0.
    scores = torch.zeros(1, 2, ROLE_COUNT := PROMPT_ROLE + 1)
    scores[0, 0, 2], scores[0, 1, 0] = 1.0, 1.0
    assert ROLE_COUNT > 3
    kept = RoleBound([roles], [scores]).select(_window(span, c, start), 2).indices
    assert kept[0, 0, 0].tolist() == [2, 5]
    assert kept[0, 0, 1].tolist() == [3, 6]  # of three tied keys, the later two


def test_free_running_the_bound_reads_roles_off_the_tokens_generated_so_far() -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_path())
    prompt = tokenizer("trace: evaluate and report we.\n ta14\n")["input_ids"]
    completion = tokenizer("\n".join([*STATEMENTS, *STATEMENTS, ""]))["input_ids"]
    line = len(tokenizer(STATEMENTS[0] + "\n")["input_ids"])
    scores = torch.rand(1, 2, PROMPT_ROLE + 1, generator=torch.Generator().manual_seed(1))
    free = FreeRoleBound(tokenizer, [len(prompt)], [scores])
    for token in completion:  # as the decoding loop reports them, one step at a time
        free.observe(torch.tensor([token]))
    assert free.completions == [completion]
    # A window over the first two statements, the next two (whole lines) still to come.
    span, start = 2 * line, len(prompt)
    window = _window(span, span, start)
    forced = RoleBound([token_roles(tokenizer, len(prompt), completion)], [scores])
    assert torch.equal(free.select(window, 5).indices, forced.select(window, 5).indices)
    # Each statement line's roles are the same, so a head keeps the same places in both.
    kept = free.select(window, 4).indices[0, 0, 0].tolist()
    assert [k % line for k in kept[:2]] == [k % line for k in kept[2:]]
