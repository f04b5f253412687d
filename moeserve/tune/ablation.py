"""What each knob was worth: one-at-a-time ablation from the winner, and Optuna's importances.

    ablate(evaluator, space, winner, start, deadline=None) -> [Ablation]
        the winner measured once more (the reference), then, for every knob where the winner
        differs from the start, the winner with that one knob set back to the start's value;
        its worth is the reference's objective less that run's (largest first)
    importances(study) -> {knob: share}
        Optuna's parameter importances (PED-ANOVA: what reaching the top trials takes; fANOVA
        would need scikit-learn) over the measured feasible trials; {} with
        the reason when the study has too few trials or too little variation

The ablation's runs use the trial workload (the bounded benchmark), as the search did. With a
`deadline`, a run that the longest earlier one says would end past it is not started
(OutOfTime; the finished runs are saved for the next call).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from moeserve.tune.deadline import Deadline, estimate
from moeserve.tune.evaluate import Evaluator, Outcome
from moeserve.tune.space import Space


@dataclass(frozen=True, slots=True)
class Ablation:
    knob: str
    winner_value: Any
    start_value: Any
    objective: float | None  # the winner with this knob at the start's value
    worth: float | None  # reference - objective, tok/s (None: that run failed)
    failure: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def ablate(evaluator: Evaluator, space: Space, winner: Mapping[str, Any],
           start: Mapping[str, Any],
           on_run: Callable[[str, Outcome], None] | None = None,
           done: list[dict[str, Any]] | None = None,
           save: Callable[[list[dict[str, Any]]], None] | None = None,
           deadline: Deadline | None = None) -> tuple[float | None, list[Ablation]]:
    """(the reference objective, the ablations sorted by worth, largest first).

    Resumable as the confirmation is: `done` holds earlier runs' records (name, params,
    value, failure, error; what `save` was given after each run), taken as they are when
    their config is the same."""
    records = list(done or [])

    def measure(name: str, params: dict[str, Any]) -> dict[str, Any]:
        rec = next((r for r in records if r.get("name") == name and r.get("params") == params),
                   None)
        if rec is None:
            if deadline is not None:
                deadline.check(f"the ablation's {name} run", estimate(records))
            res = evaluator.evaluate(params, "trial")
            rec = {"name": name, "params": params, "value": res.value, "failure": res.failure,
                   "error": res.error, "seconds": res.seconds}
            records.append(rec)
            if save is not None:
                save(records)
            if on_run is not None:
                on_run(name, res)
        return rec

    ref = measure("winner", dict(winner))
    reference = ref["value"] if ref["failure"] is None else None
    out = []
    for name in space.knobs:
        if repr(winner.get(name)) == repr(start.get(name)):
            continue
        rec = measure(name, space.complete({**winner, name: start.get(name)}))
        value = rec["value"] if rec["failure"] is None else None
        worth = None if value is None or reference is None else reference - value
        out.append(Ablation(name, winner.get(name), start.get(name), value, worth,
                            None if rec["failure"] is None else
                            f"{rec['failure']}: {rec['error']}"))
    out.sort(key=lambda a: (a.worth is None, -(a.worth or 0.0)))
    return reference, out


def importances(study: Any) -> tuple[dict[str, float], str]:
    """({knob: importance}, "") or ({}, why not)."""
    import optuna

    from moeserve.tune.study import is_feasible, ledger, measured

    trials = [t for t in measured(ledger(study)) if is_feasible(t)]
    if len(trials) < 4:
        return {}, f"{len(trials)} feasible trials: too few for importances"
    try:  # PED-ANOVA ranks what it takes to reach low targets: the objective negated
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            values = optuna.importance.get_param_importances(
                study, evaluator=optuna.importance.PedAnovaImportanceEvaluator(),
                target=lambda t: -(t.value if is_feasible(t) else 0.0))
    except (RuntimeError, ValueError, ZeroDivisionError) as e:
        return {}, f"importances not computed: {e}"
    return {k: round(float(v), 4) for k, v in values.items()}, ""
