"""The scheduler's integrity check (tests, debugging): every request, queue, block table and
batch slot recounted from the block tables, an AssertionError naming what is off."""

from __future__ import annotations

from typing import TYPE_CHECKING

from moeserve.sched.request import RequestStatus

if TYPE_CHECKING:
    from moeserve.sched.scheduler import Scheduler


def check_scheduler(sched: Scheduler) -> None:
    """Recount everything from the block tables; raise AssertionError naming what is off."""
    sched.pool.check_integrity()
    running_ids = [r.request_id for r in sched.running]
    waiting_ids = [r.request_id for r in sched.waiting]
    assert len(set(running_ids)) == len(running_ids), f"request twice in running: {running_ids}"
    assert len(set(waiting_ids)) == len(waiting_ids), f"request twice in waiting: {waiting_ids}"
    assert not set(running_ids) & set(waiting_ids), "request both running and waiting"
    assert set(sched.requests) == set(running_ids) | set(waiting_ids), (
        "requests dict != running + waiting")
    assert set(sched.pool.block_tables) == set(running_ids), (
        f"block tables {sorted(sched.pool.block_tables)} != running {sorted(running_ids)}")
    assert len(sched.running) <= sched.max_running_requests, (
        f"{len(sched.running)} running > cap {sched.max_running_requests}")
    size = sched.pool.block_size
    for req in sched.running:
        assert req.status is RequestStatus.RUNNING, f"{req.request_id} running as {req.status}"
        num_slots = len(sched.pool.block_tables[req.request_id]) * size
        assert num_slots >= req.num_computed_tokens, (
            f"{req.request_id}: {num_slots} KV slots < {req.num_computed_tokens} computed")
        assert req.num_computed_tokens <= req.num_tokens + req.num_output_placeholders
    for req in sched.waiting:
        assert req.status is RequestStatus.WAITING, f"{req.request_id} waiting as {req.status}"
        assert req.num_computed_tokens == 0, f"waiting {req.request_id} has computed tokens"
    sched.batch.check(sched.running, list(sched.waiting), sched.pool, sched._running_slots)
