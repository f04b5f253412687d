"""One routed-experts call for a kernel profiler (Nsight Compute): kernels_quant.py's weights,
routing and op at one format, expert shape and token count, compiled and warmed up first, then
the measured calls between cudaProfilerStart and cudaProfilerStop, so that
`ncu --profile-from-start off` sees only them.

    source benchmarks/gpu_env.sh
    ncu --profile-from-start off --target-processes all -k regex:_fused_moe \
        --section SpeedOfLight --section ComputeWorkloadAnalysis \
        --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \
        --section SourceCounters -o $OUT/nvfp4_t64 \
        python3 -m benchmarks.quant.moe_quant_once --format nvfp4 --tokens 64
    ncu --import $OUT/nvfp4_t64.ncu-rep --page details > $OUT/nvfp4_t64.txt

Without ncu it prints the op's median time over the measured calls (CUDA events), a check that
the call runs. With --tile (repeatable) it times the fused kernel at each tile config instead,
in a CUDA graph as kernels_quant.py does (no profiler range), one JSON line a tile with its
largest difference from the op's output at its own tiles (relative to that output's largest
value), the tuned or default op first:

    python3 -m benchmarks.quant.moe_quant_once --format nvfp4 --shape glm-5 --tokens 64 \
        --tile 16 64 128 4 3 --tile 16 32 256 4 3

A seventh number 1 adds the SUB_M option (a block of few real rows computes a half or quarter
tile); --down-n N gives every --tile's down launch BLOCK_N N (a config's "down" entry).
--weight-layout micro draws the 4-bit experts micro-tiled (kernels/moe/quant/micro_tiles.py).
--switch TAG=VALUE (repeatable) sets one of quant_switches.py's kernel switches for the run,
e.g. `--format fp8 --switch fp8_moe=gluon --switch fp8_gluon_dot=one`.

--breakdown (repeatable token counts, no ncu) says where the op's time goes: for each count
one JSON line with the op timed in a CUDA graph as kernels_quant.py does (`graph_ms`), each
kernel's GPU time a call from torch.profiler over eager calls (`kernels`, microseconds, in
launch order; the align, zero-rows and combine launches beside the two GEMM launches), their
sum, and what the graph spends beyond it (`gaps_us`: launch gaps and tails between kernels):

    python3 -m benchmarks.quant.moe_quant_once --weight-layout micro --breakdown 64 256 1024
"""

from __future__ import annotations

import argparse
import json

import torch


