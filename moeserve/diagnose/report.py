"""`moeserve report RUN.jsonl [RUN.jsonl ...] --out DIR`: markdown with PNG plots.

    load_runs(paths)        every line of every file: Run(label "file:line", series "file", run)
    write_report(runs, out) DIR/report.md and its PNGs (plots.py):
        runs                one row per run: throughput, latency, the verdicts' rules
        throughput_tpot.png output tok/s and TPOT against concurrency, a line per input file
        per run             the doctor's summary and verdicts (recomputed: the rules are pure);
                            timeline_<n>.png (batch and power over time) when it has diagnostics,
                            experts_<n>.png (tokens-per-expert histogram) when it has expert load
        two or more runs    the figures side by side, and the diff of their resolved configs:
                            `resolved_config(run)` = the capacity report's engine_config
                            flattened to dotted keys, plus what "auto" resolved to
                            (resolved.max_running_requests, resolved.kv_tokens, ...);
                            `config_diff` keeps only the keys whose values differ
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moeserve.diagnose import doctor, expert_load, figures, plots

MISSING = "—"
_RESOLVED = ("max_running_requests", "max_running_requests_rule", "kv_tokens", "cuda_graphs",
             "device_name", "weights_gib")
_SIDE_BY_SIDE = (("max concurrency", "max_concurrency", "{}"),
                 ("completed / failed", None, ""),
                 ("duration (s)", "duration", "{:.1f}"),
                 ("output tok/s", "output_throughput", "{:,.0f}"),
                 ("total tok/s", "total_throughput", "{:,.0f}"),
                 ("peak output tok/s", "peak_output_throughput", "{:,.0f}"),
                 ("median TTFT (ms)", "median_ttft_ms", "{:,.1f}"),
                 ("p99 TTFT (ms)", "p99_ttft_ms", "{:,.1f}"),
                 ("median TPOT (ms)", "median_tpot_ms", "{:.2f}"),
                 ("p99 TPOT (ms)", "p99_tpot_ms", "{:.2f}"),
                 ("achieved concurrency", "concurrency", "{:.1f}"))


@dataclass(frozen=True, slots=True)
class Run:
    label: str  # "file:line"
    series: str  # the file's stem: runs of one file form one line in the plots
    data: dict[str, Any]


def load_runs(paths: list[str]) -> list[Run]:
    """Every JSON line of the files. ValueError names a missing file or a bad line."""
    runs: list[Run] = []
    for p in map(Path, paths):
        if not p.is_file():
            raise ValueError(f"{p}: no such file")
        for n, line in enumerate(p.read_text().splitlines(), start=1):
            if not line.strip():
                continue
            try:
                data = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{p}:{n}: not valid JSON ({e.msg})") from None
            if not isinstance(data, dict) or "duration" not in data:
                raise ValueError(f"{p}:{n}: not a bench result (a line of `moeserve bench "
                                 "--output-json` has 'duration')")
            runs.append(Run(f"{p.name}:{n}", p.stem, data))
    if not runs:
        raise ValueError(f"no runs in {', '.join(paths)}")
    return runs


def flatten(doc: Any, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}; lists and scalars are leaves."""
    if not isinstance(doc, dict):
        return {prefix: doc} if prefix else {}
    out: dict[str, Any] = {}
    for k, v in doc.items():
        out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def resolved_config(run: dict[str, Any]) -> dict[str, Any]:
    cfg = flatten(figures.engine_config(run))
    rep = figures.capacity_report(run)
    cfg.update({f"resolved.{k}": rep[k] for k in _RESOLVED if k in rep})
    server = figures.server_settings(run)
    if "api_servers" in server:
        cfg["server.api_servers"] = server["api_servers"]
    return cfg


