"""The search: an Optuna study whose storage is the ledger of every trial.

    open_study(storage, name, seed)     create or load (resume) the study; SQLite by default,
                                        any RDB URL, or "journal:PATH" (Optuna's journal file)
    search(study, space, evaluator, budget, on_event)
        start    the start config is the first trial (source "start")
        doctor   after each trial, the best trial's verdicts propose the next trials
                 (steer.py), enqueued and marked source "doctor" with the rule; a round
                 whose moves each gained is followed by those moves together
        sampler  otherwise TPE (multivariate, grouped for the conditional knobs, constant liar
                 for several workers, the infeasible trials as constraint violations)
        until the budget: trials in the study (every worker's) and/or this call's wall time
    best_trial(study)                   the feasible trial with the highest objective

A trial's user attributes are its ledger row: source, rule (doctor), params (the complete
config), figures per concurrency, verdicts, capacity report, failure and error, seconds, the
server command, the worker. An infeasible trial (evaluate.py's failure kinds) is told to Optuna
with objective 0 and a positive constraint, so the sampler learns the region; a trial the
sampler repeats is not measured again: it is told its earlier value (attribute duplicate_of).

Resume: trials left RUNNING by a worker of this host that is gone (killed, Ctrl-C before the
ledger write) are marked failed ("interrupted") and their configs enqueued again; the budget
counts what the study already holds, so a resumed study goes on where it stopped.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from moeserve.tune.evaluate import Evaluator, Outcome
from moeserve.tune.space import Space
from moeserve.tune.steer import combination, config_key, proposals

DIRECTION = "maximize"
MAX_DUPLICATES_IN_A_ROW = 25  # the sampler keeps repeating: the space is exhausted


@dataclass(frozen=True, slots=True)
class Budget:
    n_trials: int | None = None  # measured trials in the study, all workers together
    wall_time_s: float | None = None  # this call
    doctor: bool = True
    recover_every_running: bool = False  # see recover_interrupted


def _optuna() -> Any:
    try:
        import optuna
    except ImportError:
        raise ValueError("moeserve tune needs optuna (pip install optuna)") from None
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna


def make_storage(url: str) -> Any:
    """"sqlite:///tune.db" and other RDB URLs, or "journal:PATH" for Optuna's journal file
    (several processes on one file, no database)."""
    optuna = _optuna()
    if url.startswith("journal:"):
        from optuna.storages import JournalStorage
        from optuna.storages.journal import JournalFileBackend

        return JournalStorage(JournalFileBackend(url.removeprefix("journal:")))
    if "://" not in url:
        raise ValueError(f"--storage {url!r}: expected an RDB URL (sqlite:///tune.db) or "
                         "journal:PATH")
    if not url.startswith("sqlite"):
        return optuna.storages.RDBStorage(url)
    storage = optuna.storages.RDBStorage(url, engine_kwargs={"connect_args": {"timeout": 60}})
    _serialize_sqlite(storage.engine)
    return storage


def _serialize_sqlite(engine: Any) -> None:
    """Every SQLite transaction takes the write lock when it begins (BEGIN IMMEDIATE).

    NOTE: SQLite ignores SELECT ... FOR UPDATE, and a deferred transaction reads before it
    locks: two workers could both read a queued trial as waiting and both take it. Serialized
    transactions make Optuna's pop of a queued trial atomic across processes (SQLAlchemy's
    recipe for pysqlite: its own BEGIN off, ours on each begin)."""
    from sqlalchemy import event

    @event.listens_for(engine, "connect")
    def _no_driver_begin(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None

    @event.listens_for(engine, "begin")
    def _begin_immediate(conn: Any) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE")

    engine.dispose()  # connections made before the listeners: none kept


def make_sampler(seed: int | None, n_startup_trials: int) -> Any:
    """TPE, multivariate and grouped (the conditional knobs), with the constant liar for
    several workers; it reads each trial's constraint (Trial.set_constraint)."""
    import warnings

    optuna = _optuna()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return optuna.samplers.TPESampler(seed=seed, multivariate=True, group=True,
                                          n_startup_trials=n_startup_trials, constant_liar=True)


