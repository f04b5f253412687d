"""The tune's result: the winner's command line, what each knob was worth, the trials, plots.

    summarize(study, space, command_of) -> dict     the JSON result (study user attributes
                                                    hold the confirmation and ablation)
    write_report(study, space, out, command_of)     OUT/tune.md, OUT/tune.json, the plots:
        history.png       each trial's objective by source (start, doctor, sampler), the
                          infeasible ones marked at 0, and the best so far
        knobs.png         the objective against the most important knobs (one panel each)

The doctor's share: the best objective reached by the start and the doctor's trials alone,
and what the sampler's trials found beyond it. The markdown tables and the plots' matplotlib
set-up are `moeserve report`'s (diagnose/report.py, diagnose/plots.py).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from moeserve.diagnose.plots import _plt
from moeserve.diagnose.report import _table
from moeserve.tune.space import Space
from moeserve.tune.study import best_of, best_trial, is_feasible, ledger, measured

SOURCES = ("start", "doctor", "sampler")
_COLORS = {"start": "tab:red", "doctor": "tab:green", "sampler": "tab:blue"}


def summarize(study: Any, space: Space, command_of: Callable[[Mapping[str, Any]], str]
              ) -> dict[str, Any]:
    trials = ledger(study)
    runs = measured(trials)
    best = best_trial(study)
    start = next((t for t in runs if t.user_attrs.get("source") == "start"), None)
    steered = best_of([t for t in runs if t.user_attrs.get("source") in ("start", "doctor")])
    overall = best_of(runs)
    attrs = study.user_attrs
    return {
        "study": study.study_name,
        "trials": len(trials),
        "measured": len(runs),
        "infeasible": [{"number": t.number, "failure": t.user_attrs.get("failure"),
                        "error": t.user_attrs.get("error")}
                       for t in runs if not is_feasible(t)],
        "by_source": {s: sum(1 for t in runs if t.user_attrs.get("source") == s)
                      for s in SOURCES},
        "start": None if start is None else _row(start),
        "best": None if best is None else _row(best) | {
            "command": command_of(best.user_attrs["params"])},
        "doctor": {"best_value": None if steered is None else steered.value,
                   "best_trial": None if steered is None else steered.number,
                   "gain_over_start": _gain(steered, start),
                   "sampler_beyond": _gain(overall, steered)},
        "confirmations": attrs.get("confirmations") or {},
        "ablation": attrs.get("ablation"),
        "importances": attrs.get("importances"),
        "space": space.help_lines(),
    }


def _gain(a: Any | None, b: Any | None) -> float | None:
    if a is None or b is None or not b.value or a.value is None:
        return None
    return a.value / b.value - 1.0


def _row(t: Any) -> dict[str, Any]:
    return {"number": t.number, "value": t.value, "source": t.user_attrs.get("source"),
            "rule": t.user_attrs.get("rule"), "params": t.user_attrs.get("params")}


def _moved(space: Space, params: Mapping[str, Any]) -> str:
    diff = [f"{k}={params.get(k)}" for k in space.knobs
            if repr(params.get(k)) != repr(space.start.get(k))]
    return ", ".join(diff) or "(the start)"


def write_report(study: Any, space: Space, out: str | Path,
                 command_of: Callable[[Mapping[str, Any]], str]) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    s = summarize(study, space, command_of)
    (out / "tune.json").write_text(json.dumps(s, indent=2, default=str) + "\n")
    trials = ledger(study)
    history(trials, out / "history.png")
    imp = s["importances"] or {}
    knob_plot(trials, [k for k in imp if k in space.knobs][:3] or list(space.knobs)[:3],
              out / "knobs.png")
    lines = [f"# moeserve tune: {s['study']}", ""]
    lines += [f"{s['measured']} measured trials ({s['by_source']['start']} start, "
              f"{s['by_source']['doctor']} proposed by the doctor, "
              f"{s['by_source']['sampler']} by the sampler), {len(s['infeasible'])} "
              "infeasible.", ""]
    if s["best"]:
        lines += ["## Winner", "", f"Trial {s['best']['number']} ({s['best']['source']}"
                  + (f", {s['best']['rule']}" if s['best']['rule'] else "") +
                  f"): {s['best']['value']:,.0f} tok/s in the search.", "", "```",
                  s["best"]["command"], "```", ""]
    if s["start"]:
        lines += [f"The start (trial {s['start']['number']}): {s['start']['value']:,.0f} tok/s.",
                  ""]
    d = s["doctor"]
    if d["best_value"] is not None:
        lines += ["## The doctor's trials and the sampler's", "",
                  f"The start and the doctor's proposals reached {d['best_value']:,.0f} tok/s "
                  f"(trial {d['best_trial']}" + (f", {d['gain_over_start']:+.1%} over the start"
                                                 if d['gain_over_start'] is not None else "")
                  + "); the sampler's trials added "
                  + (f"{d['sampler_beyond']:+.1%}" if d['sampler_beyond'] is not None else "—")
                  + " beyond them.", ""]
    for title, c in s["confirmations"].items():
        lines += [f"## Confirmation: {title} (full workload, fresh servers, in turn)", ""]
        lines += _table(["arm", "runs", "mean tok/s", "spread", "values", "failures"],
                        [[a["name"], len(a["values"]), f"{a['mean']:,.0f}" if a["mean"] else "—",
                          f"{a['spread']:,.0f}", ", ".join(f"{v:,.0f}" for v in a["values"]),
                          len(a["failures"])] for a in c["arms"]])
        first = c["arms"][0]["name"]
        comparisons = c.get("comparisons") or [
            {"against": c["arms"][1]["name"]} | {k: c[k] for k in
                                                  ("gain", "difference", "spread", "verdict")}]
        for v in comparisons:
            lines += [f"{first} vs {v['against']}: **{v['verdict']}**" + (
                f" ({v['gain']:+.1%}; difference {v['difference']:+,.0f} tok/s against "
                f"a spread of {v['spread']:,.0f})" if v["gain"] is not None else ""), ""]
    if s["ablation"]:
        a = s["ablation"]
        lines += ["## What each knob was worth (one at a time, from the winner)", "",
                  f"The winner measured again: {a['reference']:,.0f} tok/s." if a.get(
                      "reference") else "The winner's reference run failed.", ""]
        lines += _table(["knob", "winner", "start", "tok/s with the start's value", "worth"],
                        [[r["knob"], r["winner_value"], r["start_value"],
                          f"{r['objective']:,.0f}" if r["objective"] is not None else r["failure"],
                          f"{r['worth']:+,.0f}" if r["worth"] is not None else "—"]
                         for r in a["knobs"]])
        lines += ["A knob's worth is the winner's objective less the winner's with that knob at "
                  "the start's value, one run each: a negative worth says the start's value did "
                  "as well (within the noise the confirmation measured) or better.", ""]
    if s["importances"]:
        lines += ["## Optuna's parameter importances (PED-ANOVA)", ""]
        lines += _table(["knob", "importance"],
                        [[k, f"{v:.3f}"] for k, v in s["importances"].items()])
    lines += ["## Trials", "", "![history](history.png)", "", "![knobs](knobs.png)", ""]
    lines += _table(["#", "source", "moved from the start", "tok/s", "failure", "seconds"],
                    [[t.number, t.user_attrs.get("source", "") + (
                        f" ({t.user_attrs['rule']})" if t.user_attrs.get("rule") else "")
                      + (f" = #{t.user_attrs['duplicate_of']}"
                         if "duplicate_of" in t.user_attrs else ""),
                      _moved(space, t.user_attrs.get("params") or {}),
                      f"{t.value:,.0f}" if t.value else "—",
                      (t.user_attrs.get("failure") or "")
                      + (f": {_short(t.user_attrs.get('error'))}"
                         if t.user_attrs.get("error") else ""),
                      t.user_attrs.get("seconds", "")] for t in trials])
    lines += ["## The knob space", ""] + [f"- {line}" for line in s["space"]] + [""]
    path = out / "tune.md"
    path.write_text("\n".join(lines))
    return path


def _short(text: Any, n: int = 160) -> str:
    t = " ".join(str(text).split())
    return t if len(t) <= n else t[: n - 1] + "…"


def history(trials: list[Any], path: Path) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(10, 4.2))
    best, best_xs, best_ys = 0.0, [], []
    for source in SOURCES:
        ok = [t for t in trials if t.user_attrs.get("source") == source and is_feasible(t)]
        bad = [t for t in trials if t.user_attrs.get("source") == source and not is_feasible(t)]
        ax.scatter([t.number for t in ok], [t.value for t in ok], color=_COLORS[source],
                   label=source, zorder=3)
        if bad:
            ax.scatter([t.number for t in bad], [0.0] * len(bad), color=_COLORS[source],
                       marker="x", label=f"{source}: infeasible", zorder=3)
    for t in trials:
        if is_feasible(t) and t.value > best:
            best = t.value
        best_xs.append(t.number)
        best_ys.append(best)
    ax.step(best_xs, best_ys, where="post", color="black", lw=1, label="best so far")
    ax.set_xlabel("trial")
    ax.set_ylabel("output throughput (tok/s)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("Trials: the objective, by who proposed them")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def knob_plot(trials: list[Any], knobs: list[str], path: Path) -> None:
    plt = _plt()
    knobs = knobs or ["(none)"]
    fig, axes = plt.subplots(1, len(knobs), figsize=(4.2 * len(knobs), 3.8), squeeze=False)
    ok = [t for t in trials if is_feasible(t)]
    for ax, knob in zip(axes[0], knobs):
        values = [(t.user_attrs["params"].get(knob), t.value) for t in ok]
        labels = sorted({repr(v) for v, _ in values})
        numeric = all(isinstance(v, int | float) and not isinstance(v, bool) for v, _ in values)
        if numeric:
            ax.scatter([v for v, _ in values], [y for _, y in values])
        else:
            pos = {lab: i for i, lab in enumerate(labels)}
            ax.scatter([pos[repr(v)] for v, _ in values], [y for _, y in values])
            ax.set_xticks(range(len(labels)), [lab.strip("'") for lab in labels], fontsize=8)
        ax.set_xlabel(knob)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("output throughput (tok/s)")
    fig.suptitle("The objective against the main knobs (feasible trials)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
