"""Routed MoE layer on one GPU: the Triton fused MoE (default / tuned tiles) vs torch._grouped_mm.

For a preset's expert shape (default qwen3-30b-a3b: E 128, H 2048, I 768, top-8, bf16) at 64, 256,
1,024 and 2,048 tokens, with dummy routing (random router logits) and skewed routing (logits of
20% of the experts raised so that they take most pairs), times the whole routed layer
(the engine's routing with its expert-load count, then the experts) inside a CUDA graph. Reports
ms, % of the expert-weight read bound (bytes of the experts actually touched / 4.27 TB/s; 0.283
ms with all 128 touched) and TFLOP/s against 787 (reference/ANCHORS.md). Every backend is first
checked against moe_loop_ref (fp32 on the same bf16 values) at one token count, and not timed if
it fails. Also times the expert sort alone (torch vs Triton align).

Backends: grouped_mm; triton_default (in-code default tiles); triton (tiles looked up: a tuned
file if one is found); measured (per token count the backend the tune measured faster, the
engine's "measured"); triton_atomic / triton_torch_align (looked-up tiles, other combine/sort);
triton_plain / triton_one_dot / triton_persistent1 / triton_sub_m (the looked-up tiles with
their launch options replaced: none, the gated launch in one dot, 1 program per SM walking the
tiles in both launches, half / quarter tiles for blocks of few rows: what each option is
worth); gluon_ws / gluon_ws_thread_arrive (128-row blocks through kernels/moe/gluon_ws.py's
warp-specialized kernel, its stages released by a barrier or by each thread; --backends
picks a subset). A backend that fails to compile is reported in "check",
not timed.

--tune first runs the engine's tune (`moe_tune.tune_for_engine`: the quick grid at 1, 2, 4,
..., 8192 tokens, capped by --max-batched-tokens; grouped_mm timed at each with the same timer;
resumable: rerun after a kill) into DIR/configs/<name>.json, named for
moeserve/kernels/moe/configs/ (copy it there to commit it), and points the lookup at it.
--time-budget bounds it (a rerun resumes). --tune-only skips the layer benchmark.

    python -m benchmarks.kernels.kernels_moe --out DIR [--tune | --tune-full] [--time-budget S]
        [--tune-only] [--max-batched-tokens 8192] [--tokens 64 256 1024 2048]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import shutil
import time
from collections.abc import Callable

import torch

from benchmarks.engine.w1_offline import environment
from moeserve.config import load_model_config
from moeserve.kernels.moe import gluon_ws
from moeserve.kernels.moe import search as moe_search
from moeserve.kernels.moe import tile_configs as moe_configs
from moeserve.kernels.moe import timer as moe_timer
from moeserve.kernels.moe import tune as moe_tune
from moeserve.kernels.moe.align import moe_align_block_size, moe_align_block_size_triton
from moeserve.kernels.moe.fused_triton import moe_triton
from moeserve.kernels.moe.grouped_mm import moe_grouped_mm
from moeserve.kernels.moe.measured import moe_measured
from moeserve.kernels.moe.ref import moe_loop_ref
from moeserve.kernels.routing.select import select_experts
from moeserve.kernels.routing.select_triton import MAX_EXPERTS, select_experts_triton

COPY_TBPS, DENSE_TFLOPS = 4.27, 787.0  # H200, measured (ANCHORS.md)
HOT_FRACTION, HOT_BIAS = 0.2, 3.0  # skewed routing: +3 on the logits of 20% of the experts
CHECK_TOKENS = 256
TOL = dict(atol=2e-2, rtol=2e-2)
DEVICE, DTYPE = "cuda", torch.bfloat16
MoeFn = Callable[..., torch.Tensor]  # (x, w13, w2, topk_weights, topk_ids, num_tokens)


def expert_shape(preset: str, moe_tp: int = 1, ep: int = 1) -> tuple[int, int, int, int]:
    """(experts, hidden, width, top-k) of one rank's routed experts: under expert parallelism
    EP a rank holds E / EP experts, under MoE tensor parallelism each expert's width is split
    moe_tp ways (docs/parallel.md); ValueError when they do not divide."""
    mc = load_model_config(preset)[0]  # any family's preset (GLM-5's n_routed_experts)
    experts, inter = mc.num_experts, mc.moe_intermediate_size
    if moe_tp < 1 or ep < 1 or experts % ep or inter % moe_tp:
        raise ValueError(f"{preset}: {experts} experts over EP {ep} and width {inter} over "
                         f"MoE-TP {moe_tp} must divide")
    return experts // ep, mc.hidden_size, inter // moe_tp, mc.num_experts_per_tok


def device_name() -> str:
    return torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE


def router_logits(kind: str, num_tokens: int, num_experts: int, seed: int) -> torch.Tensor:
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    logits = torch.randn(num_tokens, num_experts, device=DEVICE, generator=gen)
    if kind == "skewed":
        hot = torch.randperm(num_experts, device=DEVICE, generator=gen)
        logits[:, hot[:round(HOT_FRACTION * num_experts)]] += HOT_BIAS
    return logits


def time_in_graph(fn: Callable[[], torch.Tensor], calls: int = 10, replays: int = 10) -> float:
    """Median ms per call of `fn`, `calls` of them captured in one CUDA graph: the tuner's timer."""
    return moe_timer.time_in_graph(fn, calls, replays)


