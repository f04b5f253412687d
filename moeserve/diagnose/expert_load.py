"""Expert load: the engine's tokens-per-expert counters, turned into the figures the doctor and
the report use.

The engine counts, per MoE layer, the tokens routed to each expert, and exposes its counters in
the stats of GET /v1/engine as `expert_load` = {"num_steps": S, "tokens_per_expert": [[E ints]
per MoE layer]}. The bench reads them at the start and the end of a run; `run_delta` turns the
two readouts into the run's own load (cumulative counters: end - start; a readout that is not
cumulative, i.e. fewer steps at the end, is taken as is). `summarize` gives:

    mean tokens per expert per step   sum of all counts / (layers x experts x steps): the M of
                                      each expert's GEMM in an average step
    imbalance                         per layer max / mean expert load; mean and worst layer
    hot experts                       the most loaded (layer, expert) pairs, x their layer mean
    per-expert values                 each expert's tokens per step, for the histogram
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


def validate(load: Any, where: str = "expert_load") -> dict[str, Any]:
    """Check the shape of an expert-load document; ValueError names the bad field."""
    if not isinstance(load, dict):
        raise ValueError(f"{where} must be an object, got {type(load).__name__}")
    steps = load.get("num_steps")
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 0:
        raise ValueError(f"{where}.num_steps must be an integer >= 0, got {steps!r}")
    tpe = load.get("tokens_per_expert")
    if not isinstance(tpe, list) or not tpe or not all(isinstance(row, list) for row in tpe):
        raise ValueError(f"{where}.tokens_per_expert must be a non-empty list of lists "
                         "(one per MoE layer)")
    width = len(tpe[0])
    for i, row in enumerate(tpe):
        if len(row) != width or not width:
            raise ValueError(f"{where}.tokens_per_expert[{i}] has {len(row)} experts; layer 0 "
                             f"has {width}")
        if not all(isinstance(x, int | float) and x >= 0 for x in row):
            raise ValueError(f"{where}.tokens_per_expert[{i}] must hold counts >= 0")
    return load


def run_delta(first: dict[str, Any] | None, last: dict[str, Any] | None) -> dict[str, Any] | None:
    """The load over a run from the readouts at its start and end (see the module docstring)."""
    if last is None:
        return None
    validate(last, "expert_load (end of run)")
    if first is None:
        return last
    validate(first, "expert_load (start of run)")
    a, b = first["tokens_per_expert"], last["tokens_per_expert"]
    same_shape = len(a) == len(b) and all(len(x) == len(y) for x, y in zip(a, b))
    cumulative = same_shape and last["num_steps"] >= first["num_steps"] and all(
        y >= x for ra, rb in zip(a, b) for x, y in zip(ra, rb))
    if not cumulative:
        return last
    return {"num_steps": last["num_steps"] - first["num_steps"],
            "tokens_per_expert": [[y - x for x, y in zip(ra, rb)] for ra, rb in zip(a, b)]}


def of_run(run: dict[str, Any]) -> dict[str, Any] | None:
    """The run's expert load: diagnostics.expert_load, else a run-level expert_load."""
    diag = run.get("diagnostics") if isinstance(run.get("diagnostics"), dict) else {}
    for where, load in (("diagnostics.expert_load", diag.get("expert_load")),
                        ("expert_load", run.get("expert_load"))):
        if load is not None:
            return validate(load, where)
    return None


@dataclass(frozen=True, slots=True)
class ExpertLoadSummary:
    num_steps: int
    num_layers: int
    num_experts: int
    total_tokens: float  # routed (token, expert) pairs over all layers
    mean_tokens_per_expert_per_step: float
    mean_imbalance: float  # mean over layers of max / mean expert load
    max_imbalance: float  # the worst layer's
    hot_experts: list[tuple[int, int, float]]  # (layer, expert, load / its layer's mean)
    per_expert_per_step: list[float]  # every (layer, expert)'s tokens per step

    def to_dict(self) -> dict[str, Any]:
        return {"num_steps": self.num_steps, "num_layers": self.num_layers,
                "num_experts": self.num_experts,
                "mean_tokens_per_expert_per_step": round(self.mean_tokens_per_expert_per_step, 3),
                "mean_imbalance": round(self.mean_imbalance, 3),
                "max_imbalance": round(self.max_imbalance, 3),
                "hot_experts": [{"layer": layer, "expert": e, "x_mean": round(r, 2)}
                                for layer, e, r in self.hot_experts]}


def summarize(load: dict[str, Any] | None, num_hot: int = 5) -> ExpertLoadSummary | None:
    """The figures of one load document; None without one or with no steps counted."""
    if load is None:
        return None
    validate(load)
    steps, tpe = load["num_steps"], load["tokens_per_expert"]
    if steps == 0:
        return None
    layers, experts = len(tpe), len(tpe[0])
    total = float(sum(sum(row) for row in tpe))
    ratios, hot = [], []
    for i, row in enumerate(tpe):
        m = sum(row) / experts
        if m > 0:
            ratios.append(max(row) / m)
            hot += [(i, e, x / m) for e, x in enumerate(row)]
    hot.sort(key=lambda h: -h[2])
    return ExpertLoadSummary(
        num_steps=steps, num_layers=layers, num_experts=experts, total_tokens=total,
        mean_tokens_per_expert_per_step=total / (layers * experts * steps),
        mean_imbalance=sum(ratios) / len(ratios) if ratios else 0.0,
        max_imbalance=max(ratios) if ratios else 0.0, hot_experts=hot[:num_hot],
        per_expert_per_step=[x / steps for row in tpe for x in row])
