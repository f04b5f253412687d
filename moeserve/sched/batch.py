"""The running set's counters as numpy arrays, so a step's bookkeeping is array ops, not a Python
loop over every running request.

Each RUNNING request holds a slot (`Request.slot`, -1 when not running) in `RunningBatch`'s
arrays from admission to preemption or finish. The arrays mirror the request objects, which stay
the truth that the rest of the engine and the tests read; the scheduler writes both and
`check_integrity` asserts they agree:

    array               value for a running request r (slot s = r.slot)
    num_prompt[s]       len(r.prompt_token_ids)                          set at admission
    limit[s]            min(num_prompt + max_tokens, max_model_len)      set at admission
    single_step[s]      logprobs, structured output, reasoning budget  set at admission
    num_outputs[s]      len(r.output_token_ids)                          update()
    num_placeholders[s] r.num_output_placeholders                        schedule(), update()
    num_computed[s]     r.num_computed_tokens                            schedule()
    num_blocks[s]       len(its block table)                             schedule()
    num_cached[s]       its leading blocks in the prefix cache           update()
    generation[s]       bumped each time the slot is released

`generation` lets update() tell, for all rows at once, whether a row's request still holds the
slot it was scheduled in (not finished, not preempted since): `ScheduledStep` carries the rows'
slots and their generations at schedule time. `stop_counts` counts, over the running requests,
each token id that stops one of them (EOS unless ignore_eos, stop ids): a sampled token outside
it stops nobody.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from moeserve.sched.block_pool import BlockPool
from moeserve.sched.request import Request, RequestStatus
from moeserve.types import ModelOutput, SamplingParams, SchedulerOutput

# update()'s row codes (RunningBatch.classify)
ONE_BY_ONE = 0  # Scheduler._update_row: stops, errors, prefill chunks, rows no longer running
APPEND = 1  # it sampled, still holds its slot, and none of its tokens stops it: append them
APPEND_AND_CACHE = 2  # the same, and a block of it became full: enter it into the prefix cache


@dataclass(slots=True)
class ScheduledStep(SchedulerOutput):
    """A SchedulerOutput that also carries the scheduler's own handles on its rows (the runner
    ignores them): each row's request, slot and that slot's generation at schedule time.

    NOTE: these fields are the scheduler's, not plan data: whatever sends a plan to other ranks
    sends the SchedulerOutput fields alone.
    """

    row_requests: list[Request] = field(default_factory=list)
    row_slots: np.ndarray = field(default_factory=lambda: np.zeros(0, np.intp))  # [num_reqs]
    row_generations: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))


@dataclass(slots=True)
class BulkRows:
    """The running requests that step 1 of schedule() runs, as [S] arrays, in running order."""

    index: np.ndarray  # position in the running list
    slots: np.ndarray
    start: np.ndarray  # num_computed_tokens
    known: np.ndarray  # known tokens: prompt + outputs
    total: np.ndarray  # known + in-flight tokens
    num_new: np.ndarray  # tokens to compute this step
    missing: np.ndarray  # blocks its table lacks for them (<= 0: none)


def _zeros(n: int) -> np.ndarray:
    return np.zeros(n, np.int64)


def single_step(params: SamplingParams) -> bool:
    """A request whose decode steps run one token at a time: logprobs (kept per step), a
    structured output (each token's mask needs the one before it on the host) or a reasoning
    budget (its end token forced at the step the budget runs out)."""
    return (params.logprobs is not None or params.structured is not None
            or params.reasoning_budget is not None)


def stop_ids(req: Request) -> set[int]:
    """The token ids that end the request when sampled."""
    params = req.sampling_params
    ids = set(params.stop_token_ids)
    if not params.ignore_eos:
        ids.update(req.eos_token_ids)
    return ids


class RunningBatch:
    """Slots and per-slot arrays for up to `num_slots` running requests (see the module
    docstring)."""

    def __init__(self, num_slots: int, max_model_len: int) -> None:
        self.max_model_len = max_model_len
        self.num_prompt, self.limit = _zeros(num_slots), _zeros(num_slots)
        self.num_outputs, self.num_placeholders = _zeros(num_slots), _zeros(num_slots)
        self.num_computed, self.num_blocks = _zeros(num_slots), _zeros(num_slots)
        self.num_cached, self.generation = _zeros(num_slots), _zeros(num_slots)
        self.single_step = np.zeros(num_slots, bool)  # never multi-step decode
        self.stop_counts: dict[int, int] = {}
        self._free_slots = list(range(num_slots - 1, -1, -1))  # popped from the end: 0 first

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    def admit(self, req: Request, pool: BlockPool) -> None:
        """Give a request that is becoming RUNNING a slot and fill it from the request."""
        assert req.slot < 0, f"{req.request_id} already holds slot {req.slot}"
        s = req.slot = self._free_slots.pop()
        params = req.sampling_params
        self.num_prompt[s] = len(req.prompt_token_ids)
        self.limit[s] = min(len(req.prompt_token_ids) + params.max_tokens, self.max_model_len)
        self.single_step[s] = single_step(params)
        for token in stop_ids(req):
            self.stop_counts[token] = self.stop_counts.get(token, 0) + 1
        self.store(req, pool)

    def release(self, req: Request) -> None:
        """Take the slot back from a request that stops running (preempted or finished)."""
        s = req.slot
        if s < 0:
            return
        for token in stop_ids(req):
            if self.stop_counts[token] == 1:
                del self.stop_counts[token]
            else:
                self.stop_counts[token] -= 1
        self.generation[s] += 1
        self._free_slots.append(s)
        req.slot = -1

    def store(self, req: Request, pool: BlockPool) -> None:
        """Write a running request's counters into its slot (after a change made one by one)."""
        s = req.slot
        self.num_outputs[s] = len(req.output_token_ids)
        self.num_placeholders[s] = req.num_output_placeholders
        self.num_computed[s] = req.num_computed_tokens
        self.num_blocks[s] = len(pool.block_tables.get(req.request_id, ()))
        self.num_cached[s] = pool.num_cached_blocks(req.request_id)

    def plan_running(self, slots: np.ndarray, budget: int, block_size: int) -> BulkRows | None:
        """Step 1 of schedule() as array ops: the tokens each running request (`slots`, in
        running order) computes within the budget, and the blocks each lacks; None when none
        runs. Matches `Scheduler._num_new_tokens` request by request."""
        computed = self.num_computed[slots]
        known = self.num_prompt[slots] + self.num_outputs[slots]
        total = known + self.num_placeholders[slots]
        # A request whose in-flight token is its last gets nothing: update() will finish it.
        # Only a prefill in progress can need more than one token (chunked prefill on).
        need = np.where(total < self.limit[slots], total - computed, 0)
        # the budget in row order: the row that exhausts it gets a chunk, the rows after nothing
        num_new = np.minimum(need, np.maximum(budget - (np.cumsum(need) - need), 0))
        index = np.flatnonzero(num_new)
        if not len(index):
            return None
        slots, computed, known, total, num_new = (
            a[index] for a in (slots, computed, known, total, num_new))
        missing = -(-(computed + num_new) // block_size) - self.num_blocks[slots]
        return BulkRows(index, slots, computed, known, total, num_new, missing)

    def add_rows(self, out: ScheduledStep, reqs: list[Request], rows: BulkRows,
                 block_tables: dict[str, list[int]]) -> int:
        """Append the rows that `plan_running` chose to the plan, in one go, and advance their
        counters as `Scheduler._add_row` does, arrays first, then the requests. Returns the
        number of rows that are prefill chunks (they sample nothing)."""
        slots = rows.slots
        end = rows.start + rows.num_new
        sample = end == rows.total
        req_ids = [r.request_id for r in reqs]
        out.req_ids += req_ids
        out.num_scheduled_tokens += rows.num_new.tolist()
        out.num_computed_tokens += rows.start.tolist()
        out.token_ids += input_token_ids(reqs, rows)
        out.block_tables += [block_tables[i] for i in req_ids]
        out.sample += sample.tolist()
        out.sampling_params += [r.sampling_params for r in reqs]
        out.sample_seeds += [r.seed for r in reqs]
        out.num_output_tokens += (rows.total - self.num_prompt[slots]).tolist()
        out.row_requests += reqs
        placeholders = self.num_placeholders[slots] + sample
        self.num_computed[slots] = end
        self.num_placeholders[slots] = placeholders
        for req, computed, num_placeholders in zip(reqs, end.tolist(), placeholders.tolist()):
            req.num_computed_tokens = computed
            req.num_output_placeholders = num_placeholders
        return len(reqs) - int(np.count_nonzero(sample))

    def decode_steps(self, slots: np.ndarray, max_steps: int,
                     block_size: int) -> tuple[int, np.ndarray]:
        """num_continuous_decode_steps: the tokens every row of a decode-only step can take (at
        most max_steps) and the blocks each row then lacks ([S], >= 0)."""
        # outputs after this step's first token: len(outputs) + placeholders
        total = self.num_prompt[slots] + self.num_outputs[slots] + self.num_placeholders[slots]
        steps = min(max_steps, int((self.limit[slots] - total).min()) + 1)
        missing = -(-(self.num_computed[slots] + steps - 1) // block_size) - self.num_blocks[slots]
        return steps, np.maximum(missing, 0)

    def advance_decodes(self, reqs: list[Request], slots: np.ndarray, num_tokens: int) -> None:
        """Decode rows `slots` (of `reqs`) compute and sample `num_tokens` more tokens."""
        self.num_computed[slots] = computed = self.num_computed[slots] + num_tokens
        self.num_placeholders[slots] = placeholders = self.num_placeholders[slots] + num_tokens
        for req, c, p in zip(reqs, computed.tolist(), placeholders.tolist()):
            req.num_computed_tokens = c
            req.num_output_placeholders = p

    def classify(self, step: ScheduledStep, model_out: ModelOutput,
                 cache_block_size: int) -> tuple[list[int], list[list[int]]]:
        """Sort a step's rows for update() (ONE_BY_ONE, APPEND, APPEND_AND_CACHE; the
        prefix cache's block size, or 0 when it is off) and advance the APPEND rows' counters.
        Returns the codes and each row's new tokens."""
        num_reqs = step.num_reqs
        one_by_one = ([ONE_BY_ONE] * num_reqs, [[] for _ in range(num_reqs)])
        tokens = np.asarray(model_out.sampled_token_ids, np.int64).reshape(num_reqs, 1)
        if model_out.extra_token_ids:  # [num_reqs, num_steps - 1]
            extra = model_out.extra_token_ids
            if len(extra) != num_reqs or len({len(e) for e in extra}) != 1:
                return one_by_one
            tokens = np.concatenate([tokens, np.asarray(extra, np.int64)], axis=1)
        slots, num_tokens = step.row_slots, tokens.shape[1]
        append = (self.generation[slots] == step.row_generations) & np.asarray(step.sample, bool)
        if model_out.row_errors:
            append[list(model_out.row_errors)] = False
        if self.stop_counts:
            stops = np.fromiter(self.stop_counts, np.int64, len(self.stop_counts))
            append &= ~np.isin(tokens, stops).any(axis=1)
        known = self.num_prompt[slots] + self.num_outputs[slots] + num_tokens  # after them
        append &= known < self.limit[slots]
        codes = append.astype(np.int8)  # APPEND or ONE_BY_ONE
        if cache_block_size:
            full = np.minimum(self.num_computed[slots], known) // cache_block_size
            codes[append & (full > self.num_cached[slots])] = APPEND_AND_CACHE
        appended = slots[append]
        self.num_outputs[appended] += num_tokens
        self.num_placeholders[appended] -= num_tokens
        return codes.tolist(), tokens.tolist()

    def check(self, running: list[Request], waiting: list[Request], pool: BlockPool,
              running_slots: np.ndarray | None = None) -> None:
        """Assert the slots and arrays agree with the request objects, and `running_slots` (the
        scheduler's cache of the running slots, when set) with them; raise AssertionError."""
        slots = [r.slot for r in running]
        assert running_slots is None or running_slots.tolist() == slots, (
            f"the cached running slots {running_slots} are stale: {slots}")
        assert all(s >= 0 for s in slots), "a running request holds no slot"
        assert len(set(slots)) == len(slots), f"a slot held twice: {slots}"
        assert not set(slots) & set(self._free_slots), "a held slot is also free"
        assert len(slots) + len(self._free_slots) == len(self.num_prompt), "a slot is lost"
        assert all(r.slot == -1 for r in waiting), "a waiting request holds a slot"
        stops: dict[int, int] = {}
        for r in running:
            s = r.slot
            expect = (len(r.prompt_token_ids),
                      min(len(r.prompt_token_ids) + r.sampling_params.max_tokens,
                          self.max_model_len),
                      single_step(r.sampling_params), len(r.output_token_ids),
                      r.num_output_placeholders, r.num_computed_tokens,
                      len(pool.block_tables[r.request_id]), pool.num_cached_blocks(r.request_id))
            got = (self.num_prompt[s], self.limit[s], self.single_step[s], self.num_outputs[s],
                   self.num_placeholders[s], self.num_computed[s], self.num_blocks[s],
                   self.num_cached[s])
            assert tuple(int(v) for v in got) == tuple(int(v) for v in expect), (
                f"{r.request_id} (slot {s}): arrays (prompt, limit, single step, outputs, "
                f"placeholders, computed, blocks, cached) {got} != request {expect}")
            assert r.status is RequestStatus.RUNNING
            for token in stop_ids(r):
                stops[token] = stops.get(token, 0) + 1
        assert stops == self.stop_counts, f"stop counts {self.stop_counts} != running's {stops}"


def input_token_ids(reqs: list[Request], rows: BulkRows) -> list[int]:
    """The rows' input token ids, flat: positions [start, start + num_new), -1 in flight."""
    start, known, num_new = rows.start, rows.known, rows.num_new
    if (start >= known).all():  # decodes whose input is in flight (overlap)
        return [-1] * int(num_new.sum())
    if num_new.max() == 1:  # decodes: the input is in flight, or the last known token
        last = start == known - 1
        if (last | (start >= known)).all():
            return [(r.output_token_ids or r.prompt_token_ids)[-1] if is_last else -1
                    for r, is_last in zip(reqs, last.tolist())]
    token_ids: list[int] = []
    for req, s, n in zip(reqs, start.tolist(), num_new.tolist()):
        token_ids += req.get_token_ids(s, s + n)
    return token_ids