def main() -> None:
    from benchmarks.kernels.kernel_runs import profiled_median_ms
    from benchmarks.quant.kernels_quant import (
        FORMATS,
        make_weight,
        moe_op,
        moe_shapes,
        register_cap,
    )
    from benchmarks.quant.quant_switches import set_switch
    from moeserve.kernels.moe.timer import random_tokens

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--format", choices=FORMATS, default="nvfp4")
    parser.add_argument("--shape", default="qwen3-30b-a3b", help="a preset's expert shape")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--tiles", choices=("tuned", "default"), default="tuned")
    parser.add_argument("--calls", type=int, default=2, help="measured calls")
    parser.add_argument("--nvfp4-decode", choices=("bits", "asm"), default=None,
                        help="kernels/linear/nvfp4_tile.py's decode (default: as set there)")
    parser.add_argument("--maxnreg", type=register_cap, default="off",
                        help="a register cap a thread (kernels/moe/quant/fused_triton.py "
                        "max_registers; off: ptxas's choice)")
    parser.add_argument("--weight-layout", choices=("rows", "micro"), default="rows",
                        help="the 4-bit experts' packed layout (quant_weights.packed_layout)")
    parser.add_argument("--tile", type=int, nargs="+", action="append", default=[],
                        metavar="N", help="time the fused kernel at this tile config: BLOCK_M "
                        "BLOCK_N BLOCK_K WARPS STAGES [GROUP_M, default 1 [SUB_M, default 0]] "
                        "(repeatable)")
    parser.add_argument("--down-n", type=int, default=None,
                        help="each --tile's down launch at this BLOCK_N (its other tiles the "
                             "same): the config's 'down' entry")
    parser.add_argument("--switch", type=set_switch, action="append", default=[],
                        metavar="TAG=VALUE", help="a kernel switch of quant_switches.py set "
                        "for the run (repeatable)")
    parser.add_argument("--breakdown", type=int, nargs="+", default=None, metavar="TOKENS",
                        help="per-kernel GPU times of the op at these token counts (JSON lines)")
    args = parser.parse_args()
    for tile in args.tile:
        if len(tile) not in (5, 6, 7):
            parser.error(f"--tile takes BLOCK_M BLOCK_N BLOCK_K WARPS STAGES [GROUP_M [SUB_M]], "
                         f"got {tile}")
    if args.maxnreg != "off":
        from moeserve.kernels.moe.quant import fused_triton

        fused_triton.max_registers = int(args.maxnreg)
    if args.weight_layout != "rows":
        from benchmarks.quant import quant_weights

        quant_weights.packed_layout = args.weight_layout
    if args.nvfp4_decode:
        from moeserve.kernels.linear import nvfp4_tile

        nvfp4_tile.decode = args.nvfp4_decode
    if not torch.cuda.is_available():
        raise SystemExit("moe_quant_once needs a CUDA GPU")
    num_experts, hidden, inter, top_k = moe_shapes([args.shape], False)[args.shape]
    gen = torch.Generator(device="cuda").manual_seed(0)
    dtype = torch.bfloat16
    w13 = make_weight(args.format, (num_experts, 2 * inter, hidden), dtype, "cuda", gen)
    w2 = make_weight(args.format, (num_experts, hidden, inter), dtype, "cuda", gen)
    if args.breakdown:
        for tokens in args.breakdown:
            x, weights, ids = random_tokens(tokens, hidden, num_experts, top_k, dtype, gen)
            row = breakdown(moe_op(args.format, x, w13, w2, weights, ids, args.tiles),
                            args.calls)
            print(json.dumps({"format": args.format, "shape": args.shape, "tokens": tokens,
                              "weight_layout": args.weight_layout, "tiles": args.tiles}
                             | row), flush=True)
        return
    x, weights, ids = random_tokens(args.tokens, hidden, num_experts, top_k, dtype, gen)
    fn = moe_op(args.format, x, w13, w2, weights, ids, args.tiles)
    if args.tile:
        time_tiles(args, fn, x, w13, w2, weights, ids)
        return
    ms = profiled_median_ms(fn, args.calls)
    print(f"{args.format} {args.shape} T{args.tokens}: {ms:.4f} ms "
          f"(median of {args.calls} eager calls)")


def breakdown(fn, calls: int) -> dict:
    """fn's time in a CUDA graph, and each kernel's GPU time a call over `calls` eager calls
    (torch.profiler; kernels keyed by name in first-launch order, microseconds a call)."""
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.quant.kernels_quant import make_timer

    graph_ms = make_timer("cuda")(fn)
    calls = max(calls, 5)
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    kernels: dict[str, float] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels[event.name] = (kernels.get(event.name, 0.0)
                                  + event.time_range.elapsed_us() / calls)
    total_us = sum(kernels.values())
    return {"graph_ms": round(graph_ms, 4), "calls": calls,
            "kernels": {name: round(us, 2) for name, us in kernels.items()},
            "kernels_us": round(total_us, 2), "gaps_us": round(graph_ms * 1e3 - total_us, 2)}


def time_tiles(args: argparse.Namespace, fn, x, w13, w2, weights, ids) -> None:
    """One JSON line for the op at its own tiles, then one for each --tile."""
    from benchmarks.quant.kernels_quant import make_timer
    from moeserve.kernels.moe.quant.fused_triton import moe_quant_triton
    from moeserve.kernels.moe.tile_configs import tile_config

    timer = make_timer("cuda")
    ref = fn().float()
    scale = ref.abs().max().item() or 1.0
    print(json.dumps({"tile": args.tiles, "ms": round(timer(fn), 4)}), flush=True)
    for m, n, k, warps, stages, *more in args.tile:
        group_m = more[0] if more else 1  # 1: decode's row blocks, one an expert
        sub_m = more[1] if len(more) > 1 else 0  # the SUB_M option (fused_triton.py)
        config = tile_config(m, n, k, group_m, warps, stages) | ({"SUB_M": 1} if sub_m else {})
        row = {"tile": [m, n, k, warps, stages, group_m, sub_m]}
        if args.down_n:
            config["down"] = {"BLOCK_N": args.down_n, "BLOCK_K": k, "GROUP_M": group_m,
                              "num_warps": warps, "num_stages": stages}
            row["down_n"] = args.down_n
        try:
            def op(config=config):
                return moe_quant_triton(x, w13, w2, weights, ids, config=config)
            diff = (op().float() - ref).abs().max().item() / scale
            row |= {"ms": round(timer(op), 4), "max_diff": round(diff, 5)}
        except Exception as e:  # a tile the format refuses or ptxas cannot fit: said, go on
            row["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:200]}"
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