def config_diff(runs: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """Key -> each run's value (MISSING where absent), for the keys whose values differ."""
    configs = [resolved_config(r) for r in runs]
    keys = sorted({k for c in configs for k in c})
    diff = {}
    for k in keys:
        values = [c.get(k, MISSING) for c in configs]
        if any(v != values[0] for v in values[1:]):
            diff[k] = values
    return diff


def _cell(v: Any) -> str:
    text = "none" if v is None else str(v)
    return text.replace("|", "\\|").replace("\n", " ")


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    out = ["| " + " | ".join(_cell(h) for h in header) + " |",
           "|" + "---|" * len(header)]
    out += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return out + [""]


def _fmt(run: dict[str, Any], key: str | None, fmt: str) -> str:
    if key is None:
        return f"{run.get('completed', 0)} / {run.get('failed', 0)}"
    v = run.get(key)
    if v is None:
        return MISSING
    try:
        return fmt.format(v)
    except (ValueError, TypeError):
        return str(v)


def _run_rows(runs: list[Run], verdicts: list[list[doctor.Verdict]]) -> list[list[Any]]:
    rows = []
    for r, vs in zip(runs, verdicts):
        d = r.data
        rows.append([r.label, d.get("max_concurrency"), _fmt(d, "output_throughput", "{:,.0f}"),
                     _fmt(d, "median_tpot_ms", "{:.2f}"), _fmt(d, "median_ttft_ms", "{:,.1f}"),
                     _fmt(d, None, ""), figures.capacity_report(d).get("model"),
                     d.get("device"), ", ".join(v.rule for v in vs) or "none"])
    return rows


def _run_section(n: int, run: Run, verdicts: list[doctor.Verdict], out: Path) -> list[str]:
    lines = [f"## Run {n}: {run.label}", ""]
    lines += [f"- {line}" for line in doctor.summary_lines(run.data)] + [""]
    lines += ["Verdicts:", ""]
    if not verdicts:
        lines += ["- none: no rule fired", ""]
    for v in verdicts:
        lines += [f"- **{v.rule}** ({v.severity}): {v.message}  ", f"  knob: `{v.knob}`"]
        if v.settings:
            lines[-1] += "  "
            lines.append("  settings: " + ", ".join(f"`{k}={val!r}`"
                                                    for k, val in v.settings.items()))
    lines.append("")
    if figures.diagnostics(run.data):
        name = f"timeline_{n}.png"
        plots.timeline(run.data, out / name, f"Run {n} ({run.label}): batch and power")
        lines += [f"![batch and power over time, run {n}]({name})", ""]
    summary = expert_load.summarize(expert_load.of_run(run.data))
    if summary is not None:
        name = f"experts_{n}.png"
        plots.expert_histogram(summary, out / name, f"Run {n}")
        hot = ", ".join(f"L{layer}/E{e} x{x:.2f}" for layer, e, x in summary.hot_experts)
        lines += [f"![tokens per expert per step, run {n}]({name})", "",
                  f"Hot experts (x their layer's mean): {hot}", ""]
    return lines


def write_report(runs: list[Run], out: str | Path) -> Path:
    """Write DIR/report.md and its plots; returns the markdown's path."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    verdicts = [doctor.diagnose(r.data) for r in runs]
    lines = ["# moeserve report", "",
             f"{len(runs)} run(s) from {', '.join(sorted({r.series for r in runs}))}.", ""]
    lines += ["## Runs", ""]
    lines += _table(["run", "max conc", "output tok/s", "median TPOT ms", "median TTFT ms",
                     "completed / failed", "model", "device", "verdicts"],
                    _run_rows(runs, verdicts))
    series: dict[str, list[dict[str, Any]]] = {}
    for r in runs:
        series.setdefault(r.series, []).append(r.data)
    plots.throughput_vs_concurrency(series, out / "throughput_tpot.png")
    lines += ["## Throughput and TPOT against concurrency", "",
              "![throughput and TPOT against concurrency](throughput_tpot.png)", ""]
    if len(runs) >= 2:
        lines += ["## Side by side", ""]
        rows = [[name] + [_fmt(r.data, key, fmt) for r in runs]
                for name, key, fmt in _SIDE_BY_SIDE]
        lines += _table(["figure"] + [r.label for r in runs], rows)
        diff = config_diff([r.data for r in runs])
        lines += ["## Config diff (resolved; only the keys that differ)", ""]
        if diff:
            lines += _table(["key"] + [r.label for r in runs],
                            [[k] + v for k, v in diff.items()])
        else:
            lines += ["The resolved configs are identical.", ""]
    for n, (r, vs) in enumerate(zip(runs, verdicts), start=1):
        lines += _run_section(n, r, vs, out)
    path = out / "report.md"
    path.write_text("\n".join(lines))
    return path
