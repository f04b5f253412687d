"""The scheduler: Python and numpy (no torch, no triton): ints, lists and arrays.

`Scheduler` decides each step which requests run and how many tokens each computes; `BlockPool`
owns the paged KV blocks, the per-request block tables and the prefix cache; `Request` is one
request's scheduling state.
"""

from __future__ import annotations

from moeserve.sched.block_pool import NULL_BLOCK, BlockPool
from moeserve.sched.request import Request, RequestStatus
from moeserve.sched.scheduler import Scheduler
from moeserve.sched.stats import SchedulerStats

__all__ = ["NULL_BLOCK", "BlockPool", "Request", "RequestStatus", "Scheduler", "SchedulerStats"]
