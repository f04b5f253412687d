"""The plan crosses the control group with each request's sampling parameters once: a worker
rebuilds every plan exactly, and forgets a request's parameters when it finishes."""

from __future__ import annotations

from moeserve.parallel.plan_codec import PlanDecoder, PlanEncoder
from moeserve.types import SamplingParams, SchedulerOutput


def _plan(ids: list[str], params: dict[str, SamplingParams],
          finished: list[str] = ()) -> SchedulerOutput:
    return SchedulerOutput(req_ids=ids, num_scheduled_tokens=[1] * len(ids),
                           num_computed_tokens=[3] * len(ids), token_ids=[7] * len(ids),
                           block_tables=[[1, 2]] * len(ids), sample=[True] * len(ids),
                           sampling_params=[params[i] for i in ids],
                           sample_seeds=list(range(len(ids))), num_output_tokens=[0] * len(ids),
                           finished_req_ids=list(finished))


def test_a_worker_rebuilds_every_plan_and_forgets_finished_requests() -> None:
    params = {r: SamplingParams(temperature=t, max_tokens=5, seed=i)
              for i, (r, t) in enumerate([("a", 0.0), ("b", 0.7), ("c", 1.0)])}
    enc, dec = PlanEncoder(), PlanDecoder()
    steps = [_plan(["a", "b"], params), _plan(["a", "b", "c"], params),
             _plan(["b", "c"], params, finished=["a"]), _plan(["c"], params, finished=["b"])]
    sent = []
    for plan in steps:
        wire, new = enc.encode(plan)
        assert wire.sampling_params == []
        sent.append(sorted(new))
        assert dec.decode(wire, new) == plan
    assert sent == [["a", "b"], ["c"], [], []]  # each request's parameters once
    assert set(dec.params) == {"c"} and enc.sent == {"c"}
