"""The tuner of the fused-MoE tile configs (the files `moe_configs.py` reads).

`moe_triton` runs two launches that share BLOCK_M (the align's block size) but may each take
their own other tiles (a config's "down" entry). So `tune_moe` searches per token count and per
candidate BLOCK_M (the candidates grouped by BLOCK_M): it times the align once, then the gated
launch under every candidate tile (from ONE_DOT_MIN_PER_EXPERT pairs per expert each also with
the launch option ONE_DOT), then the down launch under every candidate tile, each apart; a
second round times each launch's best tile with the other GROUP_M, with SUB_M and, from
PERSISTENT_MIN_PER_EXPERT, with PERSISTENT 1 and 2 (all in `moe_search`: the search space). It
combines the best gated and the best down pick (`best_split`), and the BLOCK_M with the least
align + gated + down wins. That winner is then timed whole (`moe_triton`: align, both launches,
the combine), which is the entry's "ms", compared with torch._grouped_mm's time at that token
count (the entry's "backend"). Every timing uses the same timer (`moe_timer`: calls captured
in one CUDA graph, a few replays). With n tiles per BLOCK_M that is 3n launch timings (+2-6 in
the second round; each tile compiles once per launch and option), not the n^2 of timing
every gated/down pair.

The ledger (the file's "trials") holds each timing under "<part>:<key>" (`trial_key`: parts
align, gated, down, moe); the file is written after each one (atomically), and a rerun skips
what the ledger already holds, so a killed tune resumes where it stopped. (Plain candidate keys
in "trials", whole-op times of an older tuner, are left there and not reused: such a token
count is timed again by parts.) A part that fails to compile or run is recorded as an error and
skipped. With a time budget it stops before the next timing once the budget is spent, and a
later run picks up from there. The entry keeps the top-level tiles of the best gated launch and
adds "down" only when the best down tiles differ.

`tune_for_engine` tunes the batch sizes an engine runs (`engine_token_counts`: powers of two up
to its max batched tokens) over the quick grid (`quick_moe_candidates`: <= 6 tiles for each of
the BLOCK_M values from tokens-per-expert / 2 up, the same lists at every token count so that
each variant compiles once per tune); `ensure_tuned` is the start-up entry: it returns at once
when a tuned file covers the shape and otherwise tunes into the user cache within a time budget.
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

import torch

from moeserve.kernels.moe import tile_configs as moe_configs
from moeserve.kernels.moe.search import (
    NO_OPTIONS,
    SearchOptions,
    best_split,
    moe_tune_candidates,
    part_candidates,
    plan_keys,
    quick_moe_candidates,
    refine_candidates,
    search_options,
    tiles_by_block_m,
    trial_key,
)
from moeserve.kernels.moe.tile_configs import (
    MAX_TUNE_TOKENS,
    clear_caches,
    config_file_name,
    config_key,
    engine_token_counts,
    find_tuned,
    parse_entry,
    triton_version,
    tune_dir,
)
from moeserve.kernels.moe.timer import PARTS, CudaPartTimer

DEFAULT_TUNE_BUDGET_S = 240.0  # ensure_tuned's default time budget

# What one timing measures (the first argument of a Timer):
#   "align": moe_align_block_size_triton at config["BLOCK_M"] (config holds only BLOCK_M)
#   "gated": launch 1 (x @ w13, SiLU-mul) alone with config's top-level tiles
#   "down":  launch 2 (act @ w2, weighted) alone with config's top-level tiles
#   "moe":   the whole moe_triton with config (its "down" tiles, if any, for launch 2)
# (PARTS, from moe_timer, names them.)
Timer = Callable[[str, dict, int], float]  # (part, config, num_tokens) -> ms; raises on failure
BaselineTimer = Callable[[int], float]  # num_tokens -> ms of torch._grouped_mm; may raise


class TuneOutcome(NamedTuple):
    """What `ensure_tuned` did: for the capacity report."""

    seconds: float  # spent tuning now (0 when a tuned file was there)
    tuned: bool  # a tuned file now serves this shape (perhaps partly: see detail)
    source: str  # its path, or "default" (in-code tiles, Triton everywhere)
    detail: str  # one line: committed / cached / tuned now (N of M token counts) / why not


def tune_moe(num_experts: int, hidden: int, inter: int, top_k: int, dtype: torch.dtype,
             token_counts: Sequence[int], out_path: str | Path, *,
             candidates: Callable[[int], list[dict[str, int]]] | None = None,
             timer: Timer | None = None, baseline_timer: BaselineTimer | None = None,
             device_name: str | None = None, time_budget_s: float | None = None,
             weights: tuple[torch.Tensor, torch.Tensor] | None = None,
             log: Callable[[str], None] = print) -> dict[int, dict]:
    """Tune the tiles at each token count (see the module docstring), and time grouped_mm;
    write the JSON after every timing; resumable; stops once `time_budget_s` is spent (a rerun
    continues).

    `candidates(num_tokens)` gives tile configs (CONFIG_KEYS; a "down" in them is ignored):
    grouped by BLOCK_M, each one is tried for the gated launch and for the down launch. The
    default timer builds random inputs on the current CUDA device (or uses `weights`, (w13,
    w2), e.g. the model's own) and times each part, and `moe_grouped_mm`, with `time_in_graph`.
    `timer` (part, config, num_tokens) -> ms and `baseline_timer` are the seams for tests; with
    a custom `timer` and no `baseline_timer`, grouped_mm is not measured and every entry picks
    "triton".
    Returns {num_tokens: entry} for the finished token counts of the file (CONFIG_KEYS, "down"
    when the launches' best tiles differ, "ms", "backend", "grouped_mm_ms" when measured).
    """
    if timer is None:
        if not torch.cuda.is_available():
            raise RuntimeError("tune_moe times kernels on a CUDA GPU; none is available")
        cuda_timer = CudaPartTimer(num_experts, hidden, inter, top_k, dtype, weights)
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

    def run(part: str, config: dict, num_tokens: int, trials: dict) -> bool:
        """Time one part into the ledger (an error is recorded, not raised); False, timing
        nothing, once the budget is spent."""
        if deadline is not None and time.perf_counter() >= deadline:
            log(f"tune_moe: time budget of {time_budget_s:.0f} s spent at T={num_tokens}; "
                "rerun to resume")
            return False
        key = trial_key(part, config)
        t_one = time.perf_counter()
        try:
            trials[key] = float(timer(part, config, num_tokens))
        except Exception as exc:  # compile failure, out of shared memory, bad launch...
            trials[key] = f"error: {type(exc).__name__}: {str(exc)[:200]}"
            log(f"tune_moe T={num_tokens} {key}: skipped ({trials[key]})")
        cost.record(key, time.perf_counter() - t_one)
        write_json_atomic(out_path, doc)
        return True

    for num_tokens in token_counts:
        trials = doc["trials"].setdefault(str(num_tokens), {})
        grid = tiles_by_block_m(get_candidates(num_tokens))
        options = search_options(num_experts, top_k, num_tokens)
        todo = [k for k in plan_keys(grid, options, trials) if k not in trials]
        if todo:
            log(f"tune_moe T={num_tokens}: {len(todo)} timings to run over BLOCK_M "
                f"{list(grid)}, estimated {cost.estimate(todo):.1f} s")
        t_tokens = time.perf_counter()
        for block_m, tiles in grid.items():
            align_key = trial_key("align", {"BLOCK_M": block_m})
            if align_key not in trials and not run("align", {"BLOCK_M": block_m}, num_tokens,
                                                   trials):
                clear_caches()
                return _finished(doc)
            if not isinstance(trials[align_key], float):
                continue  # no align at this BLOCK_M: its launches cannot run either
            for part in ("gated", "down"):
                for second_round in (False, True):  # the second's tiles follow the first's
                    configs = (refine_candidates(part, tiles, trials, options)
                               if second_round else part_candidates(part, tiles, options))
                    for config in configs:
                        if trial_key(part, config) not in trials and not run(
                                part, config, num_tokens, trials):
                            clear_caches()
                            return _finished(doc)
        pick = best_split(grid, trials, options)
        if pick is None:
            raise RuntimeError(f"tune_moe: every candidate failed at {num_tokens} tokens")
        config, parts_ms = pick
        whole_key = trial_key("moe", config)
        if whole_key not in trials and not run("moe", config, num_tokens, trials):
            clear_caches()
            return _finished(doc)
        whole = trials[whole_key]
        ms = whole if isinstance(whole, float) else parts_ms
        if not isinstance(whole, float):  # each part ran alone: unlikely, but say so
            log(f"tune_moe T={num_tokens}: the whole op failed with {config_key(config)}; its "
                "ms is the sum of its parts (align, gated, down; no combine)")
        baseline = doc["grouped_mm"].get(str(num_tokens))
        if baseline is None and baseline_timer is not None:
            try:
                baseline = float(baseline_timer(num_tokens))
            except Exception as exc:  # unsupported dtype / shape, a sync in the capture...
                baseline = f"error: {type(exc).__name__}: {str(exc)[:200]}"
            doc["grouped_mm"][str(num_tokens)] = baseline
        entry = {**config, "ms": ms, "backend": "triton"}
        if isinstance(baseline, float):
            entry["grouped_mm_ms"] = baseline
            if baseline < ms:
                entry["backend"] = "grouped_mm"
        doc["configs"][str(num_tokens)] = entry
        write_json_atomic(out_path, doc)
        timed = [k for k, v in trials.items() if _is_part_key(k) and isinstance(v, float)]
        failed = [k for k, v in trials.items() if _is_part_key(k) and not isinstance(v, float)]
        log(f"tune_moe T={num_tokens}: best {config_key(config)} {ms:.4f} ms (parts "
            f"{parts_ms:.4f} ms), grouped_mm "
            f"{baseline if not isinstance(baseline, float) else f'{baseline:.4f} ms'} -> "
            f"{entry['backend']} ({len(timed)} timed, {len(failed)} failed; "
            f"{time.perf_counter() - t_tokens:.1f} s, {time.perf_counter() - start:.1f} s in all)")
    clear_caches()
    return _finished(doc)


def _is_part_key(key: str) -> bool:
    return key.split(":", 1)[0] in PARTS


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
            return TuneOutcome(time.perf_counter() - start, True, path,
                               moe_configs.committed_detail(path, device_name))
        if not missing:
            return TuneOutcome(time.perf_counter() - start, True, path, "tuned earlier (cached)")
        out_path = Path(path)  # a partial tune (a budget ran out): resume it
    else:
        out_path = tune_dir() / config_file_name(num_experts, hidden, inter, dtype, device_name)
    estimate = estimate_tune_seconds([quick_moe_candidates(num_experts, top_k, n) for n in wanted],
                                     [search_options(num_experts, top_k, n) for n in wanted])
    log(f"MoE tiles: no complete tune for E={num_experts} H={hidden} I={inter} {dtype} on "
        f"{device_name}; tuning {len(wanted)} token counts into {out_path} "
        f"(estimated ~{estimate:.0f} s from scratch, budget {time_budget_s:.0f} s)")
    done = tune_for_engine(num_experts, hidden, inter, top_k, dtype, out_path,
                           token_counts=wanted, time_budget_s=time_budget_s, timer=timer,
                           baseline_timer=baseline_timer, device_name=device_name,
                           weights=weights, log=log)
    return tune_outcome(start, done, wanted, out_path)


def tune_outcome(start: float, done: dict, wanted: Sequence[int], out_path: Path
                 ) -> TuneOutcome:
    """What a start-up tune begun at perf_counter `start` did: the token counts of `wanted`
    that `done` (the tuned table) now covers, the file, the seconds."""
    seconds = time.perf_counter() - start
    covered = sum(n in done for n in wanted)
    detail = f"tuned now: {covered} of {len(wanted)} token counts in {seconds:.0f} s"
    if covered < len(wanted):
        detail += " (time budget spent; the next start resumes)"
    return TuneOutcome(seconds, bool(done), str(out_path) if done else "default", detail)


def estimate_tune_seconds(candidates: Sequence[Sequence[dict[str, int]]],
                          options: Sequence[SearchOptions] | None = None) -> float:
    """A prior for a whole tune (candidate lists per token count), before anything is timed:
    per token count an align per BLOCK_M, each tile for each launch and one whole-op timing;
    each distinct (part, tiles) compiles once, every timing costs a capture and a few replays."""
    per_count = options or [NO_OPTIONS] * len(candidates)
    keys = [k for cs, o in zip(candidates, per_count) for k in plan_keys(tiles_by_block_m(cs), o)]
    distinct = len(set(keys))
    seen = len(keys) - distinct + len(candidates)  # + the whole-op timings (compiled by then)
    return distinct * _CostModel.PRIOR_NEW_S + seen * _CostModel.PRIOR_SEEN_S


def _finished(doc: dict) -> dict[int, dict]:
    return {int(n): parse_entry(cfg) for n, cfg in doc["configs"].items()}


def _load_ledger(path: Path, meta: dict) -> dict:
    return load_ledger(path, meta, ("device_name", "dtype", "E", "H", "I", "top_k", "triton"),
                       ("configs", "trials", "grouped_mm"))


def load_ledger(path: Path, meta: dict, same: tuple[str, ...],
                sections: tuple[str, ...]) -> dict:
    """A tune's ledger file (new when absent), refused when its meta differs from `meta` in
    any of `same` (a tune of another shape or device); `sections` exist, empty if new."""
    if not path.exists():
        return {"meta": meta, **{k: {} for k in sections}}
    with open(path) as f:
        doc = json.load(f)
    theirs = {k: doc.get("meta", {}).get(k) for k in same}
    if theirs != {k: meta[k] for k in same}:
        raise ValueError(f"{path} holds a tune of {theirs}, not {dict((k, meta[k]) for k in same)};"
                         " pick another out_path")
    for k in sections:
        doc.setdefault(k, {})
    return doc


def write_json_atomic(path: Path, doc: dict) -> None:
    """Write doc as JSON to path through a temporary file and os.replace: a kill leaves the old
    file or the new one, never half of one (the ledgers are written after every timing)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


class _CostModel:
    """Seconds per timing seen so far, split into first-time kernels (compiled then) and parts
    whose kernel an earlier token count compiled (same ledger key): the tuner's estimate for the
    next ones. A whole-op timing ("moe:") reuses compiled kernels: it counts as seen."""

    PRIOR_NEW_S, PRIOR_SEEN_S = 0.75, 0.15  # one kernel compiled, then a capture and replays

    def __init__(self) -> None:
        self.seen: set[str] = set()
        self.new_s: list[float] = []
        self.seen_s: list[float] = []

    def record(self, key: str, seconds: float) -> None:
        (self.new_s if self._new(key) else self.seen_s).append(seconds)
        self.seen.add(key)

    def estimate(self, keys: list[str]) -> float:
        new = sum(map(self._new, keys))
        per_new = statistics.fmean(self.new_s) if self.new_s else self.PRIOR_NEW_S
        per_seen = statistics.fmean(self.seen_s[-8:]) if self.seen_s else self.PRIOR_SEEN_S
        return new * per_new + (len(keys) - new) * per_seen

    def _new(self, key: str) -> bool:
        return key not in self.seen and not key.startswith("moe:")
