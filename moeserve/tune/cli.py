"""`moeserve tune`: flags, the phases, the progress display.

    run_tune(args)
      setup      the model or preset, the fixed server arguments (never searched), the start
                 config (--start: the flags of the first trial, searched from there), the
                 device (cuda when the fixed arguments or this machine say so), the knob space
      study      open or resume the ledger (--storage, --study-name); a resumed study must
                 have been made for the same model, workload and concurrencies
      phases     --phases search,confirm,ablate,report (default: all, in that order)
        search   trials until --n-trials (the study's, every worker's) or --wall-time
        confirm  --confirm-arms (best vs start; the engine's defaults too on request: the
                 best judged against each), in turn, --confirm-runs each, the full workload
                 on fresh servers; resumable run by run (a call cut short goes on next time)
        ablate   the winner with each knob set back to the start's, one at a time; Optuna's
                 importances
        report   OUT/tune.md, tune.json and plots; the winner's command line
      Ctrl-C     ends the running trial as "interrupted", keeps the ledger, exits 130; the
                 same command resumes
      --time-limit  the confirmation and the ablation start no run that their earlier runs
                 say would end past it (a machine's command limit would lose it whole); exit 3,
                 and the same command resumes

Exit codes: 0 done, 1 no feasible trial, 2 bad flags, 3 out of --time-limit, 130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console

from moeserve.tune.deadline import Deadline, OutOfTime
from moeserve.tune.evaluate import BenchPlan, Outcome, ServerBenchEvaluator, Slo


def add_tune_args(parser: argparse.ArgumentParser) -> None:
    t = parser.add_argument_group("what to tune")
    t.add_argument("--preset", default=None, help="a built-in preset (default: tiny-moe)")
    t.add_argument("--model", default=None, help="a checkpoint folder (instead of --preset)")
    t.add_argument("--server-args", default="", help="`moeserve serve` flags fixed for every "
                   "trial, as one string; a knob set here is not searched")
    t.add_argument("--start", default="", help="the start config: engine flags of the first "
                   "trial, as one string (e.g. \"--max-running-requests 64 --enforce-eager\"); "
                   "the rest start at the engine's defaults")
    t.add_argument("--knobs", default=None, help="comma-separated config fields to search "
                   "(default: every knob of the device; `--list-knobs` shows them)")
    t.add_argument("--list-knobs", action="store_true", help="print the knob space and exit")
    w = parser.add_argument_group("workload and goal")
    w.add_argument("--max-concurrency", nargs="+", default=["1024"], metavar="C",
                   help="the concurrency or concurrencies to optimise (the objective is the "
                   "geometric mean of their output tok/s) (default: 1024)")
    w.add_argument("--bench-args", default="", help="`moeserve bench` workload flags, as one "
                   "string (default: W1, random 128 in / 128 out)")
    w.add_argument("--trial-prompts", default="1x", help="prompts per search trial: N, or Kx "
                   "= K x the concurrency (default: 1x)")
    w.add_argument("--confirm-prompts", default="3x", help="prompts per confirmation run "
                   "(default: 3x, W1's)")
    w.add_argument("--slo-tpot-ms", type=float, help="latency bound: TPOT in ms")
    w.add_argument("--slo-ttft-ms", type=float, help="latency bound: TTFT in ms")
    w.add_argument("--slo-stat", choices=("p99", "median"), default="p99",
                   help="which TPOT/TTFT the bounds apply to (default: p99)")
    b = parser.add_argument_group("budget and ledger")
    b.add_argument("--n-trials", type=int, default=30, help="measured trials in the study, "
                   "every worker's together (default: 30)")
    b.add_argument("--wall-time", type=float, help="seconds this call may search")
    b.add_argument("--time-limit", type=float, help="seconds this whole call may take: the "
                   "confirmation and the ablation start no run that would end past it (as "
                   "their earlier runs say), and stop with exit 3 to be resumed")
    b.add_argument("--trial-timeout", type=float, default=900.0, help="seconds a trial's "
                   "bench may run before it is infeasible (timeout); a confirmation run gets "
                   "as many times more as it has prompts (default: 900)")
    b.add_argument("--server-timeout", type=float, default=900.0, help="seconds a server may "
                   "take to be ready (default: 900)")
    b.add_argument("--storage", default="sqlite:///tune.db", help="the ledger: an Optuna RDB "
                   "URL or journal:PATH (default: sqlite:///tune.db)")
    b.add_argument("--study-name", default=None, help="default: tune-<model>-c<C>")
    b.add_argument("--seed", type=int, default=0, help="the sampler's seed (default: 0)")
    b.add_argument("--recover-running", action="store_true", help="take every trial the "
                   "ledger shows running as interrupted (its config runs again), whatever "
                   "host ran it: when no other worker is on this study (default: only this "
                   "host's workers that are gone)")
    b.add_argument("--no-doctor", dest="doctor", action="store_false",
                   help="do not let the doctor's verdicts propose trials")
    p = parser.add_argument_group("phases and output")
    p.add_argument("--phases", default="search,confirm,ablate,report",
                   help="comma-separated, in order: search, confirm, ablate, report")
    p.add_argument("--confirm-runs", type=int, default=3, help="runs per arm (default: 3)")
    p.add_argument("--confirm-arms", default="best,start", help="the arms of the confirmation, "
                   "in turn: best, start, defaults (the engine's defaults); the first is "
                   "judged against each of the others (default: best,start)")
    p.add_argument("--confirm-defaults", action="store_true",
                   help="add the engine's defaults as an arm (same as listing them last)")
    p.add_argument("--out", default="tune-out", help="folder for the report, plots and server "
                   "logs (default: tune-out)")


PHASES = ("search", "confirm", "ablate", "report")
# bench flags each trial sets itself
_TUNE_OWNS = {"--url", "--max-concurrency", "--num-prompts", "--output-json", "--preset",
              "--server-args", "--diagnose", "--no-progress"}


def _prompts(spec: str, flag: str):
    text = spec.strip().lower()
    try:
        if text.endswith("x"):
            k = float(text[:-1])
            if k <= 0:
                raise ValueError
            return lambda c: max(1, int(math.ceil(k * c)))
        n = int(text)
        if n < 1:
            raise ValueError
        return lambda c: n
    except ValueError:
        raise ValueError(f"{flag} {spec!r}: expected N or Kx (K x the concurrency)") from None


def _engine_flags(text: str, what: str) -> dict[str, Any]:
    """The engine fields a flag string sets (serve's own flags allowed in --server-args)."""
    from moeserve.engine.args import engine_kwargs_from_args
    from moeserve.server.process.launch import add_serve_args

    parser = argparse.ArgumentParser(prog=f"moeserve tune {what}", add_help=False,
                                     exit_on_error=False)
    add_serve_args(parser)
    try:
        ns, rest = parser.parse_known_args(shlex.split(text))
    except (argparse.ArgumentError, ValueError) as e:
        raise ValueError(f"{what}: {e}") from None
    if rest:
        raise ValueError(f"{what}: unknown flag(s) {' '.join(rest)}")
    return engine_kwargs_from_args(ns)


def _device(fixed: Mapping[str, Any]) -> str:
    dev = str(fixed.get("device", "auto"))
    if dev == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return "cuda" if dev.startswith("cuda") else "cpu"


def _device_count(device: str) -> int:
    """The GPUs a study may spread one server over (1 on CPU: gloo ranks there are for tests,
    not throughput)."""
    if device != "cuda":
        return 1
    import torch

    return torch.cuda.device_count()


class Progress:
    """One line when a trial starts, one when it ends: its figures and the best so far."""

    def __init__(self, console: Console, space: Any) -> None:
        self.console = console
        self.space = space

    def __call__(self, kind: str, info: dict[str, Any]) -> None:
        from moeserve.tune.report import _moved

        if kind == "recovered":
            self.console.print(f"resumed: trial(s) {info['trials']} were interrupted; their "
                               "configs run again")
        elif kind == "start":
            who = info["source"] + (f": {info['rule']}" if info.get("rule") else "")
            self.console.print(f"trial {info['number']} [{who}] "
                               f"{_moved(self.space, info['params'])}")
        elif kind == "end":
            out: Outcome = info["outcome"]
            best = info["best"]
            tail = f"; best {best[1]:,.0f} tok/s (trial {best[0]})" if best else ""
            if out.failure is None and out.value is not None:
                r = out.runs[0]
                self.console.print(
                    f"  -> {out.value:,.0f} tok/s, median TPOT {r.get('median_tpot_ms') or 0:.1f}"
                    f" ms, p99 TTFT {r.get('p99_ttft_ms') or 0:,.0f} ms, "
                    f"{len(out.verdicts)} verdicts, {out.seconds:.0f} s{tail}")
            else:
                self.console.print(f"  -> infeasible ({out.failure}): "
                                   f"{' '.join(str(out.error).split())[:300]}{tail}")


def run_tune(args: argparse.Namespace | Sequence[str]) -> int:
    if not isinstance(args, argparse.Namespace):
        parser = argparse.ArgumentParser(prog="moeserve tune")
        add_tune_args(parser)
        args = parser.parse_args(list(args))
    # plain text: a trial's "[doctor: rule]" is not markup, a number is not highlighted
    console = Console(markup=False, highlight=False, width=None if sys.stdout.isatty() else 120)
    try:
        return _tune(args, console)
    except ValueError as e:
        print(f"moeserve tune: error: {e}", file=sys.stderr)
        return 2


def _setup(args: argparse.Namespace) -> dict[str, Any]:
    from moeserve.tune.space import knob_space

    if args.preset and args.model:
        raise ValueError("give --preset or --model, not both")
    model = args.model or args.preset or "tiny-moe"
    fixed = _engine_flags(args.server_args, "--server-args")
    if "model" in fixed:
        raise ValueError("--server-args: give the model with --preset/--model")
    start = _engine_flags(args.start, "--start")
    device = _device(fixed)
    only = [k.strip() for k in args.knobs.split(",") if k.strip()] if args.knobs else None
    concurrencies = []
    for v in args.max_concurrency:
        for part in str(v).split(","):
            if part.strip():
                try:
                    concurrencies.append(int(part))
                except ValueError:
                    raise ValueError(f"--max-concurrency: {part!r} is not an integer") from None
    if not concurrencies or min(concurrencies) < 1:
        raise ValueError("--max-concurrency: give at least one concurrency >= 1")
    num_devices = _device_count(device)
    space = knob_space(device, start, fixed=list(fixed), only=only,
                       concurrency=max(concurrencies), num_devices=num_devices,
                       dummy_weights=_dummy_weights(model, fixed),
                       shared_experts=_shared_experts(model),
                       quantized=_quantized_checkpoint(model, fixed))
    owned = sorted({a.split("=")[0] for a in shlex.split(args.bench_args)} & _TUNE_OWNS)
    if owned:
        raise ValueError(f"--bench-args: {', '.join(owned)} are the tune's own (use "
                         "--max-concurrency, --trial-prompts / --confirm-prompts, --preset)")
    phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    bad = [p for p in phases if p not in PHASES]
    if bad or not phases:
        raise ValueError(f"--phases: {', '.join(bad) or '(none)'} not among {', '.join(PHASES)}")
    if args.confirm_runs < 1 or args.n_trials < 1:
        raise ValueError("--confirm-runs and --n-trials must be >= 1")
    return {"model": model, "fixed": fixed, "space": space, "device": device,
            "concurrencies": concurrencies, "phases": phases, "num_devices": num_devices}


def _dummy_weights(model: str, fixed: dict[str, Any]) -> bool:
    """Whether the served weights are random (a preset's default, or --load-format dummy), so
    that their quantized format is a choice."""
    from moeserve.presets import is_preset

    load = fixed.get("load_format", "auto")
    return load == "dummy" or (load == "auto" and is_preset(model))


def _shared_experts(model: str) -> bool:
    """Whether the model (a preset or a checkpoint folder) has shared experts, so that folding
    them is a choice; False where its config cannot be read here (the server then says)."""
    from moeserve.config import load_model_config

    try:
        return bool(load_model_config(model)[0].shared_expert_intermediate_size)
    except (OSError, ValueError):
        return False


def _quantized_checkpoint(model: str, fixed: dict[str, Any]) -> bool:
    """Whether the served weights are quantized whatever the study picks: a checkpoint that
    declares a format, or --quantization among the fixed arguments; False where the model's
    config cannot be read here."""
    from moeserve.config import load_model_config

    if fixed.get("quantization") is not None:
        return True
    try:
        return load_model_config(model)[0].quantization is not None
    except (OSError, ValueError):
        return False


def _arms(args: argparse.Namespace, best: dict[str, Any], space: Any) -> dict[str, dict]:
    """--confirm-arms (and --confirm-defaults) as name -> config, in turn order."""
    configs = {"best": best, "start": space.start,
               "defaults": {n: k.default for n, k in space.knobs.items()}}
    names = [a.strip() for a in args.confirm_arms.split(",") if a.strip()]
    if args.confirm_defaults and "defaults" not in names:
        names.append("defaults")
    bad = [a for a in names if a not in configs]
    if bad or len(names) < 2 or len(set(names)) != len(names):
        raise ValueError(f"--confirm-arms {args.confirm_arms!r}: two or more distinct arms of "
                         f"{', '.join(configs)}")
    return {a: configs[a] for a in names}


def _check_setup(study: Any, setup: dict[str, Any]) -> None:
    """A resumed study must measure the same thing: else its trials are not comparable."""
    have = study.user_attrs.get("setup")
    if have is None:
        study.set_user_attr("setup", setup)
        return
    differ = [k for k in setup if k in have and have[k] != setup[k]]
    if differ:
        raise ValueError(f"study {study.study_name!r} was made for another setup ("
                         + "; ".join(f"{k}: {have[k]!r} there, {setup[k]!r} now" for k in differ)
                         + "): give another --study-name")


def _report_only(args: argparse.Namespace, console: Console) -> int:
    """`--phases report` on a study made anywhere (another machine, another device): the
    setup it was made with, from the ledger, instead of this command's flags."""
    from moeserve.tune import report
    from moeserve.tune import study as study_mod
    from moeserve.tune.space import knob_space

    if not args.study_name:
        raise ValueError("--phases report alone needs --study-name (the study to report)")
    study = study_mod.open_study(args.storage, args.study_name, args.seed)
    setup = study.user_attrs.get("setup")
    if setup is None:
        raise ValueError(f"study {args.study_name!r} in {args.storage} has no trials of "
                         "moeserve tune (no setup recorded)")
    fixed = _engine_flags(setup["server_args"], "--server-args")
    space = knob_space(setup["device"], setup["start"], fixed=list(fixed), only=setup["knobs"],
                       concurrency=max(setup["concurrencies"]),
                       num_devices=setup.get("num_devices", 1),
                       dummy_weights="quantization" in setup["knobs"],
                       shared_experts="fold_shared_experts" in setup["knobs"])
    evaluator = ServerBenchEvaluator(setup["model"], shlex.split(setup["server_args"]),
                                     BenchPlan(setup["concurrencies"]), flags_of=space.flags)
    path = report.write_report(study, space, Path(args.out),
                               lambda p: shlex.join(evaluator.command(p)))
    console.print(f"report: {path}")
    return 0


def _saver(study: Any, key: str):
    """Keep a phase's run records in the study's attributes (JSON), so it resumes run by run."""
    return lambda records: study.set_user_attr(key, json.loads(json.dumps(records, default=str)))


def _said(o: Outcome) -> str:
    return f"{o.value:,.0f} tok/s" if o.failure is None else f"{o.failure}: {o.error}"


def _confirm_phase(args: argparse.Namespace, study: Any, evaluator: Any, space: Any, best: Any,
                   console: Console, deadline: Any) -> None:
    from moeserve.tune import confirm

    arms = _arms(args, best.user_attrs["params"], space)
    c = confirm.confirm(evaluator, arms, args.confirm_runs,
                        on_run=lambda arm, i, o: console.print(
                            f"confirm {arm} run {i + 1}: {_said(o)}"),
                        done=study.user_attrs.get("confirmation_runs"),
                        save=_saver(study, "confirmation_runs"), deadline=deadline)
    done = dict(study.user_attrs.get("confirmations") or {})
    done[" vs ".join(arms)] = c.to_dict() | {"best_trial": best.number}
    study.set_user_attr("confirmations", done)
    console.print(c.line())


def _ablate_phase(study: Any, evaluator: Any, space: Any, best: Any, console: Console,
                  deadline: Any) -> None:
    from moeserve.tune import ablation

    ref, rows = ablation.ablate(evaluator, space, best.user_attrs["params"], space.start,
                                on_run=lambda knob, o: console.print(
                                    f"ablate {knob}: {_said(o)}"),
                                done=study.user_attrs.get("ablation_runs"),
                                save=_saver(study, "ablation_runs"), deadline=deadline)
    study.set_user_attr("ablation", {"reference": ref, "best_trial": best.number,
                                     "knobs": [r.to_dict() for r in rows]})
    imp, why = ablation.importances(study)
    study.set_user_attr("importances", imp or None)
    if why:
        console.print(why)


def _tune(args: argparse.Namespace, console: Console) -> int:
    from moeserve.tune import report
    from moeserve.tune import study as study_mod

    deadline = Deadline(args.time_limit)
    phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    if phases == ["report"] and not args.list_knobs:
        return _report_only(args, console)
    s = _setup(args)
    space = s["space"]
    if args.list_knobs:
        for line in space.help_lines():
            console.print(line)
        return 0
    plan = BenchPlan(s["concurrencies"], _prompts(args.trial_prompts, "--trial-prompts"),
                     _prompts(args.confirm_prompts, "--confirm-prompts"),
                     shlex.split(args.bench_args))
    out_dir = Path(args.out)
    evaluator = ServerBenchEvaluator(
        s["model"], shlex.split(args.server_args), plan,
        Slo(args.slo_tpot_ms, args.slo_ttft_ms, args.slo_stat), args.trial_timeout,
        args.server_timeout, out_dir / "logs", flags_of=space.flags)
    concs = "-".join(map(str, s["concurrencies"]))
    name = args.study_name or f"tune-{Path(s['model']).name}-c{concs}"
    n_startup = max(4, args.n_trials // 4)
    study = study_mod.open_study(args.storage, name, args.seed, n_startup)
    _check_setup(study, {"model": s["model"], "device": s["device"],
                         "concurrencies": s["concurrencies"], "bench_args": args.bench_args,
                         "trial_prompts": args.trial_prompts, "server_args": args.server_args,
                         "start": space.start, "knobs": list(space.knobs),
                         "num_devices": s["num_devices"],
                         "slo": [args.slo_tpot_ms, args.slo_ttft_ms, args.slo_stat]})
    command_of = lambda p: shlex.join(evaluator.command(p))  # noqa: E731
    # one line whatever the storage's length (a wrapped path broke "trials so far" apart)
    console.print(f"study {name!r} in {args.storage}: {len(study_mod.ledger(study))} trials so "
                  f"far; searching {len(space.knobs)} knobs on {s['device']}", soft_wrap=True)
    try:
        if "search" in s["phases"]:
            why = study_mod.search(study, space, evaluator,
                                   study_mod.Budget(args.n_trials, args.wall_time, args.doctor,
                                                    args.recover_running),
                                   fixed=s["fixed"], on_event=Progress(console, space))
            console.print(f"search stopped: {why}")
        best = study_mod.best_trial(study)
        if best is None:
            console.print("no feasible trial: every config failed (see the ledger's errors)")
            return 1
        if "confirm" in s["phases"]:
            _confirm_phase(args, study, evaluator, space, best, console, deadline)
        if "ablate" in s["phases"]:
            _ablate_phase(study, evaluator, space, best, console, deadline)
        if "report" in s["phases"]:
            path = report.write_report(study, space, out_dir, command_of)
            console.print(f"report: {path}")
    except OutOfTime as e:
        console.print(f"stopped: {e}; the ledger ({args.storage}, study {name!r}) holds every "
                      "finished run; the same command resumes")
        return 3
    except KeyboardInterrupt:
        console.print(f"\nstopped: the ledger ({args.storage}, study {name!r}) holds "
                      f"{len(study_mod.ledger(study))} trials; the same command resumes")
        return 130
    console.print(f"winner (trial {best.number}, {best.value:,.0f} tok/s in the search):\n  "
                  f"{command_of(best.user_attrs['params'])}")
    return 0