def open_study(storage: str, name: str, seed: int | None = 0,
               n_startup_trials: int = 8) -> Any:
    """Create the study, or load it when the storage already has one of that name."""
    optuna = _optuna()
    study = optuna.create_study(storage=make_storage(storage), study_name=name,
                                direction=DIRECTION, load_if_exists=True,
                                sampler=make_sampler(seed, n_startup_trials))
    done = len(study.get_trials(deepcopy=False))
    if done and seed is not None:
        # a resumed study: the same seed would draw the first call's random start-up configs
        # again (each one then a duplicate, told its old value, exploring nothing); seeded by
        # the ledger's length, a resume stays reproducible and draws new ones
        study.sampler = make_sampler(seed + done, n_startup_trials)
    return study


def _worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def _alive(worker: str) -> bool:
    host, _, pid = worker.rpartition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return True  # another host's worker: cannot tell, leave it
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def recover_interrupted(study: Any, every_running: bool = False) -> list[int]:
    """Mark RUNNING trials whose worker (on this host) is gone as failed, and enqueue their
    configs again; `every_running`: every RUNNING trial, whatever its host (the caller knows
    no other worker runs: a study carried from a machine that was taken away). Returns their
    numbers."""
    optuna = _optuna()
    lost = []
    for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        worker = t.user_attrs.get("worker")
        if worker is None or (not every_running and _alive(worker)):
            continue
        study._storage.set_trial_user_attr(t._trial_id, "failure", "interrupted")
        study._storage.set_trial_user_attr(t._trial_id, "error",
                                           f"worker {worker} stopped during the trial")
        study._storage.set_trial_state_values(t._trial_id, optuna.trial.TrialState.FAIL)
        params = t.user_attrs.get("params")
        if params:
            study.enqueue_trial(params, user_attrs={
                "source": t.user_attrs.get("source", "sampler"),
                "rule": t.user_attrs.get("rule"), "retry_of": t.number})
        lost.append(t.number)
    return lost


def ledger(study: Any) -> list[Any]:
    """The finished trials (complete or failed), in order."""
    optuna = _optuna()
    states = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.FAIL)
    return sorted(study.get_trials(deepcopy=False, states=states), key=lambda t: t.number)


def measured(trials: list[Any]) -> list[Any]:
    """Trials that count against the budget: not duplicates of earlier configs (not
    measured again) and not interrupted (retried)."""
    return [t for t in trials if "duplicate_of" not in t.user_attrs
            and t.user_attrs.get("failure") != "interrupted"]


def is_feasible(t: Any) -> bool:
    return t.user_attrs.get("failure") is None and t.value is not None and \
        t.user_attrs.get("constraint", 0.0) <= 0.0 and "params" in t.user_attrs


def best_of(trials: list[Any]) -> Any | None:
    """The feasible trial with the highest objective (the earlier one on a tie)."""
    ok = [t for t in trials if is_feasible(t)]
    return max(ok, key=lambda t: (t.value, -t.number)) if ok else None


def best_trial(study: Any) -> Any | None:
    return best_of(ledger(study))


def _tried(study: Any) -> set[tuple]:
    """Configs in the study: measured, running, or queued (enqueued params)."""
    keys = set()
    for t in study.get_trials(deepcopy=False):
        params = t.user_attrs.get("params")
        if params is None and t.state.name == "WAITING":
            params = t.system_attrs.get("fixed_params")
        if params:
            keys.add(config_key(params))
    return keys


def _waiting(study: Any) -> int:
    optuna = _optuna()
    return len(study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.WAITING,)))


def _enqueue_start(study: Any, space: Space) -> None:
    """Queue the start config once per study, whichever worker comes first (the check and the
    enqueue under one file lock beside a SQLite or journal ledger: two workers starting at
    once must not both queue it; a server database has no such lock)."""
    with _ledger_lock(study):
        if not any(t.user_attrs.get("source") == "start"
                   for t in study.get_trials(deepcopy=False)) \
                and config_key(space.start) not in _tried(study):
            study.enqueue_trial(space.start, user_attrs={"source": "start"})


