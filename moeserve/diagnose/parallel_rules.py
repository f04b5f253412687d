"""The doctor's figures and rule for an engine over several ranks (tensor / expert parallel).

    communication    the collectives took >= COMM_SHARE of the latest eagerly run sampled
                     step's device time (engine stats comm_seconds / eager_step_seconds, mean
                     over the run), in a run with tensor_parallel_size > 1; critical from
                     COMM_CRITICAL
                     settings: tensor_parallel_size W / 2 (fewer ranks: half the all-reduce
                     hops, each rank holding twice the weights), when W > 1
    ep_rank_load     (a figure) tokens routed to each EP rank's experts, from the expert-load
                     counters and the layout: the share of the busiest rank against the mean;
                     each rank reads only its experts, so the busiest sets the MoE's time

Every rank computes every token's attention and sums every layer's output in an all-reduce
(docs/parallel.md), so the communication per step is 2 x layers all-reduces of
tokens x hidden values: a larger batch amortises their latency, fewer ranks cut their hops,
and expert parallelism changes which weights a rank reads, not the all-reduce.
"""

from __future__ import annotations

from typing import Any

from moeserve.diagnose import expert_load, figures
from moeserve.diagnose.verdict import Verdict
from moeserve.diagnose.verdict import rounded as _r

COMM_SHARE = 0.30
COMM_CRITICAL = 0.50


def parallel_config(run: dict[str, Any]) -> dict[str, Any]:
    section = figures.engine_config(run).get("parallel")
    return section if isinstance(section, dict) else {}


def world_size(run: dict[str, Any]) -> int:
    size = parallel_config(run).get("tensor_parallel_size", 1)
    return size if isinstance(size, int) and size > 0 else 1


def ep_size(run: dict[str, Any]) -> int:
    pc = parallel_config(run)
    if isinstance(pc.get("expert_parallel_size"), int):
        return pc["expert_parallel_size"]
    return world_size(run) if pc.get("enable_expert_parallel") else 1


def ep_rank_load(run: dict[str, Any]) -> list[float] | None:
    """Each EP rank's share of the routed tokens (sums to 1), or None (EP off, no counters)."""
    ep = ep_size(run)
    load = expert_load.of_run(run)
    if ep < 2 or load is None:
        return None
    rows = load["tokens_per_expert"]
    experts = len(rows[0])
    if experts % ep:
        return None
    per = experts // ep
    totals = [sum(sum(row[r * per:(r + 1) * per]) for row in rows) for r in range(ep)]
    whole = sum(totals)
    return [t / whole for t in totals] if whole else None


def comm_times(run: dict[str, Any]) -> tuple[float, float] | None:
    """(collectives' seconds, eager step's seconds), the means over a diagnosed run's engine
    samples of the latest eagerly run sampled step (graph replays carry no breakdown); None
    without them."""
    comm = figures.mean(figures.engine_series(run, "comm_seconds")[1])
    step = figures.mean(figures.engine_series(run, "eager_step_seconds")[1])
    return (comm, step) if comm and step else None


def communication(run: dict[str, Any]) -> Verdict | None:
    w = world_size(run)
    times = comm_times(run) if w >= 2 else None
    if times is None:
        return None
    comm, step = times
    share = comm / step
    if share < COMM_SHARE:
        return None
    ev = {"tensor_parallel_size": w, "expert_parallel_size": ep_size(run),
          "comm_ms": _r(comm * 1e3, 3), "eager_step_ms": _r(step * 1e3, 3),
          "comm_share": _r(share, 3)}
    shares = ep_rank_load(run)
    if shares is not None:
        ev["ep_rank_token_shares"] = [_r(s, 3) for s in shares]
    return Verdict("communication", "critical" if share >= COMM_CRITICAL else "warning",
                   f"communication-bound step: the collectives take {share:.0%} of the sampled "
                   f"step's device time ({comm * 1e3:.2f} of {step * 1e3:.2f} ms) at {w} ranks",
                   f"fewer ranks (--tp {w // 2}) where the weights fit, or more rows per step "
                   "(concurrency, --max-running-requests) so each all-reduce carries more "
                   "tokens; --enable-expert-parallel changes which weights a rank reads, not "
                   "the all-reduce", ev, {"tensor_parallel_size": w // 2})
