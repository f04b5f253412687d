"""The tuner of the fused-MoE tile configs (the files `moe_configs.py` reads).

`tune_moe` times every candidate at every token count, and torch._grouped_mm once per token
count, with the same timer (`time_in_graph`: calls captured in one CUDA graph, a few replays);
it writes the file after each one (atomically), and on a rerun skips what the ledgers already
hold, so a killed tune resumes where it stopped. A candidate that fails to compile or run is
recorded as an error and skipped. With a time budget it stops before the next candidate once
the budget is spent, and a later run picks up from there.

`tune_for_engine` tunes the batch sizes an engine runs (`engine_token_counts`: powers of two up
to its max batched tokens) over the quick grid (`quick_moe_candidates`, <= 12 per token count);
`ensure_tuned` is the start-up entry: it returns at once when a tuned file covers the shape and
otherwise tunes into the user cache within a time budget.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

import torch

from moeserve.kernels import moe_configs
from moeserve.kernels.moe_configs import (
    CONFIG_KEYS,
    MAX_TUNE_TOKENS,
    clear_caches,
    config_file_name,
    engine_token_counts,
    find_tuned,
    parse_entry,
    tile_config,
    triton_version,
    tune_dir,
)

DEFAULT_TUNE_BUDGET_S = 240.0  # ensure_tuned's default time budget

Timer = Callable[[dict, int], float]  # (config, num_tokens) -> ms; raises if the config fails
BaselineTimer = Callable[[int], float]  # num_tokens -> ms of torch._grouped_mm; may raise


class TuneOutcome(NamedTuple):
    """What `ensure_tuned` did: for the capacity report."""

    seconds: float  # spent tuning now (0 when a tuned file was there)
    tuned: bool  # a tuned file now serves this shape (perhaps partly: see detail)
    source: str  # its path, or "default" (in-code tiles, Triton everywhere)
    detail: str  # one line: committed / cached / tuned now (N of M token counts) / why not


def moe_tune_candidates(num_experts: int, top_k: int, num_tokens: int) -> list[dict[str, int]]:
    """The search grid at one token count (~50-150 configs): BLOCK_M limited by tokens/expert."""
    per_expert = num_tokens * top_k / max(num_experts, 1)
    block_ms = [m for m in (16, 32, 64, 128) if m <= max(16, 2 * per_expert)
                and m >= min(64, per_expert / 4)]
    grid = []
    for block_m, block_n, block_k, warps, stages in itertools.product(
            block_ms, (64, 128), (64, 128), (4, 8), (3, 4, 5)):
        group_ms = (1, 8) if per_expert > block_m else (1,)
        grid += [tile_config(block_m, block_n, block_k, g, warps, stages) for g in group_ms]
    return grid


# Quick grid: per BLOCK_M a fixed list (best guesses first), shared by every token count so that
# each config compiles once per tune. (BLOCK_N, BLOCK_K, num_warps, num_stages); GROUP_M is 1 at
# BLOCK_M 16 (about one block per expert) and 8 above. Shared memory per stage of the gated
# launch is (BLOCK_M + 2 * BLOCK_N) * BLOCK_K * 2 bytes: every entry fits the H100/H200's 227 KB.
_QUICK = {
    16: [(64, 128, 4, 4), (32, 128, 4, 4), (128, 128, 4, 3), (64, 256, 4, 3), (128, 64, 4, 4),
         (32, 256, 4, 3), (64, 64, 4, 5), (64, 128, 4, 3), (128, 128, 8, 3), (32, 64, 4, 5)],
    32: [(64, 128, 4, 4), (64, 64, 4, 5), (128, 64, 4, 4), (128, 128, 4, 3), (64, 128, 4, 3),
         (128, 64, 8, 4)],
    64: [(128, 64, 8, 4), (64, 64, 4, 4), (128, 64, 4, 4), (128, 128, 8, 2), (64, 128, 4, 3),
         (128, 64, 8, 3)],
    128: [(128, 64, 8, 3), (128, 64, 8, 4), (64, 64, 4, 4), (64, 128, 8, 3), (128, 128, 8, 2),
          (64, 64, 8, 5)],
}
QUICK_PER_BLOCK_M = 6  # configs per BLOCK_M when two BLOCK_M values are tried


def quick_moe_candidates(num_experts: int, top_k: int, num_tokens: int) -> list[dict[str, int]]:
    """The quick grid at one token count: <= 12 configs over the one or two BLOCK_M values that
    fit the tokens per expert (16 alone while <= 8 reach an expert)."""
    per_expert = num_tokens * top_k / max(num_experts, 1)
    fitting = [m for m in _QUICK if m <= max(16, 2 * per_expert)]
    block_ms = fitting[-2:]
    per_block_m = QUICK_PER_BLOCK_M if len(block_ms) > 1 else len(_QUICK[block_ms[0]])
    return [tile_config(m, n, k, 1 if m == 16 else 8, warps, stages)
            for m in block_ms for n, k, warps, stages in _QUICK[m][:per_block_m]]


def candidate_key(config: dict[str, int]) -> str:
    """M16_N64_K128_G1_w4_s4: the ledger key of a config."""
    return "M{BLOCK_M}_N{BLOCK_N}_K{BLOCK_K}_G{GROUP_M}_w{num_warps}_s{num_stages}".format(**config)


def tune_moe(num_experts: int, hidden: int, inter: int, top_k: int, dtype: torch.dtype,
             token_counts: Sequence[int], out_path: str | Path, *,
             candidates: Callable[[int], list[dict[str, int]]] | None = None,
             timer: Timer | None = None, baseline_timer: BaselineTimer | None = None,
             device_name: str | None = None, time_budget_s: float | None = None,
             weights: tuple[torch.Tensor, torch.Tensor] | None = None,
             log: Callable[[str], None] = print) -> dict[int, dict]:
    """Time the candidates, and grouped_mm, at each token count; write the JSON after every
    one; resumable; stops once `time_budget_s` is spent (a rerun continues).

    The default timer builds random inputs on the current CUDA device (or uses `weights`,
    (w13, w2), e.g. the model's own) and times `moe_triton` (alignment, both GEMMs, combine)
    and `moe_grouped_mm` on the same inputs with `time_in_graph`. `timer` and `baseline_timer`
    are the seams for tests; with a custom `timer` and no `baseline_timer`, grouped_mm is not
    measured and every entry picks "triton".
    Returns {num_tokens: entry} for the finished token counts of the file (CONFIG_KEYS, "ms",
    "backend", "grouped_mm_ms" when measured).
    """
    if timer is None:
        if not torch.cuda.is_available():
            raise RuntimeError("tune_moe times kernels on a CUDA GPU; none is available")
        cuda_timer = _CudaTimer(num_experts, hidden, inter, top_k, dtype, weights)
        timer = cuda_timer
        baseline_timer = baseline_timer or cuda_timer.grouped_mm
        device_name = device_name or torch.cuda.get_device_name()
    meta = {"device_name": device_name or "unknown", "dtype": str(dtype).removeprefix("torch."),
            "E": num_experts, "H": hidden, "I": inter, "top_k": top_k,
            "triton": triton_version(), "torch": torch.__version__}
    out_path = Path(out_path)
    doc = _load_ledger(out_path, meta)
    get_candidates = candidates or functools.partial(moe_tune_candidates, num_experts, top_k)
    start = time.perf_counter()
    deadline = None if time_budget_s is None else start + time_budget_s
    cost = _CostModel()
    for num_tokens in token_counts:
        trials = doc["trials"].setdefault(str(num_tokens), {})
        todo = [c for c in get_candidates(num_tokens) if candidate_key(c) not in trials]
        if todo:
            log(f"tune_moe T={num_tokens}: {len(todo)} candidates to time, "
                f"estimated {cost.estimate(todo):.1f} s")
        t_tokens = time.perf_counter()
        for config in todo:
            if deadline is not None and time.perf_counter() >= deadline:
                log(f"tune_moe: time budget of {time_budget_s:.0f} s spent at T={num_tokens}; "
                    "rerun to resume")
                clear_caches()
                return _finished(doc)
            key = candidate_key(config)
            t_one = time.perf_counter()
            try:
                trials[key] = float(timer(config, num_tokens))
            except Exception as exc:  # compile failure, out of shared memory, bad launch...
                trials[key] = f"error: {type(exc).__name__}: {str(exc)[:200]}"
                log(f"tune_moe T={num_tokens} {key}: skipped ({trials[key]})")
            cost.record(config, time.perf_counter() - t_one)
            _write_atomic(out_path, doc)
        baseline = doc["grouped_mm"].get(str(num_tokens))
        if baseline is None and baseline_timer is not None:
            try:
                baseline = float(baseline_timer(num_tokens))
            except Exception as exc:  # unsupported dtype / shape, a sync in the capture...
                baseline = f"error: {type(exc).__name__}: {str(exc)[:200]}"
            doc["grouped_mm"][str(num_tokens)] = baseline
        timed = {k: v for k, v in trials.items() if isinstance(v, float)}
        if not timed:
            raise RuntimeError(f"tune_moe: every candidate failed at {num_tokens} tokens")
        best = min(timed, key=timed.__getitem__)
        entry = {**_parse_key(best), "ms": timed[best], "backend": "triton"}
        if isinstance(baseline, float):
            entry["grouped_mm_ms"] = baseline
            if baseline < timed[best]:
                entry["backend"] = "grouped_mm"
        doc["configs"][str(num_tokens)] = entry
        _write_atomic(out_path, doc)
        log(f"tune_moe T={num_tokens}: best {best} {timed[best]:.4f} ms, grouped_mm "
            f"{baseline if not isinstance(baseline, float) else f'{baseline:.4f} ms'} -> "
            f"{entry['backend']} ({len(timed)} timed, {len(trials) - len(timed)} failed; "
            f"{time.perf_counter() - t_tokens:.1f} s, {time.perf_counter() - start:.1f} s in all)")
    clear_caches()
    return _finished(doc)


def tune_for_engine(num_experts: int, hidden: int, inter: int, top_k: int, dtype: torch.dtype,
                    out_path: str | Path, *, max_num_batched_tokens: int = MAX_TUNE_TOKENS,
                    token_counts: Sequence[int] | None = None,
                    time_budget_s: float | None = DEFAULT_TUNE_BUDGET_S, full_grid: bool = False,
                    **kwargs) -> dict[int, dict]:
    """`tune_moe` over the engine's batch sizes (`engine_token_counts`) and the quick grid (or
    the full one), within `time_budget_s`. kwargs go to tune_moe (timer, baseline_timer,
    device_name, weights, log)."""
    counts = list(token_counts or engine_token_counts(max_num_batched_tokens))
    grid = moe_tune_candidates if full_grid else quick_moe_candidates
    return tune_moe(num_experts, hidden, inter, top_k, dtype, counts, out_path,
                    candidates=functools.partial(grid, num_experts, top_k),
                    time_budget_s=time_budget_s, **kwargs)


def ensure_tuned(num_experts: int, hidden: int, inter: int, top_k: int, dtype: torch.dtype,
                 max_num_batched_tokens: int, *,
                 time_budget_s: float = DEFAULT_TUNE_BUDGET_S,
                 weights: tuple[torch.Tensor, torch.Tensor] | None = None,
                 device_name: str | None = None, timer: Timer | None = None,
                 baseline_timer: BaselineTimer | None = None,
                 log: Callable[[str], None] = print) -> TuneOutcome:
    """Start-up: make sure this shape has tuned tiles and backend picks on this device.

    Returns at once (no GPU work) when a committed file (the package's configs/moe/) serves the
    shape, or another found file holds every token count of `engine_token_counts`. Otherwise
    tunes (quick grid, resuming a partial tune) into `tune_dir()` within `time_budget_s`.
    Without CUDA (and no `timer`) it tunes nothing: default tiles, Triton everywhere.
    """
    start = time.perf_counter()
    if timer is None and not torch.cuda.is_available():
        return TuneOutcome(0.0, False, "default", "no CUDA device to tune on: default tiles")
    device_name = device_name or torch.cuda.get_device_name()
    wanted = engine_token_counts(max_num_batched_tokens)
    found = find_tuned(num_experts, hidden, inter, dtype, device_name)
    if found is not None:
        path, table = found
        missing = [n for n in wanted if n not in table]
        if Path(path).parent == moe_configs.PACKAGE_CONFIG_DIR:
            return TuneOutcome(time.perf_counter() - start, True, path, "committed")
        if not missing:
            return TuneOutcome(time.perf_counter() - start, True, path, "tuned earlier (cached)")
        out_path = Path(path)  # a partial tune (a budget ran out): resume it
    else:
        out_path = tune_dir() / config_file_name(num_experts, hidden, inter, dtype, device_name)
    estimate = estimate_tune_seconds([quick_moe_candidates(num_experts, top_k, n) for n in wanted])
    log(f"MoE tiles: no complete tune for E={num_experts} H={hidden} I={inter} {dtype} on "
        f"{device_name}; tuning {len(wanted)} token counts into {out_path} "
        f"(estimated ~{estimate:.0f} s from scratch, budget {time_budget_s:.0f} s)")
    done = tune_for_engine(num_experts, hidden, inter, top_k, dtype, out_path,
                           token_counts=wanted, time_budget_s=time_budget_s, timer=timer,
                           baseline_timer=baseline_timer, device_name=device_name,
                           weights=weights, log=log)
    seconds = time.perf_counter() - start
    covered = sum(n in done for n in wanted)
    detail = f"tuned now: {covered} of {len(wanted)} token counts in {seconds:.0f} s"
    if covered < len(wanted):
        detail += " (time budget spent; the next start resumes)"
    return TuneOutcome(seconds, bool(done), str(out_path) if done else "default", detail)


def estimate_tune_seconds(candidates: Sequence[Sequence[dict[str, int]]]) -> float:
    """A prior for a whole tune (candidate lists per token count), before anything is timed:
    each distinct config compiles once (two kernels), every candidate then costs a capture and
    a few replays."""
    total = sum(map(len, candidates))
    distinct = len({candidate_key(c) for cs in candidates for c in cs})
    return distinct * _CostModel.PRIOR_NEW_S + (total - distinct) * _CostModel.PRIOR_SEEN_S


def time_in_graph(fn: Callable[[], object], calls: int = 10, replays: int = 10) -> float:
    """Median ms per call of `fn`, `calls` of them captured in one CUDA graph and replayed
    `replays` times (after two eager warm-up calls: compilation happens there)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compile and warm up outside the graph
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    del graph
    return statistics.median(times)


def _parse_key(key: str) -> dict[str, int]:
    values = [int(part[1:]) for part in key.split("_")]
    return dict(zip(CONFIG_KEYS, values))


def _finished(doc: dict) -> dict[int, dict]:
    return {int(n): parse_entry(cfg) for n, cfg in doc["configs"].items()}


def _load_ledger(path: Path, meta: dict) -> dict:
    if not path.exists():
        return {"meta": meta, "configs": {}, "trials": {}, "grouped_mm": {}}
    with open(path) as f:
        doc = json.load(f)
    same = ("device_name", "dtype", "E", "H", "I", "top_k", "triton")
    theirs = {k: doc.get("meta", {}).get(k) for k in same}
    if theirs != {k: meta[k] for k in same}:
        raise ValueError(f"{path} holds a tune of {theirs}, not {dict((k, meta[k]) for k in same)};"
                         " pick another out_path")
    doc.setdefault("configs", {})
    doc.setdefault("trials", {})
    doc.setdefault("grouped_mm", {})
    return doc


def _write_atomic(path: Path, doc: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


class _CostModel:
    """Seconds per candidate seen so far, split into first-time configs (compiled then) and
    configs compiled at an earlier token count: the tuner's estimate for the next one."""

    PRIOR_NEW_S, PRIOR_SEEN_S = 1.5, 0.15

    def __init__(self) -> None:
        self.seen: set[str] = set()
        self.new_s: list[float] = []
        self.seen_s: list[float] = []

    def record(self, config: dict[str, int], seconds: float) -> None:
        key = candidate_key(config)
        (self.seen_s if key in self.seen else self.new_s).append(seconds)
        self.seen.add(key)

    def estimate(self, configs: list[dict[str, int]]) -> float:
        new = sum(candidate_key(c) not in self.seen for c in configs)
        per_new = statistics.fmean(self.new_s) if self.new_s else self.PRIOR_NEW_S
        per_seen = statistics.fmean(self.seen_s[-8:]) if self.seen_s else self.PRIOR_SEEN_S
        return new * per_new + (len(configs) - new) * per_seen


class _CudaTimer:
    """Times moe_triton with one config, and moe_grouped_mm, on the same random inputs per token
    count, with `time_in_graph` (weights built once, or the caller's)."""

    CALLS, REPLAYS = 10, 5

    def __init__(self, num_experts: int, hidden: int, inter: int, top_k: int,
                 dtype: torch.dtype,
                 weights: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        gen = torch.Generator(device="cuda").manual_seed(0)
        if weights is not None:
            self.w13, self.w2 = weights
        else:
            self.w13 = (torch.randn(num_experts, 2 * inter, hidden, device="cuda",
                                    generator=gen) * hidden ** -0.5).to(dtype)
            self.w2 = (torch.randn(num_experts, hidden, inter, device="cuda", generator=gen)
                       * inter ** -0.5).to(dtype)
        self.top_k, self.dtype, self.gen = top_k, dtype, gen
        self._inputs: dict[int, tuple[torch.Tensor, ...]] = {}

    def inputs(self, num_tokens: int) -> tuple[torch.Tensor, ...]:
        """x, topk_weights, topk_ids at num_tokens (dummy routing), kept for one token count."""
        if num_tokens not in self._inputs:
            from moeserve.kernels.routing import select_experts

            self._inputs.clear()
            num_experts, hidden = self.w13.shape[0], self.w13.shape[2]
            x = torch.randn(num_tokens, hidden, device="cuda", generator=self.gen).to(self.dtype)
            logits = torch.randn(num_tokens, num_experts, device="cuda", generator=self.gen)
            self._inputs[num_tokens] = (x, *select_experts(logits, self.top_k, renormalize=True))
        return self._inputs[num_tokens]

    def __call__(self, config: dict, num_tokens: int) -> float:
        from moeserve.kernels.moe_triton import moe_triton

        x, weights, ids = self.inputs(num_tokens)
        return time_in_graph(lambda: moe_triton(x, self.w13, self.w2, weights, ids,
                                                config=config), self.CALLS, self.REPLAYS)

    def grouped_mm(self, num_tokens: int) -> float:
        from moeserve.kernels.moe_grouped_mm import moe_grouped_mm

        x, weights, ids = self.inputs(num_tokens)
        return time_in_graph(lambda: moe_grouped_mm(x, self.w13, self.w2, weights, ids),
                             self.CALLS, self.REPLAYS)
