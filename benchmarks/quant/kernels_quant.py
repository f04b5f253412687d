"""Quantized kernels on one GPU (issue 18): the routed experts and the attention projections in
bf16, FP8 (W8A8, 128x128 weight blocks), NVFP4 and INT4 (W4A16, groups of 32), each beside its
bound, and the device's dense peaks measured in the same run.

MoE: per expert shape (--shapes: presets; default qwen3-30b-a3b E 128 H 2048 I 768 and glm-5 E
256 H 6144 I 2048, both top-8) and token count (64, 256, 1,024, 8,192), random routing
(timer.random_tokens: random router logits, softmax top-k, renormalised, computed once outside
the timing), the experts op alone (`moe_triton` for bf16, `moe_quant_triton`, each with the
tiles it looks up: a tuned file for the device, format and shape where one is found, else its
defaults; --tiles default forces the defaults; each row records its tiles and their source; the
expert sort and the combine included) timed by the tuner's `time_in_graph` (10 calls captured in
one CUDA graph, the median of 5 replays). Weights are drawn as the server's dummy weights are
(`_dummy_quantized`; FP8 scales then folded to one row per 128). The read bound: experts
touched, E x (1 - (1 - k/E)^T) (roofline.experts_touched), x 3 x H x I x bytes a weight / the
device's copy rate (roofline.ceilings_for: the H200's 4.27 TB/s, the H100's 3.0; a device
without measured ceilings is judged by the H200's, the issue's, and the JSON's config says
which), the bytes a weight being the roofline's QUANT_BYTES (scales counted at their nominal
share: fp8 1 + 4 / 128^2, nvfp4 0.5 + 1/16, int4 0.5 + 2/32; the nvfp4 per-row fp32 global
scale, 4 / K, is not counted) or 2 for bf16; the bytes the tensors actually hold are reported
beside it (`held_bytes_per_weight`). TFLOP/s against the device's dense bf16 rate (787 on the
H200, ANCHORS.md; `pct_of_787_tflops` keeps its name) and against
the FP8 dense peak measured here (torch._scaled_mm, e4m3, per-tensor scales, bf16 out, at
--peak-size cubed; the faster of fp32 and fast accumulation).

The "bf16" rows are the engine's dtype unquantized (fp32 in the CPU smoke).

Linear: qwen3-30b-a3b's qkv (N 5120, K 2048) and o_proj (N 2048, K 4096), GLM-5's q_b (N
16384, K 2048) and o_proj (N 6144, K 16384) at 64 / 256 / 1,024 tokens: F.linear (bf16),
`fp8_linear` (the engine's backend choice: cuBLASLt where supported, else Triton;
benchmarks/quant/fp8_linear_backends.py times the two apart), `w4a16_linear` (the engine's choice
of kernels/linear/w4a16_dequant.py; `--w4a16-backend fused dequant` times each), beside the
weight-read bound and the whole bound max((weights + x + out bytes) / copy rate, FLOPs / dense
rate), the device's ceilings as above.

Each op is first run once and its output checked finite and against its reference (moe_loop_ref
/ moe_quant_ref; the dequantized weight in fp32) at the smallest token count; `acceptance` lists
the issue's kernel criteria. Writes DIR/kernels_quant.json (after each section, so a run cut
short keeps what it measured, after each format of each shape). Exit status 1 if an output
was not finite.

On the H200 (one call; expected 3-6 minutes, most of it Triton compiles and weight drawing;
the timeout's SIGINT leaves the JSON of what was done; `--shapes glm-5` etc. split it;
--profile adds each MoE row's kernels by GPU time, torch.profiler over three eager calls;
--nvfp4-decode bits asm times the NVFP4 rows with each decode of kernels/linear/nvfp4_tile.py
(--int4-decode reshape planes planes-asm the INT4 MoE rows with kernels/linear/int4_tile.py's)
(--fp8-prefetch off on the FP8 rows with and without the scales' one-step prefetch;
--moe-dequant off on the 4-bit MoE rows fused or dequantized first; --maxnreg off 96 80 the MoE
rows with each register cap a thread; --scale-layout rows k-major the 4-bit MoE rows with the
group scales row- or K-major in memory; --weight-layout rows micro the 4-bit MoE rows with the
packed experts in rows or micro-tiles; --w4a16-backend fused dequant the 4-bit linears:
benchmarks/quant/quant_switches.py), the acceptance taking the best):

    source benchmarks/gpu_env.sh; timeout -s INT 560 python3 -m benchmarks.quant.kernels_quant \
        --out $OUT
    python -m benchmarks.quant.kernels_quant --out /tmp/kq --small
        # CPU smoke (~1 min): tiny shapes through Triton's interpreter in fp32, every path
        # run once, no CUDA graph (one call)
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import os
import time
from collections.abc import Callable

import torch

from benchmarks.quant import quant_weights
from benchmarks.quant.kernels_quant_linear import (
    LINEAR_SHAPES,
    SMALL_LINEAR,
    bench_linear,
    dense_peaks,
)
from benchmarks.quant.quant_switches import SWITCHES, register_cap, switched
from benchmarks.quant.quant_weights import (
    INT4_GROUP,
    bytes_a_weight,
    check_output,
    held_bytes,
    make_weight,
    moe_ref,
    row_layout,
)

COPY_TBPS, DENSE_TFLOPS = 4.27, 787.0  # H200, measured (ANCHORS.md): the device
FORMATS = ("bf16", "fp8", "nvfp4", "int4")
MOE_TOKENS, LINEAR_TOKENS = (64, 256, 1024, 8192), (64, 256, 1024)
SMALL_MOE = {"small_a": (8, 256, 128, 2), "small_b": (16, 384, 256, 4)}  # (E, H, I, k)
SMALL_TOKENS = (1, 33)
CALLS, REPLAYS = 10, 5  # time_in_graph: calls captured in one graph, replays (the median)
# the kernel acceptance: (format, tokens, minimum % of the read bound)
READ_TARGETS = (("nvfp4", 64, 70), ("nvfp4", 256, 70), ("nvfp4", 1024, 60),
                ("fp8", 64, 75), ("fp8", 256, 75))
FP8_PEAK_TARGET = (8192, 60)  # FP8 at 8,192 tokens: % of the measured FP8 dense peak
Timer = Callable[[Callable[[], object]], float]


def moe_op(fmt: str, x: torch.Tensor, w13, w2, weights: torch.Tensor, ids: torch.Tensor,
           tiles: str) -> Callable[[], torch.Tensor]:
    from moeserve.kernels.moe.fused_triton import moe_triton
    from moeserve.kernels.moe.quant import moe_quantized

    if fmt == "bf16":
        return lambda: moe_triton(x, w13, w2, weights, ids, tiles=tiles)
    # the engine's dispatcher, so that --moe-dequant's switch applies (calling the fused kernel
    # itself, as this did at 65126ca, timed the fused kernel on both sides of the switch)
    return lambda: moe_quantized(x, w13, w2, weights, ids, tiles=tiles)


def kernel_breakdown(fn: Callable[[], object], calls: int = 3) -> list[dict]:
    """The op's GPU kernels (torch.profiler, `calls` eager calls): name, us a call, share."""
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    total = sum(e.self_device_time_total for e in events) or 1.0
    return [{"kernel": e.key[:100], "us": round(e.self_device_time_total / calls, 1),
             "share": round(e.self_device_time_total / total, 3)}
            for e in sorted(events, key=lambda e: -e.self_device_time_total)]


