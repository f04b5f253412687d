"""Where a fixed-length W1 run lost its time against its serial roofline, by step kind and part:
the run's bench JSON (`moeserve bench --output-json`, with the server's engine counters and
`serial_bound`) read beside a `profile_step` JSON of the same preset at the run's concurrency
(its decode step and its mixed step, each part against its own bound).

    steps     the run's forward steps split by kind: decode steps replayed from CUDA graphs
              (`num_graph_steps`) and the rest, eager mixed (prompt + decode) steps (a decode
              step that fell back to eager, `cuda_graph_fallbacks`, counts with them)
    time      decode steps x the profile's decode step (device ms: with overlap scheduling a
              graph step's host work hides behind the previous step), the rest of the run's
              duration to the mixed steps (their per-step share is checked against the
              profile's mixed step, wall and device)
    bound     the serial roofline's phases (ANCHORS.md: every prompt's prefill, then the decode
              steps), once a wave of `concurrency` requests: decode steps against its decode
              phase, mixed steps against its prefill phase (a mixed step also advances the
              running rows, so the split is an attribution, not an identity: the totals are)
    parts     each profiled part's excess over its bound (moe, attention, dense) and the parts
              with no bound (norm_rope, other), times the steps of its kind; and the mixed steps'
              wall time beyond their device time (eager launches and host syncs); what they
              leave of the run's loss against its bound is stated as unattributed
    target    the seconds the run must lose to reach a share of its bound (--target, %)

    python -m benchmarks.engine.w1_budget --run W1.jsonl[.gz] --profile profile_step.json \
        [--target 60] [--out budget.json]

The figures are the profile's: a profile taken at another commit than the run attributes the
run's time by that commit's parts. No GPU needed (it reads JSON).
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
from typing import Any

BOUNDED = ("moe", "attention", "dense")


def read_first(path: str) -> dict[str, Any]:
    """A JSON file's object, or a JSON-lines file's first line (gzip by the .gz suffix)."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        text = f.read()
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return json.loads(text.splitlines()[0])


def _need(obj: dict, key: str, where: str) -> Any:
    if key not in obj or obj[key] is None:
        raise ValueError(f"{where} has no {key!r}")
    return obj[key]


def _parts(profile_parts: dict, where: str) -> dict[str, dict]:
    """{part: {measured_ms, bound_ms}} of a profile's step ("parts": a list of
    step_parts.PartShare dicts)."""
    rows = _need(profile_parts, "parts", where)
    return {r["part"]: r for r in rows}


def budget(run: dict[str, Any], profile: dict[str, Any], target: float = 60.0) -> dict:
    """The run's time by step kind and part against its serial bound (module doc)."""
    bound = _need(run, "serial_bound", "the run")
    counters = _need(_need(run, "engine_run", "the run"), "counters", "the run's engine_run")
    duration = float(_need(run, "duration", "the run"))
    output = float(_need(run, "total_output_tokens", "the run"))
    concurrency = int(bound["concurrency"])
    waves = float(_need(run, "num_prompts", "the run")) / concurrency
    steps = int(counters["num_forward_steps"])
    graph = int(counters["num_graph_steps"])
    mixed = steps - graph
    if not 0 < graph <= steps:
        raise ValueError(f"the run has {graph} graph steps of {steps}: nothing to attribute")
    if profile.get("batch") != concurrency:
        raise ValueError(f"the profile is at batch {profile.get('batch')}, the run at "
                         f"concurrency {concurrency}")
    one = _need(profile, "gpu_kernels_one_step", "the profile")
    decode_ms = float(one["gpu_busy_ms"])
    decode_parts = _parts(one["parts"], "the profile's decode step")
    mix = _need(profile, "mixed_step", "the profile")
    mixed_parts = _parts(mix["parts"], "the profile's mixed step")
    mixed_wall_ms = statistics.median(mix["wall_ms"])
    mixed_device_ms = sum(p["measured_ms"] for p in mixed_parts.values())

    decode_s = graph * decode_ms / 1e3
    mixed_s = duration - decode_s
    kinds = {
        "decode": {"steps": graph, "seconds": decode_s,
                   "bound_seconds": waves * float(bound["decode_s"]),
                   "ms_per_step": decode_ms},
        "mixed": {"steps": mixed, "seconds": mixed_s,
                  "bound_seconds": waves * float(bound["prefill_s"]),
                  "ms_per_step": 1e3 * mixed_s / mixed if mixed else None,
                  "profile_wall_ms": mixed_wall_ms, "profile_device_ms": mixed_device_ms},
    }
    for k in kinds.values():
        k["percent_of_bound"] = round(100 * k["bound_seconds"] / k["seconds"], 1)

    losses = []
    for kind, parts, n in (("decode", decode_parts, graph), ("mixed", mixed_parts, mixed)):
        for name, p in parts.items():
            extra_ms = p["measured_ms"] - (p["bound_ms"] or 0.0)
            losses.append({"kind": kind, "part": name, "per_step_ms": round(extra_ms, 3),
                           "seconds": round(n * extra_ms / 1e3, 3),
                           "bounded": name in BOUNDED})
    losses.append({"kind": "mixed", "part": "host (wall beyond device)",
                   "per_step_ms": round(mixed_wall_ms - mixed_device_ms, 3),
                   "seconds": round(mixed * (mixed_wall_ms - mixed_device_ms) / 1e3, 3),
                   "bounded": False})
    losses.sort(key=lambda r: -r["seconds"])
    bound_tok_s = float(bound["output_tok_s"])
    lost = duration - output / bound_tok_s
    # what the parts leave: a step's bound is max(bytes, FLOPs) of the whole step, its parts'
    # bounds each their own (they add up to more), and a mixed step's decode rows count
    # against the prefill phase
    unattributed = round(lost - sum(r["seconds"] for r in losses), 3)

    needed_s = output / (target / 100 * bound_tok_s)
    return {
        "run": {"duration_s": duration, "output_tok_s": round(output / duration, 1),
                "percent_of_bound": round(100 * output / duration / bound_tok_s, 1),
                "bound_output_tok_s": bound_tok_s, "waves": round(waves, 3), "steps": steps,
                "lost_s": round(lost, 3), "unattributed_s": unattributed},
        "kinds": kinds,
        "losses": losses,
        "target": {"percent": target, "duration_s": round(needed_s, 3),
                   "save_s": round(max(0.0, duration - needed_s), 3)},
    }


