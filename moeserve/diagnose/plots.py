"""The report's PNG plots (matplotlib, Agg backend: no display needed).

    throughput_vs_concurrency(series, path)   output tok/s and median/p99 TPOT against
                                              concurrency, one line per input file
    timeline(run, path)                       engine batch (running, waiting, the cap), KV use
                                              and preemptions, GPU power (with its limit) over
                                              the run's time
    expert_histogram(summary, path)           tokens per expert per step over every (layer,
                                              expert), with the mean and the doctor's threshold
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from moeserve.diagnose import figures
from moeserve.diagnose.doctor import MIN_TOKENS_PER_EXPERT
from moeserve.diagnose.expert_load import ExpertLoadSummary


def _plt() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise ValueError("moeserve report needs matplotlib for its plots "
                         "(pip install matplotlib)") from None
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _concurrency(run: dict[str, Any]) -> float:
    conc = run.get("max_concurrency")
    return float(conc) if isinstance(conc, int) else float(run.get("concurrency") or 0.0)


def throughput_vs_concurrency(series: dict[str, list[dict[str, Any]]], path: Path) -> None:
    """One line per series (an input file), points sorted by concurrency."""
    plt = _plt()
    fig, (ax_tp, ax_tpot) = plt.subplots(1, 2, figsize=(11, 4.2))
    xs_all: list[float] = []
    for name, runs in series.items():
        runs = sorted(runs, key=_concurrency)
        xs = [_concurrency(r) for r in runs]
        xs_all += xs
        line = ax_tp.plot(xs, [r.get("output_throughput", 0.0) for r in runs], "o-",
                          label=name)[0]
        ax_tpot.plot(xs, [r.get("median_tpot_ms", 0.0) for r in runs], "o-",
                     color=line.get_color(), label=f"{name} median")
        ax_tpot.plot(xs, [r.get("p99_tpot_ms", 0.0) for r in runs], "x--",
                     color=line.get_color(), label=f"{name} p99")
    positive = sorted({x for x in xs_all if x > 0})
    for ax in (ax_tp, ax_tpot):
        if positive and positive[-1] / positive[0] >= 4:
            ax.set_xscale("log", base=2)
        if 0 < len(positive) <= 12:  # label the concurrencies run, as numbers
            ax.set_xticks(positive, [f"{x:g}" for x in positive])
            ax.minorticks_off()
        ax.set_xlabel("max concurrency")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ax_tp.set_ylabel("output throughput (tok/s)")
    ax_tp.set_ylim(bottom=0)
    ax_tpot.set_ylabel("TPOT (ms)")
    ax_tpot.set_ylim(bottom=0)
    fig.suptitle("Output throughput and TPOT against concurrency")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def timeline(run: dict[str, Any], path: Path, title: str) -> None:
    """Batch size and GPU power over the run (the whole sampled span, the run shaded)."""
    plt = _plt()
    fig, (ax_b, ax_p) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    t, running = figures.engine_series(run, "num_running", in_run=False)
    _, waiting = figures.engine_series(run, "num_waiting", in_run=False)
    if t:
        ax_b.step(t, [r or 0 for r in running], where="post", label="running (batch)")
        ax_b.step(t, [w or 0 for w in waiting], where="post", label="waiting")
    cap = figures.max_running_cap(run)
    top = max([r or 0 for r in running] + [w or 0 for w in waiting] + [1])
    if cap is not None and cap <= 3 * top:  # else the cap would flatten the batch to nothing
        ax_b.axhline(cap, color="red", ls="--", lw=1, label=f"max_running_requests {cap}")
    elif cap is not None:
        ax_b.set_title(f"max_running_requests {cap} is off the scale", fontsize=9)
    ax_b.set_ylabel("requests")
    ax_b.legend(fontsize=8, loc="upper left")
    _kv_and_preemptions(run, ax_b)
    gpu = figures.diagnostics(run).get("gpu") or {}
    gt = gpu.get("t") or []
    busy = {g.index for g in figures.busy_gpus(figures.gpu_figures(run))}
    for dev in gpu.get("devices") or []:
        if dev.get("index") not in busy:
            continue
        power = dev.get("power_w") or []
        line = ax_p.plot(gt, [p if p is not None else float("nan") for p in power],
                         label=f"GPU {dev.get('index')} power")[0]
        if dev.get("power_limit_w"):
            ax_p.axhline(dev["power_limit_w"], color=line.get_color(), ls="--", lw=1,
                         label=f"GPU {dev.get('index')} limit {dev['power_limit_w']:.0f} W")
    if not gt:
        reason = gpu.get("reason") or "no diagnostics in this run"
        ax_p.text(0.5, 0.5, f"no GPU samples: {reason}", ha="center", va="center",
                  transform=ax_p.transAxes, fontsize=9, wrap=True)
    else:
        ax_p.legend(fontsize=8, loc="upper right")
        ax_p.set_ylim(bottom=0)
    ax_p.set_ylabel("power (W)")
    ax_p.set_xlabel("seconds from the start of the timed run")
    duration = run.get("duration")
    for ax in (ax_b, ax_p):
        if duration:
            ax.axvspan(0, duration, color="grey", alpha=0.08)
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _kv_and_preemptions(run: dict[str, Any], ax_b: Any) -> None:
    """KV use (%) on a second axis of the batch panel; preemptions in its title."""
    t, usage = figures.engine_series(run, "kv_usage", in_run=False)
    if t:
        ax_kv = ax_b.twinx()
        ax_kv.plot(t, [100 * u if u is not None else float("nan") for u in usage], ":",
                   color="tab:green", label="KV use (%)")
        ax_kv.set_ylim(0, 105)
        ax_kv.set_ylabel("KV use (%)")
        ax_kv.legend(fontsize=8, loc="upper right")
    _, pre = figures.engine_series(run, "num_preemptions", in_run=False)
    pre_vals = [p for p in pre if p is not None]
    if len(pre_vals) >= 2 and pre_vals[-1] > pre_vals[0]:
        ax_b.set_title(f"{pre_vals[-1] - pre_vals[0]:g} preemptions during the run", fontsize=9)


def expert_histogram(summary: ExpertLoadSummary, path: Path, title: str) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.hist(summary.per_expert_per_step, bins=min(50, max(10, summary.num_experts // 2)),
            color="tab:blue", alpha=0.8)
    ax.axvline(summary.mean_tokens_per_expert_per_step, color="black", lw=1.5,
               label=f"mean {summary.mean_tokens_per_expert_per_step:.1f}")
    ax.axvline(MIN_TOKENS_PER_EXPERT, color="red", ls="--", lw=1,
               label=f"doctor's threshold {MIN_TOKENS_PER_EXPERT:.0f}")
    ax.set_xlabel("tokens per expert per step (every layer and expert)")
    ax.set_ylabel("experts")
    ax.set_title(f"{title}: {summary.num_layers} MoE layers x {summary.num_experts} experts, "
                 f"{summary.num_steps} steps; imbalance {summary.mean_imbalance:.2f}",
                 fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