def moe_tiles(fmt: str, w13, num_tokens: int, top_k: int, dtype: torch.dtype,
              tiles: str) -> dict:
    """The tiles the op runs with, looked up as the op looks them up (tuned file or default)."""
    from moeserve.kernels.moe.quant.configs import get_quant_config
    from moeserve.kernels.moe.quant.micro_tiles import is_micro
    from moeserve.kernels.moe.tile_configs import get_moe_config, tile_device_name

    num_experts, _, hidden = w13.shape
    inter, name = w13.shape[1] // 2, tile_device_name(w13.device)
    if fmt == "bf16":
        choice = get_moe_config(num_experts, hidden, inter, top_k, dtype, num_tokens, name,
                                tiles=tiles)
    else:
        choice = get_quant_config(fmt, num_experts, hidden, inter, top_k, w13.group, dtype,
                                  num_tokens, name, tiles=tiles, micro=is_micro(w13))
    return dataclasses.asdict(choice)


def bench_moe_format(fmt: str, shape_name: str, shape: tuple[int, int, int, int],
                     tokens: list[int], ctx: dict) -> list[dict]:
    """The rows of one format at one expert shape (weights built once, freed after)."""
    from moeserve.diagnose.bounds.roofline import experts_touched
    from moeserve.kernels.moe.quant.micro_tiles import is_micro
    from moeserve.kernels.moe.timer import random_tokens

    num_experts, hidden, inter, top_k = shape
    device, dtype, timer = ctx["device"], ctx["dtype"], ctx["timer"]
    gen = torch.Generator(device=device).manual_seed(0)
    w13 = make_weight(fmt, (num_experts, 2 * inter, hidden), dtype, device, gen)
    w2 = make_weight(fmt, (num_experts, hidden, inter), dtype, device, gen)
    per_weight = bytes_a_weight(fmt)
    held = (held_bytes(w13) + held_bytes(w2)) / (num_experts * 3 * hidden * inter)
    rows = []
    for num_tokens in tokens:
        x, weights, ids = random_tokens(num_tokens, hidden, num_experts, top_k, dtype, gen)
        fn = moe_op(fmt, x, w13, w2, weights, ids, ctx["tiles"])
        ref = None
        if num_tokens == min(tokens):
            with row_layout(w13, w2):
                ref = moe_ref(fmt, x, w13, w2, weights, ids)
        row = {"shape": shape_name, "format": fmt, "tokens": num_tokens,
               **({"micro_tiled": [is_micro(w) for w in (w13, w2)]}
                  if quant_weights.packed_layout == "micro" else {})}
        try:
            row.update(check_output(fn(), ref))
            ms = timer(fn)
        except Exception as e:  # e.g. ptxas refusing a register cap: the row says so, the rest run
            rows.append(row | {"error": f"{type(e).__name__}: {first_line(e)}", "finite": True})
            print(json.dumps(rows[-1]), flush=True)
            continue
        touched = experts_touched(num_experts, top_k, num_tokens)
        bound_ms = touched * 3 * hidden * inter * per_weight / (ctx["copy_tbps"] * 1e12) * 1e3
        tflops = 2 * num_tokens * top_k * 3 * hidden * inter / (ms * 1e-3) / 1e12
        row.update({
            "ms": round(ms, 4), "experts_touched_expected": round(touched, 2),
            "experts_touched": int(torch.unique(ids).numel()),
            "bytes_per_weight": round(per_weight, 6),
            "held_bytes_per_weight": round(held, 6), "read_bound_ms": round(bound_ms, 4),
            "pct_of_read_bound": round(100 * bound_ms / ms, 1), "tflops": round(tflops, 1),
            "pct_of_787_tflops": round(100 * tflops / ctx["dense_tflops"], 1),
            "tiles": moe_tiles(fmt, w13, num_tokens, top_k, dtype, ctx["tiles"])})
        if ctx.get("profile") and device == "cuda":
            row["kernels"] = kernel_breakdown(fn)
        if ctx.get("fp8_peak_tflops"):
            row["pct_of_fp8_peak"] = round(100 * tflops / ctx["fp8_peak_tflops"], 1)
        rows.append(row)
        print(json.dumps(row), flush=True)
    del w13, w2
    if device == "cuda":
        torch.cuda.empty_cache()
    return rows


