"""Reasoning budgets: a request may write at most N tokens of reasoning before its end token;
at the step where it has written N, that token is forced (its row's mask allows it alone), and
the budget is done once the end token is written (forced or not). The reasoning runs from the
output's first token, or, with a start token, from the token after it (a reply that never
opens its reasoning is never forced). Anthropic's thinking `budget_tokens` (server/anthropic/)
comes here as SamplingParams.reasoning_budget.

    add(request_id, end, n, start)   the budget of a request (start -1: none)
    near(request_id)            it may run out at the step after the one in flight: that step
                                needs the tokens before it (engine/structured_steps.py)
    forced(out, skip)           the plan's sampling rows whose budget is used up
    fill(mask, request_ids)     their mask rows: the end token alone
    accept(outputs)             each output's new tokens counted; a budget whose end token came,
                                or whose request finished, is dropped
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from moeserve.types import RequestOutput, SchedulerOutput


class ReasoningBudgets:
    """The engine's reasoning budgets (module docstring)."""

    def __init__(self) -> None:
        # request id -> [end token id, tokens left, start token id until it came, else -1]
        self._budgets: dict[str, list[int]] = {}

    def __len__(self) -> int:
        return len(self._budgets)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._budgets

    def add(self, request_id: str, end: int, n: int, start: int = -1) -> None:
        self._budgets[request_id] = [end, n, start]

    def drop(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self._budgets.pop(request_id, None)

    def near(self, request_id: str) -> bool:
        budget = self._budgets.get(request_id)
        return budget is not None and budget[1] <= 1 and budget[2] < 0

    def forced(self, out: SchedulerOutput, skip: Iterable[int] = ()) -> list[int]:
        """Rows of the plan that sample with their budget used up (not those in `skip`)."""
        if not self._budgets:
            return []
        skipped = set(skip)
        return [i for i, (rid, sample) in enumerate(zip(out.req_ids, out.sample))
                if sample and i not in skipped and rid in self._budgets
                and self._budgets[rid][1] <= 0 and self._budgets[rid][2] < 0]

    def fill(self, mask: np.ndarray, request_ids: list[str]) -> None:
        """mask [len(request_ids), words] int32: row j allows request j's end token alone."""
        mask.fill(0)
        bits = mask.view(np.uint32)
        for j, rid in enumerate(request_ids):
            end = self._budgets[rid][0]
            bits[j, end >> 5] = np.uint32(1 << (end & 31))

    def accept(self, outputs: list[RequestOutput]) -> None:
        if not self._budgets:
            return
        for out in outputs:
            budget = self._budgets.get(out.request_id)
            if budget is None:
                continue
            ended = False
            for token in out.new_token_ids:
                if budget[2] >= 0:  # waiting for the reasoning to open
                    if token == budget[2]:
                        budget[2] = -1
                    continue
                if token == budget[0]:
                    ended = True
                    break
                budget[1] -= 1
            if out.finished or ended:
                del self._budgets[out.request_id]