def check_backends(backends: dict[str, MoeFn], w13: torch.Tensor, w2: torch.Tensor,
                   top_k: int) -> dict[str, dict]:
    """Each backend vs the fp32 loop ref at CHECK_TOKENS tokens, dummy and skewed routing."""
    w13_f, w2_f = w13.float(), w2.float()
    results: dict[str, dict] = {}
    for kind in ("dummy", "skewed"):
        x = torch.randn(CHECK_TOKENS, w13.shape[2], device=DEVICE).to(DTYPE)
        weights, ids = select_experts(router_logits(kind, CHECK_TOKENS, w13.shape[0], 7), top_k,
                                      renormalize=True)
        expected = moe_loop_ref(x.float(), w13_f, w2_f, weights, ids)
        for name, fn in backends.items():
            try:  # an experimental variant may fail to compile: it is reported, not timed
                out = fn(x, w13, w2, weights, ids, num_tokens=CHECK_TOKENS).float()
            except Exception as exc:
                results[name] = {"ok": False, "max_abs_err": None,
                                 "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
                continue
            err = (out - expected).abs().max().item()
            try:
                torch.testing.assert_close(out, expected, **TOL)
                ok = True
            except AssertionError:
                ok = False
            prev = results.get(name, {"ok": True, "max_abs_err": 0.0})
            if "error" in prev:
                continue
            results[name] = {"ok": prev["ok"] and ok, "max_abs_err": max(prev["max_abs_err"], err)}
    del w13_f, w2_f
    torch.cuda.empty_cache()
    return results


def bench_layer(name: str, fn: MoeFn, kind: str, num_tokens: int, w13: torch.Tensor,
                w2: torch.Tensor, top_k: int) -> dict:
    num_experts, _, hidden = w13.shape
    inter = w2.shape[2]
    x = torch.randn(num_tokens, hidden, device=DEVICE).to(DTYPE)
    logits = router_logits(kind, num_tokens, num_experts, seed=num_tokens)

    counts = torch.zeros(num_experts, dtype=torch.int64, device=DEVICE)

    def layer() -> torch.Tensor:  # the engine's routing, expert-load count included
        if logits.is_cuda and num_experts <= MAX_EXPERTS:
            weights, ids = select_experts_triton(logits, top_k, True, counts=counts)
        else:
            weights, ids = select_experts(logits, top_k, renormalize=True)
        return fn(x, w13, w2, weights, ids, num_tokens=num_tokens)

    ms = time_in_graph(layer)
    _, ids = select_experts(logits, top_k, renormalize=True)
    touched = int(torch.unique(ids).numel())
    per_expert_bytes = 3 * hidden * inter * w13.element_size()
    bound_ms = touched * per_expert_bytes / (COPY_TBPS * 1e12) * 1e3
    tflops = 2 * num_tokens * top_k * 3 * hidden * inter / (ms * 1e-3) / 1e12
    hot = round(HOT_FRACTION * num_experts)
    counts = torch.bincount(ids.flatten(), minlength=num_experts).sort(descending=True).values
    return {"backend": name, "routing": kind, "tokens": num_tokens, "ms": round(ms, 4),
            "experts_touched": touched, "read_bound_ms": round(bound_ms, 4),
            "pct_of_read_bound": round(100 * bound_ms / ms, 1), "tflops": round(tflops, 1),
            "pct_of_787_tflops": round(100 * tflops / DENSE_TFLOPS, 1),
            "share_of_pairs_on_top_20pct_experts": round(
                counts[:hot].sum().item() / ids.numel(), 3)}


def bench_align(num_tokens: int, num_experts: int, top_k: int, block_m: int) -> list[dict]:
    logits = router_logits("dummy", num_tokens, num_experts, seed=1)
    _, ids = select_experts(logits, top_k, renormalize=True)
    rows = []
    for name, align in (("torch", moe_align_block_size), ("triton", moe_align_block_size_triton)):
        ms = time_in_graph(functools.partial(align, ids, num_experts, block_m))
        rows.append({"align": name, "tokens": num_tokens, "block_m": block_m,
                     "ms": round(ms, 4)})
    return rows


def run_tune(args: argparse.Namespace, shape: tuple[int, int, int, int],
             weights: tuple[torch.Tensor, torch.Tensor]) -> dict:
    """The engine's tune (quick or full grid) into DIR/configs; the lookup then reads it."""
    num_experts, hidden, inter, top_k = shape
    name = moe_configs.config_file_name(num_experts, hidden, inter, DTYPE, device_name())
    config_dir = os.path.join(args.out, "configs")
    path = os.path.join(config_dir, name)
    counts = args.tune_tokens or moe_configs.engine_token_counts(args.max_batched_tokens)
    grid = moe_search.moe_tune_candidates if args.tune_full else moe_search.quick_moe_candidates
    candidates = [grid(num_experts, top_k, n) for n in counts]
    distinct = {moe_search.candidate_key(c) for cs in candidates for c in cs}
    flags = [moe_search.search_options(num_experts, top_k, n) for n in counts]
    print(f"tune: {len(counts)} token counts {counts}, {sum(map(len, candidates))} candidates "
          f"({len(distinct)} distinct configs), estimated "
          f"~{moe_tune.estimate_tune_seconds(candidates, flags):.0f} s with a cold Triton cache "
          f"(budget {args.time_budget} s)", flush=True)
    t0 = time.perf_counter()
    best = moe_tune.tune_for_engine(num_experts, hidden, inter, top_k, DTYPE, path,
                                       token_counts=counts, time_budget_s=args.time_budget,
                                       full_grid=args.tune_full, weights=weights)
    if os.path.exists(path):  # a copy under a plain name: the GPU machine's transfer refuses
        shutil.copyfile(path, os.path.join(args.out, "tuned_moe_configs.json"))  # "=" and ","
    os.environ[moe_configs.CONFIG_DIR_ENV] = config_dir  # "triton" and "measured" read it now
    moe_configs.clear_caches()
    return {"path": path, "grid": "full" if args.tune_full else "quick",
            "seconds": round(time.perf_counter() - t0, 1), "token_counts": counts,
            "complete": all(n in best for n in counts),
            "best": {str(n): c for n, c in sorted(best.items())}}


def make_backends() -> dict[str, MoeFn]:
    """grouped_mm, triton (default / looked-up tiles; "sum" combine, Triton align), measured and
    variants."""

    def grouped(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                ids: torch.Tensor, num_tokens: int) -> torch.Tensor:
        return moe_grouped_mm(x, w13, w2, weights, ids)

    def measured(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                 ids: torch.Tensor, num_tokens: int) -> torch.Tensor:
        return moe_measured(x, w13, w2, weights, ids)

    def triton(**kwargs: str) -> MoeFn:
        def fn(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
               ids: torch.Tensor, num_tokens: int) -> torch.Tensor:
            config = None  # moe_triton looks it up
            if kwargs.get("default"):
                config = moe_configs.default_moe_config(w13.shape[0], ids.shape[1], num_tokens)
            elif kwargs.get("options"):
                config = with_options(looked_up_config(x, w13, w2, ids), kwargs["options"])
            return moe_triton(x, w13, w2, weights, ids, config=config,
                              combine=kwargs.get("combine", "sum"),
                              align=kwargs.get("align", "triton"))
        return fn

    return {"grouped_mm": grouped, "triton_default": triton(default="yes"), "triton": triton(),
            "measured": measured, "triton_atomic": triton(combine="atomic"),
            "triton_torch_align": triton(align="torch"),
            "triton_plain": triton(options="plain"),
            "triton_one_dot": triton(options="one_dot"),
            "triton_persistent1": triton(options="persistent1"),
            "triton_sub_m": triton(options="sub_m"), "gluon_ws": gluon_ws_backend(False),
            "gluon_ws_thread_arrive": gluon_ws_backend(True)}


def gluon_ws_backend(thread_arrive: bool) -> MoeFn:
    """The looked-up tiles at 128-row blocks with kernels/moe/gluon_ws.py's mode "on" (its
    `arrive_per_thread` as given): both launches its warp-specialized kernel where it supports
    them (sm90), else Triton's."""

    def fn(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
           ids: torch.Tensor, num_tokens: int) -> torch.Tensor:
        config = {**looked_up_config(x, w13, w2, ids), "BLOCK_M": gluon_ws.BLOCK_M}
        saved = gluon_ws.mode, gluon_ws.arrive_per_thread
        gluon_ws.mode, gluon_ws.arrive_per_thread = "on", thread_arrive
        try:
            return moe_triton(x, w13, w2, weights, ids, config=config)
        finally:
            gluon_ws.mode, gluon_ws.arrive_per_thread = saved
    return fn


def looked_up_config(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                     ids: torch.Tensor) -> dict:
    """The tiles moe_triton would look up for these inputs (tuned, else the default)."""
    name = torch.cuda.get_device_name(x.device) if x.is_cuda else x.device.type
    return moe_configs.get_moe_config(w13.shape[0], w13.shape[2], w2.shape[2], ids.shape[1],
                                      x.dtype, x.shape[0], name).config


def with_options(config: dict, options: str) -> dict:
    """`config` with its launch options replaced: "plain" (none: two dots, one program per
    tile, whole blocks), "one_dot" (the gated launch in one dot), "persistent1" (1 program per
    SM, both launches), "sub_m" (half / quarter tiles for blocks of few rows, both launches);
    the tiles are kept."""
    gated = {k: config[k] for k in moe_configs.CONFIG_KEYS}
    down = {k: v for k, v in moe_configs.down_tiles(config).items()
            if k in moe_configs.CONFIG_KEYS}
    if options == "one_dot":
        gated["ONE_DOT"] = 1
    elif options == "persistent1":
        gated["PERSISTENT"] = down["PERSISTENT"] = 1
    elif options == "sub_m":
        gated["SUB_M"] = down["SUB_M"] = 1
    elif options != "plain":
        raise ValueError(f"options must be plain, one_dot, persistent1 or sub_m, got {options!r}")
    return moe_configs.split_config(gated, down)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--preset", default="qwen3-30b-a3b")
    parser.add_argument("--tokens", type=int, nargs="+", default=[64, 256, 1024, 2048],
                        help="token counts of the layer benchmark")
    parser.add_argument("--tune", action="store_true",
                        help="the engine's quick tune first (<= 12 candidates per token count)")
    parser.add_argument("--tune-full", action="store_true", help="full grid (long; resumable)")
    parser.add_argument("--tune-tokens", type=int, nargs="+", default=None,
                        help="token counts to tune (default: 1, 2, 4, ... up to "
                             "--max-batched-tokens, at most 8192)")
    parser.add_argument("--max-batched-tokens", type=int, default=moe_configs.MAX_TUNE_TOKENS)
    parser.add_argument("--time-budget", type=float, default=None,
                        help="seconds for the tune; it stops there (a rerun resumes)")
    parser.add_argument("--tune-only", action="store_true", help="no layer benchmark")
    parser.add_argument("--moe-tp", type=int, default=1, help="one rank's shape under MoE "
                        "tensor parallelism: each expert's width / N")
    parser.add_argument("--ep", type=int, default=1, help="one rank's shape under expert "
                        "parallelism: E / N experts (its tuned entries are looked up at T x "
                        "E_local / E tokens, tile_configs.tile_tokens: the layer benchmark's "
                        "token counts are then that share)")
    parser.add_argument("--backends", nargs="+", default=None,
                        help="time only these (make_backends' names; default: all)")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    shape = num_experts, hidden, inter, top_k = expert_shape(args.preset, args.moe_tp, args.ep)
    t0 = time.perf_counter()
    result: dict = {"environment": environment(), "preset": args.preset,
                    "moe_tp": args.moe_tp, "ep": args.ep,
                    "shape": {"E": num_experts, "H": hidden, "I": inter, "top_k": top_k,
                              "dtype": str(DTYPE)}}
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, device=DEVICE, generator=gen)
           * hidden ** -0.5).to(DTYPE)
    w2 = (torch.randn(num_experts, hidden, inter, device=DEVICE, generator=gen)
          * inter ** -0.5).to(DTYPE)
    if args.tune or args.tune_full:
        result["tune"] = run_tune(args, shape, (w13, w2))
        print(json.dumps({k: v for k, v in result["tune"].items() if k != "best"}), flush=True)
    result["picks"] = {  # what "triton" and "measured" run with: a tuned file's entry, or defaults
        str(n): dataclasses.asdict(moe_configs.get_moe_config(
            num_experts, hidden, inter, top_k, DTYPE, n, device_name()))
        for n in args.tokens}
    print(json.dumps({"picks": result["picks"]}), flush=True)
    if not args.tune_only:
        bench(args, result, w13, w2, top_k)
    result["seconds"] = round(time.perf_counter() - t0, 1)
    path = os.path.join(args.out, f"kernels_moe_{args.preset}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {path} ({result['seconds']} s)", flush=True)


def bench(args: argparse.Namespace, result: dict, w13: torch.Tensor, w2: torch.Tensor,
          top_k: int) -> None:
    num_experts = w13.shape[0]
    backends = make_backends()
    if args.backends:
        unknown = sorted(set(args.backends) - set(backends))
        if unknown:
            raise SystemExit(f"--backends: unknown {unknown}; known: {sorted(backends)}")
        backends = {name: backends[name] for name in args.backends}
    result["check"] = check_backends(backends, w13, w2, top_k)
    print(json.dumps({"check": result["check"]}), flush=True)
    result["rows"], result["align"] = [], []
    for num_tokens in args.tokens:
        block_m = result["picks"][str(num_tokens)]["config"]["BLOCK_M"]
        result["align"] += bench_align(num_tokens, num_experts, top_k, block_m)
        for kind in ("dummy", "skewed"):
            for name, fn in backends.items():
                if not result["check"][name]["ok"]:
                    continue
                row = bench_layer(name, fn, kind, num_tokens, w13, w2, top_k)
                result["rows"].append(row)
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