def settings_of(fmt: str, switches: dict[str, list[str]]) -> list[list[tuple[str, str]]]:
    """Every combination of the switches (quant_switches.py) that act on `fmt`, each value of
    each: one benchmark run apiece."""
    mine = [(tag, values) for tag, values in switches.items()
            if fmt in SWITCHES[tag].formats]
    return [list(zip((tag for tag, _ in mine), combo))
            for combo in itertools.product(*(values for _, values in mine))]


def first_line(error: BaseException) -> str:
    """An error's message up to its first line that says something (ptxas's come long)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    fatal = [line for line in lines if "fatal" in line]
    return (fatal or lines or [""])[0][:300]


def acceptance(moe_rows: list[dict], fp8_peak: float | None) -> list[dict]:
    """The issue's kernel criteria against the rows measured (one entry a shape and target;
    of several rows of one key, NVFP4 decodes, the best; rows that ended in an error left out)."""
    by: dict = {}
    timed = [r for r in moe_rows if "error" not in r]
    for r in sorted(timed, key=lambda r: r["pct_of_read_bound"]):
        by[(r["shape"], r["format"], r["tokens"])] = r
    shapes = sorted({r["shape"] for r in timed})
    out = []
    for shape in shapes:
        for fmt, tokens, target in READ_TARGETS:
            if (r := by.get((shape, fmt, tokens))) is not None:
                out.append({"shape": shape, "format": fmt, "tokens": tokens,
                            "what": "% of read bound", "value": r["pct_of_read_bound"],
                            "target": target, "pass": r["pct_of_read_bound"] >= target})
        tokens, target = FP8_PEAK_TARGET
        if (r := by.get((shape, "fp8", tokens))) is not None and fp8_peak:
            value = round(100 * r["tflops"] / fp8_peak, 1)
            out.append({"shape": shape, "format": "fp8", "tokens": tokens,
                        "what": "% of measured FP8 dense peak", "value": value,
                        "target": target, "pass": value >= target})
    return out


def device_ceilings(device: str) -> dict:
    """copy_tbps and dense_tflops, the bounds' rates: the CUDA device's measured ceilings
    (roofline.ceilings_for), else the H200's (ANCHORS.md; ceilings_of says whose)."""
    from moeserve.diagnose.bounds.roofline import ceilings_for

    name = torch.cuda.get_device_name() if device == "cuda" else None
    own = ceilings_for(name)
    if own is None:
        return {"copy_tbps": COPY_TBPS, "dense_tflops": DENSE_TFLOPS,
                "ceilings_of": f"H200 (ANCHORS.md; none measured for {name or device})"}
    return {"copy_tbps": own.bytes_per_s / 1e12, "dense_tflops": own.flops_per_s / 1e12,
            "ceilings_of": own.name}


