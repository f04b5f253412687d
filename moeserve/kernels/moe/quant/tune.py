"""The tuner of the quantized fused MoE's tiles (`quant.fused_triton.moe_quant_triton`; the
files `quant/configs.py` reads): per (device, format, E, H, I, top_k, group, activation dtype)
and token count, the fastest of `configs.quant_tune_candidates` (the in-code default and
<= 23 more, valid for the format's BLOCK_K rule).

Unlike the bf16 tuner (tune.py), which times the two launches apart and joins their best tiles,
each candidate here (a config for both launches, or a gated / down pair of the grid's) is timed
whole: the align,
fp8's activation quantizations, both launches and the combine, by `QuantTimer` with timer.py's
`time_in_graph` (calls captured in one CUDA graph, a few replays) on the model's weights or
random ones quantized by quant/packed.py on the GPU, in the layout the engine holds (4-bit
experts micro-tiled where they fit: micro_tiles.py; the ledger's meta names it).

The ledger is tune.py's: the file's "trials" hold each timing under "moe:<config key>" (an
error when a candidate fails to compile or run, then skipped); the file is written (atomically)
after each timing and a rerun skips what the ledger holds, so a killed tune resumes. With a time
budget it stops before the next timing once the budget is spent (a later run picks up there).
A token count's entry is its fastest candidate (ties: the first, the default first of all),
with "ms" and the default's "default_ms".

`ensure_quant_tuned` is the start-up entry (engine/core.py, for QuantWeight experts): it
returns at once when a committed file, or a found file with every engine token count, serves
the shape, and otherwise tunes (resuming a partial tune) into the user cache within a budget.
`main` (python -m moeserve.kernels.moe.quant.tune) tunes one format and shape on the GPU into a
folder, for a file to commit under configs/.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from moeserve.kernels.moe import tile_configs
from moeserve.kernels.moe.quant import fp8_gluon
from moeserve.kernels.moe.quant.configs import (
    QUANT_OPTIONS,
    check_quant_config,
    find_quant_tuned,
    parse_quant_entry,
    quant_config_file_name,
    quant_tune_candidates,
)
from moeserve.kernels.moe.quant.micro_tiles import fits_shape, is_micro
from moeserve.kernels.moe.search import trial_key
from moeserve.kernels.moe.tile_configs import (
    CONFIG_KEYS,
    clear_caches,
    engine_token_counts,
    triton_version,
    tune_dir,
)
from moeserve.kernels.moe.timer import random_tokens, time_in_graph
from moeserve.kernels.moe.tune import (
    DEFAULT_TUNE_BUDGET_S,
    TuneOutcome,
    load_ledger,
    tune_outcome,
    write_json_atomic,
)

QuantTimerFn = Callable[[dict, int], float]  # (config, num_tokens) -> ms; raises on failure
_SAME = ("device_name", "dtype", "format", "E", "H", "I", "top_k", "group", "triton")


class QuantTimer:
    """Times moe_quant_triton with a config on random tokens per token count (`random_tokens`),
    with `time_in_graph`, on the caller's weights (w13, w2: QuantWeight) or random ones built
    once on CUDA (`random_quant_experts`)."""

    CALLS, REPLAYS = 10, 5

    def __init__(self, fmt: str, num_experts: int, hidden: int, inter: int, top_k: int,
                 group: int, dtype: torch.dtype, weights: tuple[Any, Any] | None = None,
                 micro: bool = False) -> None:
        self.w13, self.w2 = weights or random_quant_experts(
            fmt, num_experts, hidden, inter, group, dtype, torch.device("cuda"), micro)
        self.top_k, self.dtype = top_k, dtype
        self.gen = torch.Generator(device=self.w13.qweight.device).manual_seed(0)
        self._inputs: dict[int, tuple[torch.Tensor, ...]] = {}

    def __call__(self, config: dict, num_tokens: int) -> float:
        from moeserve.kernels.moe.quant.fused_triton import moe_quant_triton

        if num_tokens not in self._inputs:
            self._inputs = {num_tokens: random_tokens(num_tokens, self.w13.shape[2],
                                                      self.w13.shape[0], self.top_k,
                                                      self.dtype, self.gen)}
        x, weights, ids = self._inputs[num_tokens]
        fn = functools.partial(moe_quant_triton, x, self.w13, self.w2, weights, ids,
                               config=config)
        return time_in_graph(fn, self.CALLS, self.REPLAYS)


def random_quant_experts(fmt: str, num_experts: int, hidden: int, inter: int, group: int,
                         dtype: torch.dtype, device: torch.device,
                         micro: bool = False) -> tuple[Any, Any]:
    """(w13 [E, 2I, H], w2 [E, H, I]) as QuantWeights on `device`, quantized (packed.py's rule)
    from random normal weights, one expert at a time (a float copy of one expert at most); fp8
    scales folded to one row per 128 as the engine holds them (`compact_fp8_scales`), so that
    the kernel variant timed is the one served; micro: the packed weights micro-tiled."""
    from moeserve.kernels.moe.quant.micro_tiles import tile_in_place
    from moeserve.quant.packed import QuantWeight, compact_fp8_scales, quantize_into

    gen = torch.Generator(device=device).manual_seed(0)
    made = []
    for n, k in ((2 * inter, hidden), (hidden, inter)):
        w = QuantWeight(fmt, num_experts, n, k, scale_dtype=dtype, device=device,
                        int4_group=group if fmt == "int4" else None)
        for e in range(num_experts):
            dense = torch.randn(n, k, device=device, generator=gen) * k ** -0.5
            quantize_into(w[e], dense)
        compact_fp8_scales(w)  # fp8 only; a no-op for the others
        if micro:
            tile_in_place(w)
        made.append(w)
    return made[0], made[1]


def tune_quant_moe(fmt: str, num_experts: int, hidden: int, inter: int, top_k: int, group: int,
                   dtype: torch.dtype, token_counts: Sequence[int], out_path: str | Path, *,
                   candidates: Callable[[int], list[dict[str, int]]] | None = None,
                   timer: QuantTimerFn | None = None, device_name: str | None = None,
                   time_budget_s: float | None = None, weights: tuple[Any, Any] | None = None,
                   log: Callable[[str], None] = print) -> dict[int, dict]:
    """Time every candidate at each token count (the module docstring) into the ledger at
    `out_path`; resumable; stops once `time_budget_s` is spent (a rerun continues).

    candidates(num_tokens): configs (default `quant_tune_candidates`; each is checked for the
    format, and the first is the one "default_ms" reports). timer(config, num_tokens) -> ms:
    default a `QuantTimer` on CUDA (on `weights` when given, else random experts in the
    engine's layout, micro-tiled where `fits_shape`); the seam for tests.
    Returns {num_tokens: entry} of the file's finished token counts (CONFIG_KEYS, "ms",
    "default_ms").
    """
    micro = _layout(fmt, hidden, inter, weights) == "micro"
    if timer is None:
        if not torch.cuda.is_available():
            raise RuntimeError("tune_quant_moe times kernels on a CUDA GPU; none is available")
        timer = QuantTimer(fmt, num_experts, hidden, inter, top_k, group, dtype, weights, micro)
        device_name = device_name or torch.cuda.get_device_name()
    meta = {"device_name": device_name or "unknown", "dtype": str(dtype).removeprefix("torch."),
            "format": fmt, "E": num_experts, "H": hidden, "I": inter, "top_k": top_k,
            "group": group, "triton": triton_version(), "torch": torch.__version__,
            "weight_layout": "micro" if micro else "rows"}
    out_path = Path(out_path)
    doc = _load_ledger(out_path, meta)
    get_candidates = candidates or functools.partial(quant_tune_candidates, fmt, num_experts,
                                                     top_k, group=group, k_dims=(hidden, inter),
                                                     micro=micro)
    w13 = weights[0] if weights else getattr(timer, "w13", None)  # the experts timed
    if (candidates is None and fmt == "fp8" and w13 is not None
            and fp8_gluon.takes_every_launch(hidden, inter, w13.scale_rows,
                                             w13.qweight.device)):
        # the Gluon kernel reads only the row-block height: one candidate of each it takes
        grid_of = get_candidates

        def get_candidates(num_tokens: int) -> list[dict[str, int]]:
            return fp8_gluon.distinct_candidates(grid_of(num_tokens))
    start = time.perf_counter()
    deadline = None if time_budget_s is None else start + time_budget_s
    try:
        for num_tokens in token_counts:
            grid = get_candidates(num_tokens)
            for config in grid:
                check_quant_config(config, fmt, (group,), "quant tune candidate")
            trials = doc["trials"].setdefault(str(num_tokens), {})
            todo = [c for c in grid if trial_key("moe", c) not in trials]
            if todo:
                log(f"tune_quant_moe {fmt} T={num_tokens}: {len(todo)} of {len(grid)} "
                    "candidates to time")
            for config in todo:
                if deadline is not None and time.perf_counter() >= deadline:
                    log(f"tune_quant_moe: time budget of {time_budget_s:.0f} s spent at "
                        f"T={num_tokens}; rerun to resume")
                    return _finished(doc, fmt, group)
                trials[trial_key("moe", config)] = _time_one(timer, config, num_tokens, log)
                write_json_atomic(out_path, doc)
            entry = _pick(grid, trials)
            if entry is None:
                raise RuntimeError(f"tune_quant_moe: every {fmt} candidate failed at "
                                   f"{num_tokens} tokens")
            doc["configs"][str(num_tokens)] = entry
            write_json_atomic(out_path, doc)
            log(f"tune_quant_moe {fmt} T={num_tokens}: best "
                f"{tile_configs.config_key(entry)} {entry['ms']:.4f} ms (default "
                f"{entry.get('default_ms', float('nan')):.4f} ms; "
                f"{time.perf_counter() - start:.1f} s in all)")
    finally:
        clear_caches()
    return _finished(doc, fmt, group)


def _time_one(timer: QuantTimerFn, config: dict, num_tokens: int,
              log: Callable[[str], None]) -> float | str:
    """ms of one candidate, or the error that skips it (compile failure, out of resources)."""
    try:
        return float(timer(config, num_tokens))
    except Exception as exc:  # noqa: BLE001 - any failure of a candidate skips it
        error = f"error: {type(exc).__name__}: {str(exc)[:200]}"
        log(f"tune_quant_moe T={num_tokens} {tile_configs.config_key(config)}: skipped "
            f"({error})")
        return error


def _pick(grid: Sequence[dict], trials: dict[str, float | str]) -> dict | None:
    """The fastest timed candidate of `grid` as an entry (ties: the first), with "ms" and, when
    the first candidate (the default) was timed, its "default_ms"; None if none was."""
    timed = [(trials[trial_key("moe", c)], i, c) for i, c in enumerate(grid)
             if isinstance(trials.get(trial_key("moe", c)), float)]
    if not timed:
        return None
    ms, _, config = min(timed, key=lambda t: t[:2])
    entry = ({k: config[k] for k in CONFIG_KEYS} | {k: config[k] for k in QUANT_OPTIONS
                                                     if config.get(k)}
             | ({"down": dict(config["down"])} if "down" in config else {}) | {"ms": ms})
    default = trials.get(trial_key("moe", grid[0]))
    if isinstance(default, float):
        entry["default_ms"] = default
    return entry


def _finished(doc: dict, fmt: str, group: int) -> dict[int, dict]:
    return {int(n): parse_quant_entry(e, fmt, group) for n, e in doc["configs"].items()}


def _layout(fmt: str, hidden: int, inter: int, weights: tuple[Any, Any] | None) -> str:
    """The weight layout a tune times: the given weights' own, else the engine's for the shape
    (micro-tiles where they fit)."""
    micro = is_micro(weights[0]) if weights else fits_shape(fmt, hidden, inter)
    return "micro" if micro else "rows"


def _load_ledger(path: Path, meta: dict) -> dict:
    """tune.py's ledger, also refused when it timed the weights in another layout (rows or
    micro-tiles: other times for the same tiles; a ledger from before micro-tiles is rows')."""
    doc = load_ledger(path, meta, _SAME, ("configs", "trials"))
    theirs = doc["meta"].get("weight_layout", "rows")
    if theirs != meta["weight_layout"]:
        raise ValueError(f"{path} holds a tune of the weights in the {theirs} layout, not "
                         f"{meta['weight_layout']}; pick another out_path")
    return doc


def ensure_quant_tuned(fmt: str, num_experts: int, hidden: int, inter: int, top_k: int,
                       group: int, dtype: torch.dtype, max_num_batched_tokens: int, *,
                       time_budget_s: float = DEFAULT_TUNE_BUDGET_S,
                       weights: tuple[Any, Any] | None = None, device_name: str | None = None,
                       timer: QuantTimerFn | None = None,
                       log: Callable[[str], None] = print) -> TuneOutcome:
    """Start-up: make sure this format and shape have tuned tiles on this device.

    The weights' layout (micro-tiled or rows: `weights`' own, else the tuner's rule) picks the
    file. Returns at once (no GPU work) when a committed file (the package's configs/) serves
    it, or another found file holds every token count of `engine_token_counts`, or a committed
    file of the other layout exists (the default tiles then: a start-up does not spend minutes
    tuning a shape the package covers; benchmarks/h200/quant_micro_tiles_h200.sh tunes it).
    Otherwise tunes (resuming a partial tune) into `tune_dir()` within `time_budget_s`.
    Without CUDA (and no `timer`) it tunes nothing: the default tiles.
    """
    start = time.perf_counter()
    if timer is None and not torch.cuda.is_available():
        return TuneOutcome(0.0, False, "default", "no CUDA device to tune on: default tiles")
    device_name = device_name or torch.cuda.get_device_name()
    shape = (fmt, num_experts, hidden, inter, top_k, group, dtype)
    wanted = engine_token_counts(max_num_batched_tokens)
    layout = _layout(fmt, hidden, inter, weights)
    found = find_quant_tuned(*shape, device_name, layout=layout)
    other = find_quant_tuned(*shape, device_name, layout="rows" if layout == "micro" else "micro")
    if found is None and other is not None and \
            Path(other[0]).parent == tile_configs.PACKAGE_CONFIG_DIR:
        return TuneOutcome(time.perf_counter() - start, False, "default",
                           f"default tiles: the committed {Path(other[0]).name} timed the "
                           f"other weight layout, not these {layout} experts")
    if found is not None:
        path, table = found
        if Path(path).parent == tile_configs.PACKAGE_CONFIG_DIR:
            return TuneOutcome(time.perf_counter() - start, True, path,
                               tile_configs.committed_detail(path, device_name))
        if all(n in table for n in wanted):
            return TuneOutcome(time.perf_counter() - start, True, path, "tuned earlier (cached)")
        out_path = Path(path)  # a partial tune (a budget ran out): resume it
    else:
        out_path = tune_dir() / quant_config_file_name(*shape, device_name, layout=layout)
    log(f"MoE tiles ({fmt}): no complete tune for E={num_experts} H={hidden} I={inter} "
        f"k={top_k} group={group} {dtype} on {device_name}; tuning {len(wanted)} token counts "
        f"into {out_path} (budget {time_budget_s:.0f} s)")
    done = tune_quant_moe(*shape, wanted, out_path, timer=timer, device_name=device_name,
                          time_budget_s=time_budget_s, weights=weights, log=log)
    return tune_outcome(start, done, wanted, out_path)


def main(argv: Sequence[str] | None = None) -> None:
    """The GPU tune of one format and shape on random quantized experts, into --out (resumable:
    rerun the same command after a kill). E.g. qwen3-30b-a3b in fp8:

        python -m moeserve.kernels.moe.quant.tune --format fp8 -E 128 -H 2048 -I 768 -k 8 \\
            --out DIR [--time-budget-s S] [--max-batched-tokens 8192] [--group 32 (int4)]
    """
    import argparse

    from moeserve.quant.packed import group_size

    parser = argparse.ArgumentParser(description=main.__doc__.splitlines()[0])
    parser.add_argument("--format", required=True, choices=("fp8", "nvfp4", "int4"))
    parser.add_argument("-E", "--experts", type=int, required=True)
    parser.add_argument("-H", "--hidden", type=int, required=True)
    parser.add_argument("-I", "--inter", type=int, required=True)
    parser.add_argument("-k", "--top-k", type=int, required=True)
    parser.add_argument("--group", type=int, default=None, help="int4's group (fp8 / nvfp4: fixed)")
    parser.add_argument("--dtype", default="bfloat16", help="the activations' dtype")
    parser.add_argument("--out", required=True, help="folder of the tuned file")
    parser.add_argument("--max-batched-tokens", type=int, default=8192)
    parser.add_argument("--tokens", type=int, nargs="+",
                        help="the token counts to tune (default: the engine's, 1, 2, 4, ... "
                             "up to --max-batched-tokens)")
    parser.add_argument("--time-budget-s", type=float, default=None)
    args = parser.parse_args(argv)
    if args.tokens and min(args.tokens) < 1:
        parser.error(f"--tokens must be >= 1, got {args.tokens}")
    group = group_size(args.format, args.group)
    dtype = getattr(torch, args.dtype)
    shape = (args.format, args.experts, args.hidden, args.inter, args.top_k, group, dtype)
    path = Path(args.out) / quant_config_file_name(
        *shape, torch.cuda.get_device_name(),
        layout=_layout(args.format, args.hidden, args.inter, None))
    tune_quant_moe(*shape, args.tokens or engine_token_counts(args.max_batched_tokens), path,
                   time_budget_s=args.time_budget_s)
    print(path)


if __name__ == "__main__":
    main()