@contextlib.contextmanager
def _ledger_lock(study: Any) -> Iterator[None]:
    """An exclusive lock on `<ledger file>.lock` for a SQLite or journal ledger; nothing for a
    server database."""
    storage = getattr(study._storage, "_backend", study._storage)  # RDB (cached) or journal
    url = str(getattr(storage, "url", ""))
    path = (url.removeprefix("sqlite:///") if url.startswith("sqlite:///") else
            getattr(storage, "_file_path", None))
    if not path or path == ":memory:":
        yield
        return
    with open(f"{path}.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _combined(study: Any, space: Space) -> Any | None:
    """A finished round of the doctor's single moves, two or more of which beat their base:
    those moves together (steer.combination), or None."""
    trials = ledger(study)
    singles: dict[int, list[Any]] = {}
    for t in trials:
        if t.user_attrs.get("source") == "doctor" and "from_trial" in t.user_attrs and \
                not t.user_attrs.get("rule", "").startswith("combined"):
            singles.setdefault(int(t.user_attrs["from_trial"]), []).append(t)
    tried = _tried(study)
    for base_no in sorted(singles, reverse=True):
        base = study.trials[base_no]
        if not is_feasible(base):
            continue
        gained = [(t.user_attrs["rule"], t.user_attrs["moved"]) for t in singles[base_no]
                  if is_feasible(t) and t.value > base.value]
        found = combination(space, base.user_attrs["params"], gained, tried)
        if found is not None:
            return found, base_no
    return None


def _enqueue_doctor(study: Any, space: Space) -> int:
    """A combination of a round's gains, else the best trial's verdicts, as trials; the
    number enqueued."""
    combined = _combined(study, space)
    if combined is not None:
        p, base_no = combined
        study.enqueue_trial(p.params, user_attrs={
            "source": "doctor", "rule": p.rule, "moved": p.moved, "from_trial": base_no,
            "verdict": p.message, "skipped_settings": {}})
        return 1
    best = best_trial(study)
    if best is None:
        return 0
    found = proposals(space, best.user_attrs["params"], best.user_attrs.get("verdicts", []),
                      _tried(study))
    for p in found:
        study.enqueue_trial(p.params, user_attrs={
            "source": "doctor", "rule": p.rule, "moved": p.moved, "from_trial": best.number,
            "verdict": p.message, "skipped_settings": p.skipped})
    return len(found)


def _record(study: Any, trial: Any, params: Mapping[str, Any], out: Outcome,
            constraint: float) -> None:
    attrs = {"params": dict(params), "runs": out.runs, "verdicts": out.verdicts,
             "capacity": out.capacity, "failure": out.failure, "error": out.error,
             "seconds": round(out.seconds, 2), "command": out.command, "extra": out.extra,
             "constraint": constraint}
    for key, value in attrs.items():
        trial.set_user_attr(key, json.loads(json.dumps(value, default=str)))


Event = Callable[[str, dict[str, Any]], None]


def search(study: Any, space: Space, evaluator: Evaluator, budget: Budget,
           fixed: Mapping[str, Any] | None = None, on_event: Event | None = None,
           clock: Callable[[], float] = time.monotonic) -> str:
    """Run trials until the budget; returns why it stopped ("trials", "time", "exhausted").
    KeyboardInterrupt marks the running trial failed ("interrupted") and propagates, with
    the ledger intact."""
    optuna = _optuna()
    emit = on_event or (lambda kind, info: None)
    started = clock()
    recovered = recover_interrupted(study, budget.recover_every_running)
    if recovered:
        emit("recovered", {"trials": recovered})
    _enqueue_start(study, space)
    duplicates = 0
    while True:
        done = len(measured(ledger(study)))
        if budget.n_trials is not None and done >= budget.n_trials:
            return "trials"
        if budget.wall_time_s is not None and clock() - started >= budget.wall_time_s:
            return "time"
        if budget.doctor and not _waiting(study):
            _enqueue_doctor(study, space)
        trial = study.ask()
        try:
            trial.set_user_attr("worker", _worker_id())
        except optuna.exceptions.UpdateFinishedTrialError:  # see the NOTE in _measure
            emit("lost", {"number": trial.number})
            continue
        source = trial.user_attrs.get("source", "sampler")
        trial.set_user_attr("source", source)
        params = space.complete(space.suggest(trial))
        trial.set_user_attr("params", json.loads(json.dumps(params)))
        prior = _measured_twin(study, params, trial.number) if source == "sampler" else None
        if prior is not None:
            _tell_duplicate(study, trial, prior)
            duplicates += 1
            if duplicates >= MAX_DUPLICATES_IN_A_ROW:
                return "exhausted"
            continue
        duplicates = 0
        emit("start", {"number": trial.number, "source": source, "params": params,
                       "rule": trial.user_attrs.get("rule")})
        out = _measure(study, trial, params, source, space, evaluator, fixed or {})
        if out is None:  # see the NOTE in _measure
            emit("lost", {"number": trial.number})
            continue
        best = best_trial(study)
        emit("end", {"number": trial.number, "source": source, "outcome": out,
                     "best": None if best is None else (best.number, best.value)})


def _tell_duplicate(study: Any, trial: Any, prior: Any) -> None:
    """A config measured before: told its earlier value and constraint, not run again."""
    trial.set_user_attr("duplicate_of", prior.number)
    trial.set_user_attr("failure", prior.user_attrs.get("failure"))
    trial.set_user_attr("constraint", prior.user_attrs.get("constraint", 0.0))
    trial.set_constraint("infeasible", float(prior.user_attrs.get("constraint", 0.0)))
    study.tell(trial, prior.value if prior.value is not None else 0.0)


def _measure(study: Any, trial: Any, params: dict[str, Any], source: str, space: Space,
             evaluator: Evaluator, fixed: Mapping[str, Any]) -> Outcome | None:
    """Evaluate the trial's config (an invalid one without a server) and tell the ledger;
    None when another worker told this trial first."""
    optuna = _optuna()
    reason = space.check(params, fixed)
    try:
        out = (Outcome(None, failure="invalid", error=reason) if reason is not None
               else evaluator.evaluate(params, "trial"))
    except KeyboardInterrupt:  # the ledger keeps the trial; a resume runs its config again
        trial.set_user_attr("failure", "interrupted")
        trial.set_user_attr("error", "stopped by the user (Ctrl-C)")
        study.tell(trial, state=optuna.trial.TrialState.FAIL)
        study.enqueue_trial(params, user_attrs={"source": source, "retry_of": trial.number,
                                                "rule": trial.user_attrs.get("rule")})
        raise
    constraint = _constraint(out)
    try:
        _record(study, trial, params, out, constraint)
        trial.set_constraint("infeasible", constraint)
        study.tell(trial, out.value if out.value is not None else 0.0)
    except optuna.exceptions.UpdateFinishedTrialError:
        # NOTE: should two workers ever pop one queued trial (a database whose transactions
        # are not serialized; SQLite's are, _serialize_sqlite), the other told it first and
        # the ledger holds its measurement: this one is dropped
        return None
    return out


def _constraint(out: Outcome) -> float:
    """Optuna's constraint value: <= 0 feasible; an SLO miss by its relative excess (a near
    miss is near the feasible region), any other failure 1."""
    if out.failure is None and out.value is not None:
        return 0.0
    if out.failure == "slo":
        return max(1e-3, float(out.extra.get("slo_excess", 1.0)))
    return 1.0


def _measured_twin(study: Any, params: Mapping[str, Any], number: int) -> Any | None:
    key = config_key(params)
    for t in measured(ledger(study)):
        if t.number != number and t.user_attrs.get("params") and \
                config_key(t.user_attrs["params"]) == key:
            return t
    return None