def describe(b: dict) -> str:
    """The budget as text: the run, each step kind against its phase, the losses largest first."""
    r, t = b["run"], b["target"]
    lines = [f"run: {r['output_tok_s']:,.0f} output tok/s in {r['duration_s']:.2f} s, "
             f"{r['percent_of_bound']}% of its serial bound {r['bound_output_tok_s']:,.0f} "
             f"({r['waves']} waves, {r['steps']} steps)"]
    for kind, k in b["kinds"].items():
        extra = ""
        if kind == "mixed" and k["steps"]:
            extra = (f" (profile's mixed step: {k['profile_wall_ms']:.1f} ms wall, "
                     f"{k['profile_device_ms']:.1f} on the device)")
        per = f"{k['ms_per_step']:.1f} ms a step" if k["ms_per_step"] is not None else "none"
        lines.append(f"{kind}: {k['steps']} steps, {k['seconds']:.2f} s ({per}){extra} "
                     f"against {k['bound_seconds']:.2f} s of bound: {k['percent_of_bound']}%")
    lines.append(f"to reach {t['percent']}%: {t['duration_s']:.2f} s, {t['save_s']:.2f} s less; "
                 f"{r['lost_s']:.2f} s lost against the bound, of which the parts below "
                 f"{r['lost_s'] - r['unattributed_s']:.2f} s (the rest: the parts' bounds add "
                 f"up to more than their steps', and mixed steps' decode rows)")
    for loss in b["losses"]:
        what = "over its bound" if loss["bounded"] else "(no bound)"
        lines.append(f"  {loss['seconds']:6.2f} s  {loss['kind']:<6} {loss['part']:<26} "
                     f"{loss['per_step_ms']:7.2f} ms a step {what}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", required=True, help="a W1 bench JSON (first line; .gz read)")
    parser.add_argument("--profile", required=True, help="profile_step's JSON, same preset "
                        "at the run's concurrency")
    parser.add_argument("--target", type=float, default=60.0, help="share of the bound, %%")
    parser.add_argument("--out", help="write the budget as JSON here")
    args = parser.parse_args()
    run, profile = read_first(args.run), read_first(args.profile)
    b = budget(run, profile, args.target)
    # where the figures come from: each input's own commit, device and versions
    b["inputs"] = {"run": args.run, "run_git_commit": run.get("git_commit"),
                   "run_device": run.get("device"), "profile": args.profile,
                   "profile_environment": profile.get("environment")}
    print(describe(b))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(b, f, indent=1)


if __name__ == "__main__":
    main()