def make_timer(device: str) -> Timer:
    if device == "cuda":
        from moeserve.kernels.moe import timer as moe_timer

        return lambda fn: moe_timer.time_in_graph(fn, CALLS, REPLAYS)

    def one_call(fn: Callable[[], object]) -> float:  # CPU smoke: no graph, one call
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    return one_call


def moe_shapes(names: list[str] | None, small: bool) -> dict[str, tuple[int, int, int, int]]:
    """name -> (E, H, I, top_k): SMALL_MOE's names, else presets (their expert shape)."""
    from moeserve.config import load_model_config

    out = {}
    for name in names or (list(SMALL_MOE) if small else ["qwen3-30b-a3b", "glm-5"]):
        if name in SMALL_MOE:
            out[name] = SMALL_MOE[name]
            continue
        mc = load_model_config(name)[0]
        out[name] = (mc.num_experts, mc.hidden_size, mc.moe_intermediate_size,
                     mc.num_experts_per_tok)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory for kernels_quant.json")
    parser.add_argument("--shapes", nargs="+",
                        help="presets whose expert shape to run (default qwen3-30b-a3b glm-5; "
                             f"--small: {' '.join(SMALL_MOE)})")
    parser.add_argument("--tokens", type=int, nargs="+",
                        help=f"MoE token counts (default {MOE_TOKENS}; --small {SMALL_TOKENS})")
    parser.add_argument("--linear-tokens", type=int, nargs="+",
                        help=f"linear token counts (default {LINEAR_TOKENS}; --small "
                             f"{SMALL_TOKENS})")
    parser.add_argument("--formats", nargs="+", choices=FORMATS, default=list(FORMATS))
    parser.add_argument("--tiles", choices=("tuned", "default"), default="tuned",
                        help="MoE tiles: a tuned file's (for this device and shape) where one "
                             "is found, else the defaults; or the defaults")
    parser.add_argument("--peak-size", type=int, default=8192, help="dense peaks at size^3")
    parser.add_argument("--no-linear", action="store_true", help="skip the linear kernels")
    parser.add_argument("--nvfp4-decode", nargs="+", choices=("auto", "bits", "asm"),
                        default=["auto"], help="NVFP4 rows per decode of "
                        "kernels/linear/nvfp4_tile.py (asm: inline PTX, CUDA only)")
    parser.add_argument("--int4-decode", nargs="+",
                        choices=("auto", "reshape", "planes", "planes-asm"), default=["auto"],
                        help="INT4 MoE rows per decode of kernels/linear/int4_tile.py (planes: "
                        "BLOCK_K >= 128; planes-asm: inline PTX, bf16 on CUDA)")
    parser.add_argument("--fp8-prefetch", nargs="+", choices=("off", "on"), default=["off"],
                        help="FP8 MoE rows per setting of the scales' one-step prefetch "
                        "(kernels/moe/quant/fused_triton.py prefetch_scales)")
    parser.add_argument("--fp8-act-quant", nargs="+", choices=("fused", "apart"),
                        default=["fused"], help="FP8 MoE rows per place of act's quantization "
                        "(fused: in the gated launch's epilogue, where it runs the Triton "
                        "kernel; apart: its own launch; kernels/moe/quant/act_quant.py)")
    parser.add_argument("--fp8-moe", nargs="+", choices=("triton", "gluon", "gluon-128",
                                                     "gluon-down", "gluon-ws"),
                        default=["gluon"], help="FP8 MoE rows per grouped GEMM "
                        "(kernels/moe/quant/fp8_gluon.py backend: gluon where it supports the "
                        "launch, sm90, gluon-128 with 128-row blocks, gluon-down the down launch "
                        "only, gluon-ws the warp-specialized kernel; triton: fused_triton's "
                        "kernel)")
    parser.add_argument("--fp8-gluon-dot", nargs="+", choices=("two", "one"), default=["one"],
                        help="FP8 rows per form of fp8_gluon's gated launch (one: gate and up "
                        "rows interleaved in one weight tile, one wgmma a step; fp8_gluon.one_dot)")
    for launch, tiles in (("down", ("128", "64")), ("gated", ("64", "32"))):
        parser.add_argument(f"--fp8-gluon-{launch}-n", nargs="+", choices=tiles,
                            default=[tiles[0]], help=f"FP8 rows per N tile of fp8_gluon's "
                            f"{launch} launch (fp8_gluon.{launch}_block_n)")
    parser.add_argument("--fp8-gluon-scales", nargs="+", choices=("global", "smem"),
                        default=["smem"], help="FP8 rows per source of fp8_gluon's step "
                        "scales (smem: copied with the step's operands; fp8_gluon.smem_scales)")
    parser.add_argument("--fp8-gluon-stages", nargs="+", choices=("3", "4", "5", "6"),
                        default=["4"], help="FP8 rows per shared-memory depth of fp8_gluon's "
                        "launches (fp8_gluon.stages)")
    parser.add_argument("--w4a16-backend", nargs="+", choices=("auto", "fused", "dequant"),
                        default=["auto"], help="NVFP4 / INT4 linear rows per backend of "
                        "kernels/linear/w4a16_dequant.py (fused: dequantized in the GEMM's "
                        "loads; dequant: the weight dequantized once, then cuBLAS)")
    parser.add_argument("--moe-dequant", nargs="+", choices=("auto", "on", "off"),
                        default=["auto"], help="NVFP4 / INT4 MoE rows per mode of "
                        "kernels/moe/quant/dequant.py (on: every expert dequantized, then the "
                        "bf16 fused MoE; off: the W4A16 fused MoE)")
    parser.add_argument("--maxnreg", nargs="+", default=["off"], type=register_cap,
                        help="MoE rows per register cap a thread of the fused quantized MoE "
                        "(kernels/moe/quant/fused_triton.py max_registers; off: ptxas's choice)")
    parser.add_argument("--scale-layout", nargs="+", choices=("rows", "k-major"),
                        default=["rows"], help="NVFP4 / INT4 MoE rows per layout of "
                        "the group scales in memory (kernels_quant.scale_layout)")
    parser.add_argument("--weight-layout", nargs="+", choices=("rows", "micro"),
                        default=["rows"], help="NVFP4 / INT4 MoE rows per layout of the packed "
                        "expert weights (micro: kernels/moe/quant/micro_tiles.py)")
    parser.add_argument("--profile", action="store_true",
                        help="each MoE row also lists the op's GPU kernels by time (CUDA)")
    parser.add_argument("--small", action="store_true",
                        help="CPU smoke: tiny shapes through Triton's interpreter in fp32")
    args = parser.parse_args()
    if args.small:
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernels import triton (lazily)
        device, dtype = "cpu", torch.float32  # the interpreter mishandles bf16
        args.peak_size = 128
    elif torch.cuda.is_available():
        device, dtype = "cuda", torch.bfloat16
    else:
        raise SystemExit("kernels_quant needs a CUDA GPU (or --small on the CPU)")
    args.tokens = args.tokens or list(SMALL_TOKENS if args.small else MOE_TOKENS)
    args.linear_tokens = args.linear_tokens or list(SMALL_TOKENS if args.small
                                                    else LINEAR_TOKENS)
    from benchmarks.engine.w1_offline import environment

    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "kernels_quant.json")
    shapes = moe_shapes(args.shapes, args.small)
    ctx = {"device": device, "dtype": dtype, "timer": make_timer(device),
           "formats": args.formats, "tiles": args.tiles, "profile": args.profile,
           **device_ceilings(device)}
    t0 = time.perf_counter()
    result: dict = {
        "environment": environment(),
        "config": {**vars(args), "device": device, "dtype": str(dtype),
                   "moe_shapes": {k: dict(zip(("E", "H", "I", "top_k"), v))
                                  for k, v in shapes.items()},
                   "linear_shapes": [dict(zip(("name", "N", "K"), s)) for s in
                                     (SMALL_LINEAR if args.small else LINEAR_SHAPES)],
                   "int4_group": INT4_GROUP, "copy_tbps": ctx["copy_tbps"],
                   "dense_bf16_tflops": ctx["dense_tflops"],
                   "ceilings_of": ctx["ceilings_of"],
                   "timer": (f"time_in_graph: {CALLS} calls in one CUDA graph, median of "
                             f"{REPLAYS} replays" if device == "cuda"
                             else "one eager call (CPU smoke: not a measurement)")},
        "moe": [], "linear": []}

    def save() -> None:
        result["seconds"] = round(time.perf_counter() - t0, 1)
        with open(path, "w") as f:
            json.dump(result, f, indent=1)

    result["peaks"] = dense_peaks(args.peak_size, ctx)
    ctx["fp8_peak_tflops"] = result["peaks"]["fp8_peak_tflops"]
    save()
    moe_switches = {"decode": args.nvfp4_decode, "prefetch": args.fp8_prefetch,
                    "fp8_act_quant": args.fp8_act_quant,
                    "fp8_moe": args.fp8_moe, "fp8_gluon_dot": args.fp8_gluon_dot,
                    "fp8_gluon_down_n": args.fp8_gluon_down_n,
                    "fp8_gluon_gated_n": args.fp8_gluon_gated_n,
                    "fp8_gluon_stages": args.fp8_gluon_stages,
                    "fp8_gluon_scales": args.fp8_gluon_scales,
                    "moe_dequant": args.moe_dequant, "int4_decode": args.int4_decode,
                    "maxnreg": args.maxnreg, "scale_layout": args.scale_layout,
                    "weight_layout": args.weight_layout}
    for shape_name, shape in shapes.items():
        for fmt in args.formats:
            for settings in settings_of(fmt, moe_switches):
                result["moe"] += switched(settings, functools.partial(
                    bench_moe_format, fmt, shape_name, shape, args.tokens, ctx))
                save()
    if not args.no_linear:
        linear_switches = {"decode": args.nvfp4_decode, "w4a16_backend": args.w4a16_backend}
        for fmt in args.formats:
            for settings in settings_of(fmt, linear_switches):
                result["linear"] += switched(settings, functools.partial(
                    bench_linear, SMALL_LINEAR if args.small else LINEAR_SHAPES,
                    args.linear_tokens, {**ctx, "formats": [fmt]}))
                save()
    result["acceptance"] = acceptance(result["moe"], ctx["fp8_peak_tflops"])
    bad = [r for r in result["moe"] + result["linear"] if not r["finite"]]
    result["not_finite"] = [{k: r[k] for k in ("shape", "format", "tokens")} for r in bad]
    save()
    for a in result["acceptance"]:
        print(f"{a['shape']} {a['format']} T{a['tokens']}: {a['value']} {a['what']} "
              f"(target {a['target']}): {'pass' if a['pass'] else 'FAIL'}")
    print(f"wrote {path} ({result['seconds']} s); {len(bad)} outputs not finite")
    if bad:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
