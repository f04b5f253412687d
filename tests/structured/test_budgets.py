"""Reasoning budgets (structured/budgets.py): counted from the first output token or from the
start token; forced rows once used up; dropped at the end token or when the request finishes;
the forced row's mask allows the end token alone (a high bit too)."""

from __future__ import annotations

import numpy as np

from moeserve.structured.budgets import ReasoningBudgets
from moeserve.types import RequestOutput, SamplingParams, SchedulerOutput


def _plan(req_ids: list[str]) -> SchedulerOutput:
    n = len(req_ids)
    return SchedulerOutput(req_ids=req_ids, num_scheduled_tokens=[1] * n,
                           num_computed_tokens=[0] * n, token_ids=[0] * n,
                           block_tables=[[]] * n, sample=[True] * n,
                           sampling_params=[SamplingParams()] * n, sample_seeds=[0] * n,
                           num_output_tokens=[0] * n)


def _out(rid: str, tokens: list[int], finished: bool = False) -> RequestOutput:
    return RequestOutput(request_id=rid, prompt_token_ids=[1], new_token_ids=tokens,
                         finished=finished)


def test_a_budget_counts_forces_and_ends() -> None:
    b = ReasoningBudgets()
    b.add("a", 9, 3)  # inside from the first token
    b.add("b", 9, 2, start=7)  # opened by token 7
    b.add("c", 9, 5)
    plan = _plan(["a", "b", "c"])
    b.accept([_out("a", [1, 2]), _out("b", [1, 2, 3]), _out("c", [1, 9])])
    assert "c" not in b  # its end token came before the budget: nothing to force
    assert b.near("a") and not b.near("b") and b.forced(plan) == []
    b.accept([_out("a", [3]), _out("b", [7, 4])])
    assert b.forced(plan) == [0] and b.forced(plan, skip=[0]) == []
    assert b.near("b") and b.forced(plan) == [0]
    b.accept([_out("b", [5])])
    assert b.forced(plan) == [0, 1]
    mask = np.full((2, 3), -1, dtype=np.int32)
    b.accept([_out("b", [], finished=False)])
    b.fill(mask, ["a", "b"])
    bits = np.unpackbits(mask.view(np.uint8), axis=1, bitorder="little")
    assert [np.flatnonzero(row).tolist() for row in bits] == [[9], [9]]
    b.accept([_out("a", [9]), _out("b", [4], finished=True)])
    assert len(b) == 0


def test_a_budget_of_zero_forces_the_end_at_once() -> None:
    b = ReasoningBudgets()
    b.add("now", 9, 0)  # the template opened the reasoning: its first token is the end
    b.add("later", 9, 0, start=7)  # forced right after the model opens it
    plan = _plan(["now", "later"])
    assert b.forced(plan) == [0] and b.near("now") and not b.near("later")
    b.accept([_out("later", [7])])
    assert b.forced(plan) == [0, 1]


def test_the_end_token_may_be_any_bit_of_its_word() -> None:
    b = ReasoningBudgets()
    b.add("r", 63, 1)
    b.accept([_out("r", [1])])
    mask = np.zeros((1, 2), dtype=np.int32)
    b.fill(mask, ["r"])
    assert mask[0, 0] == 0 and mask.view(np.uint32)[0, 1] == 1 << 31
    b.drop(["r", "unknown"])
    assert "r" not in b
