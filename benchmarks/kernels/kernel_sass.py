"""A kernel compiled for the H200 (sm90) with no GPU: its SASS instruction mix, its shared
memory and whether its loads are pipelined (cp.async), for a tile config. This is a static look
before a GPU call, not a timing. The MoE and W4A16 kernels' builders are here, the attention
kernels' in kernel_sass_attention.py; this module's CLI takes them all.

The compile sees what a launch would. Pointers and every integer argument outside the kernel's
`do_not_specialize` list are taken as divisible by 16, which is what Triton's specialization
gives a model's sizes and row strides. Unit strides are 1. The kernels' own constexprs are as
their launchers pass them.

To match the GPU machine, put its Triton on the path first:

    pip install --target /tmp/tri36 --no-deps triton==3.6.0
    PYTHONPATH=/tmp/tri36:. python -m benchmarks.kernels.kernel_sass moe-quant --format nvfp4 \
        --tile 16 64 64 4 2
    PYTHONPATH=/tmp/tri36:. python -m benchmarks.kernels.kernel_sass moe --tile 64 64 64 4 3 \
        --one-dot --sub-m
    PYTHONPATH=/tmp/tri36:. python -m benchmarks.kernels.kernel_sass w4a16 --tile 16 64 128 4 4 \
        --split 4 --decode asm
    PYTHONPATH=/tmp/tri36:. python -m benchmarks.kernels.kernel_sass w4a16-dequant --micro
    PYTHONPATH=/tmp/tri36:. python -m benchmarks.kernels.kernel_sass moe-fp8-gluon --block-m 128

    PYTHONPATH=/tmp/tri36:. python -m benchmarks.kernels.kernel_sass mla-decode --tile 16 64 4 2 \
        --heads 64
    PYTHONPATH=/tmp/tri36:. python -m benchmarks.kernels.kernel_sass gqa-prefill --tile 128 64 4 3 \
        --heads 8
    PYTHONPATH=/tmp/tri36:. python -m benchmarks.kernels.kernel_sass topk --form coop --warps 8

--tile is BLOCK_M BLOCK_N BLOCK_K num_warps num_stages (mla-decode: BLOCK_M BLOCK_N num_warps
num_stages, BLOCK_M the heads a program). The report includes ptxas's registers a thread and
spilled bytes, whether ptxas serialized the wgmmas (`wgmma_serialized`) and the main loop's
wgmma waits (`loop_wgmma_waits`: the groups each leaves running). --nospec lists the integer
arguments taken as unspecialized; its default is the kernel's own list. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json

from benchmarks.kernels.kernel_sass_attention import (
    dsa_sparse,
    gqa,
    index_score,
    mla_decode,
    mla_decode_flat,
    mla_decode_gluon,
    mla_prefill,
    topk,
)
from benchmarks.kernels.sm90_compile import compile_sm90, nospec_of
from moeserve.kernels.moe.tile_configs import sub_heights


def moe_quant(args: argparse.Namespace) -> dict:
    from moeserve.kernels.linear import int4_tile, nvfp4_tile
    from moeserve.kernels.moe.quant import fused_triton

    bm, bn, bk, warps, stages = args.tile
    fmt = args.format
    weight = {"fp8": "*fp8e4nv", "nvfp4": "*u8", "int4": "*i32"}[fmt]
    scale = {"fp8": "*fp32", "nvfp4": "*fp8e4nv", "int4": "*bf16"}[fmt]
    pointers = {"a_ptr": "*fp8e4nv" if fmt == "fp8" else "*bf16", "as_ptr": "*fp32",
                "b_ptr": weight, "bs_ptr": scale, "bg_ptr": "*fp32",
                "c_ptr": "*fp8e4nv" if args.quant_out else "*bf16", "cs_ptr": "*fp32",
                "weights_ptr": "*fp32", "sorted_ids_ptr": "*i32", "expert_ids_ptr": "*i32"}
    const = dict(FORMAT=fused_triton.FORMAT_IDS[fmt],
                 GROUP={"fp8": 128, "nvfp4": 16, "int4": 32}[fmt],
                 SCALE_ROWS=128 if fmt == "fp8" else 1,
                 ONE_SCALE_ROW=fmt == "fp8" and 128 % bn == 0 and not args.row_scales,
                 A_ROW_DIV=8 if args.gated else 1,
                 GATED=args.gated, EVEN_K=True, DOT_PRECISION="tf32", NATIVE_FP8=True,
                 DECODE=(int4_tile.DECODES.index(args.decode or "reshape") if fmt == "int4"
                         else nvfp4_tile.DECODES.index(args.decode or "bits")
                         if fmt == "nvfp4" else 0),
                 PREFETCH=fmt == "fp8" and args.prefetch, QUANT_OUT=args.quant_out,
                 ACT_ROUND=1 if args.quant_out else 0, FP8_MAX=448.0, MIN_SCALE=1e-12,
                 BLOCK_M=bm, BLOCK_N=bn,
                 BLOCK_K=bk, GROUP_M=1, stride_bk=1,
                 MICRO={"fp8": 0, "nvfp4": 64, "int4": 16}[fmt] if args.micro else 0,
                 **sub_heights({"BLOCK_M": bm, "SUB_M": int(args.sub_m)}),
                 **({"stride_sn": 1} if args.k_major_scales else {"stride_sk": 1}))
    kernel = fused_triton._kernel()
    return compile_sm90(kernel, pointers, const, nospec_of(args, kernel), warps, stages)


def moe_fp8_gluon(args: argparse.Namespace) -> dict:
    """The FP8 MoE's Gluon grouped GEMM (kernels/moe/quant/fp8_gluon.py) at --block-m rows a
    program (its tile: fp8_gluon.tiles), gated or (--down) the down launch, at qwen3-30b-a3b's
    K (2,048 / 768)."""
    from moeserve.kernels.moe.quant import fp8_gluon

    if args.block_n:
        setattr(fp8_gluon, "gated_block_n" if args.gated else "down_block_n", args.block_n)
    t = fp8_gluon.tiles(args.block_m, args.gated)
    pointers = {"a_ptr": "*fp8e4nv", "as_ptr": "*fp32", "b_ptr": "*fp8e4nv", "bs_ptr": "*fp32",
                "c_ptr": "*bf16", "weights_ptr": "*fp32", "sorted_ids_ptr": "*i32",
                "expert_ids_ptr": "*i32"}
    const = dict(A_ROW_DIV=8 if args.gated else 1, GATED=args.gated, BLOCK_M=t["BLOCK_M"],
                 BLOCK_N=t["BLOCK_N"], STAGES=args.stages or t["STAGES"],
                 UNROLL=args.unroll or fp8_gluon.unroll(2048 if args.gated else 768,
                                                          t["wide"]),
                 ONE_DOT=args.one_dot,
                 SMEM_SCALES=fp8_gluon.smem_scales and not args.loaded_scales)
    kernel = fp8_gluon._kernels().moe
    return compile_sm90(kernel, pointers, const, nospec_of(args, kernel), t["num_warps"], 1)


def moe_fp8_gluon_ws(args: argparse.Namespace) -> dict:
    """The FP8 MoE's warp-specialized Gluon grouped GEMM (kernels/moe/quant/fp8_gluon_ws.py),
    gated (one dot) or (--down) the down launch, at qwen3-30b-a3b's K (2,048 / 768)."""
    from moeserve.kernels.moe.quant import fp8_gluon
    from moeserve.kernels.moe.quant import fp8_gluon_ws as ws

    t = fp8_gluon.tiles(ws.BLOCK_M, args.gated)
    pointers = {"a_ptr": "*fp8e4nv", "as_ptr": "*fp32", "b_ptr": "*fp8e4nv", "bs_ptr": "*fp32",
                "c_ptr": "*bf16", "weights_ptr": "*fp32", "sorted_ids_ptr": "*i32",
                "expert_ids_ptr": "*i32"}
    const = dict(A_ROW_DIV=8 if args.gated else 1, GATED=args.gated, BLOCK_N=t["BLOCK_N"],
                 STAGES=args.stages or ws.stages,
                 UNROLL=fp8_gluon.unroll(2048 if args.gated else 768, t["wide"]),
                 MATH_W=ws.MATH_WARPS, PRODUCER_W=ws.PRODUCER_WARPS,
                 PRODUCER_REGS=args.producer_regs or ws.PRODUCER_REGISTERS)
    kernel = ws._kernels().moe
    return compile_sm90(kernel, pointers, const, nospec_of(args, kernel), ws.MATH_WARPS, 1)


def moe_gluon_ws(args: argparse.Namespace) -> dict:
    """The bf16 MoE's warp-specialized Gluon grouped GEMM (kernels/moe/gluon_ws.py), gated
    (one dot) or (--down) the down launch, at --n-out columns (glm-4.7-flash's I 1,536 / H
    2,048 by default)."""
    from moeserve.kernels.moe import gluon_ws as ws

    bn = ws.block_n(args.n_out or (1536 if args.gated else 2048), args.gated)
    pointers = {"a_ptr": "*bf16", "b_ptr": "*bf16", "c_ptr": "*bf16", "weights_ptr": "*fp32",
                "sorted_ids_ptr": "*i32", "expert_ids_ptr": "*i32"}
    const = dict(A_ROW_DIV=8 if args.gated else 1, GATED=args.gated, BLOCK_N=bn,
                 STAGES=args.stages or ws.stages(2 * bn if args.gated else bn, 2),
                 MATH_W=ws.MATH_WARPS, PRODUCER_W=ws.PRODUCER_WARPS,
                 THREAD_ARRIVE=args.thread_arrive or ws.arrive_per_thread,
                 PRODUCER_REGS=args.producer_regs or ws.PRODUCER_REGISTERS)
    kernel = ws._kernels().moe
    return {"BLOCK_N": bn, "STAGES": const["STAGES"],
            **compile_sm90(kernel, pointers, const, nospec_of(args, kernel), ws.MATH_WARPS, 1)}


def moe_align_one(args: argparse.Namespace) -> dict:
    """The MoE align's three phases in one program (kernels/moe/align.py `_one_kernel`), at
    --experts experts and block height --block-m."""
    from moeserve.kernels.moe import align

    e_pow2 = 1 << (args.experts - 1).bit_length()
    pointers = {n: "*i32" for n in ("ids_ptr", "scratch_ptr", "sorted_ids_ptr",
                                    "expert_ids_ptr", "post_ptr")}
    const = dict(BLOCK_M=args.block_m, E_POW2=e_pow2, LOG2_E=(args.experts - 1).bit_length(),
                 CHUNK=align._ALIGN_CHUNK, FILL_CHUNK=align._ALIGN_CHUNK,
                 BLOCKS_CHUNK=align._ALIGN_BLOCKS_CHUNK)
    kernel = align._align_kernels().one
    return compile_sm90(kernel, pointers, const, nospec_of(args, kernel), 4, 1)


def moe(args: argparse.Namespace) -> dict:
    """The bf16 fused MoE (kernels/moe/fused_triton.py) at a tile, with its launch options
    (--one-dot: the gated launch's gate and up in one dot; --persistent; --sub-m)."""
    from moeserve.kernels.moe import fused_triton

    bm, bn, bk, warps, stages = args.tile
    pointers = {"a_ptr": "*bf16", "b_ptr": "*bf16", "c_ptr": "*bf16", "weights_ptr": "*fp32",
                "sorted_ids_ptr": "*i32", "expert_ids_ptr": "*i32", "post_padded_ptr": "*i32"}
    const = dict(A_ROW_DIV=8 if args.gated else 1, C_ROW_DIV=1, GATED=args.gated,
                 MUL_WEIGHT=not args.gated, ATOMIC=False, EVEN_K=True,
                 PERSISTENT=args.persistent, DOT_PRECISION="tf32", BLOCK_M=bm, BLOCK_N=bn,
                 BLOCK_K=bk, GROUP_M=1, B_WIDTH=bn * (2 if args.gated and args.one_dot else 1),
                 **sub_heights({"BLOCK_M": bm, "SUB_M": int(args.sub_m)}),
                 stride_ak=1, stride_bk=1, stride_cn=1)
    kernel = fused_triton._kernel()
    return compile_sm90(kernel, pointers, const, nospec_of(args, kernel), warps, stages)


def w4a16(args: argparse.Namespace) -> dict:
    from moeserve.kernels.linear import nvfp4_tile, w4a16_triton

    bm, bn, bk, warps, stages = args.tile
    pointers = {"x_ptr": "*bf16", "q_ptr": "*u8", "s_ptr": "*fp8e4nv", "g_ptr": "*fp32",
                "bias_ptr": "*bf16", "out_ptr": "*bf16" if args.split == 1 else "*fp32"}
    const = dict(NVFP4=True, GROUP=16, HAS_BIAS=False, DOT_PRECISION="tf32", NATIVE_FP8=True,
                 DECODE=nvfp4_tile.DECODES.index(args.decode or "bits"), BLOCK_M=bm, BLOCK_N=bn,
                 BLOCK_K=bk, SPLIT_K=args.split, EVEN_K=True, stride_xk=1, stride_qk=1,
                 stride_sk=1, stride_on=1)
    kernel = w4a16_triton._kernels().w4a16
    return compile_sm90(kernel, pointers, const, nospec_of(args, kernel), warps, stages)


def w4a16_dequant(args: argparse.Namespace) -> dict:
    """The W4A16 linear's many-token path (kernels/linear/w4a16_dequant.py): the dequantize
    kernel at its own tile (--micro: the experts' micro-tiles read in place), or with
    --epilogue `scale_columns`' kernel (NVFP4's global scale and a bias over fp32 [T, N])."""
    from moeserve.kernels.linear import w4a16_dequant as wd
    from moeserve.kernels.moe.quant.micro_tiles import TILE_BYTES

    kern = wd._kernels()
    if args.epilogue:
        pointers = {"acc_ptr": "*fp32", "g_ptr": "*fp32", "bias_ptr": "*bf16", "out_ptr": "*bf16"}
        const = dict(HAS_G=True, HAS_BIAS=True, BLOCK_T=wd._EPILOGUE_T, BLOCK_N=wd._EPILOGUE_N)
        return compile_sm90(kern.scale_columns, pointers, const,
                            nospec_of(args, kern.scale_columns), 4, 1)
    nvfp4 = args.format == "nvfp4"
    pointers = {"q_ptr": "*u8" if nvfp4 else "*i32", "s_ptr": "*fp8e4nv" if nvfp4 else "*bf16",
                "g_ptr": "*fp32", "out_ptr": "*bf16"}
    const = dict(NVFP4=nvfp4, GROUP=16 if nvfp4 else 32, NATIVE_FP8=True, HAS_GLOBAL=nvfp4,
                 BLOCK_N=wd._BLOCK_N, BLOCK_K=wd._BLOCK_K, PER_WORD=8,
                 MICRO=(TILE_BYTES if nvfp4 else TILE_BYTES // 4) if args.micro else 0,
                 stride_qk=1, stride_sk=1, stride_ok=1)  # unit strides: 1, as a launch has them
    return compile_sm90(kern.dequant, pointers, const, nospec_of(args, kern.dequant), 4, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="kernel", required=True)
    for name in ("moe", "moe-quant", "w4a16"):
        p = sub.add_parser(name)
        p.add_argument("--tile", type=int, nargs=5, required=True,
                       metavar=("BM", "BN", "BK", "WARPS", "STAGES"))
        p.add_argument("--decode", choices=("bits", "asm", "reshape", "planes", "planes-asm"),
                       default=None, help="nvfp4: bits (default) or asm; int4: reshape "
                       "(default) or planes")
        p.add_argument("--nospec", nargs="*", help="integer arguments left unspecialized")
        if name == "moe":
            p.add_argument("--down", dest="gated", action="store_false",
                           help="the down launch (default: the gated one)")
            p.add_argument("--one-dot", action="store_true", help="the ONE_DOT option")
            p.add_argument("--persistent", action="store_true", help="the PERSISTENT option")
            p.add_argument("--sub-m", action="store_true", help="the SUB_M option")
        if name == "moe-quant":
            p.add_argument("--format", choices=("fp8", "nvfp4", "int4"), default="nvfp4")
            p.add_argument("--down", dest="gated", action="store_false",
                           help="the down launch (default: the gated one)")
            p.add_argument("--micro", action="store_true",
                           help="4-bit weights in micro-tiles (kernels/moe/quant/micro_tiles.py)")
            p.add_argument("--k-major-scales", action="store_true",
                           help="the group scales N-fastest (kernels_quant --scale-layout "
                           "k-major): stride_sn 1, not stride_sk")
            p.add_argument("--row-scales", action="store_true",
                           help="fp8: a weight scale per row loaded (not one per tile)")
            p.add_argument("--prefetch", action="store_true",
                           help="fp8: the scales loaded a K step ahead (prefetch_scales)")
            p.add_argument("--sub-m", action="store_true",
                           help="the SUB_M option: half and quarter tiles beside BLOCK_M's")
            p.add_argument("--quant-out", action="store_true",
                           help="fp8, gated: act quantized in the epilogue (quant/act_quant.py)")
        else:
            p.add_argument("--split", type=int, default=1, help="SPLIT_K")
    for name in ("mla-decode", "mla-decode-gluon", "mla-decode-flat", "mla-prefill",
                 "dsa-sparse", "gqa-prefill", "gqa-decode"):
        p = sub.add_parser(name)
        p.add_argument("--tile", type=int, nargs=4, required=True,
                       metavar=("BM", "BN", "WARPS", "STAGES"))
        p.add_argument("--heads", type=int, default=64)
        p.add_argument("--block-size", type=int, default=16)
        p.add_argument("--nospec", nargs="*", help="integer arguments left unspecialized")
        if name in ("mla-decode", "mla-decode-gluon", "gqa-decode"):
            p.add_argument("--split", action="store_true", help="the split-K variant")
        if name == "mla-decode-gluon":
            p.add_argument("--overlap", action="store_true",
                           help="the next tile's scores during this tile's softmax")
            p.add_argument("--sparse", action="store_true",
                           help="DSA's sparse MLA over packed selections (sparse_gluon)")
            p.add_argument("--prefill", action="store_true",
                           help="the absorbed prefill over query tiles (prefill_gluon)")
            p.add_argument("--swapped", action="store_true",
                           help="decode_gluon_swapped's kernel (keys as M, <= 32 heads)")
            p.add_argument("--ws", action="store_true",
                           help="decode_gluon_ws's kernel (warp-specialized, 64 heads a "
                                "program)")
            p.add_argument("--vector-stores", action="store_true",
                           help="the outputs stored in 16-byte vectors (VEC_STORE)")
        if name.startswith(("mla-", "dsa-")):
            p.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto",
                           help="fp8: the float8 e4m3 latent cache's variant")
        if name in ("dsa-sparse", "mla-decode-gluon"):
            p.add_argument("--slots", action="store_true",
                           help="the selection given as cache rows (sparse_triton.slot_rows; "
                                "mla-decode-gluon: with --sparse)")
    p = sub.add_parser("moe-fp8-gluon")
    p.add_argument("--block-m", type=int, default=128, choices=(64, 128))
    p.add_argument("--stages", type=int, default=None, help="default: fp8_gluon.tiles'")
    p.add_argument("--unroll", type=int, default=None, help="default: fp8_gluon.unroll's")
    p.add_argument("--loaded-scales", action="store_true",
                   help="each step's scales loaded in the step, not through its shared-memory "
                   "stage (default: fp8_gluon.smem_scales)")
    p.add_argument("--one-dot", action="store_true",
                   help="gated: gate and up rows in one tile (fp8_gluon.one_dot)")
    p.add_argument("--block-n", type=int, default=None,
                   help="the launch's N tile (fp8_gluon.gated_block_n / down_block_n)")
    p.add_argument("--down", dest="gated", action="store_false",
                   help="the down launch (default: the gated one)")
    p.add_argument("--nospec", nargs="*", help="integer arguments left unspecialized")
    p = sub.add_parser("moe-fp8-gluon-ws")
    p.add_argument("--stages", type=int, default=None, help="default: fp8_gluon_ws.stages")
    p.add_argument("--producer-regs", type=int, default=None,
                   help="the producer's registers (default: fp8_gluon_ws.PRODUCER_REGISTERS)")
    p.add_argument("--down", dest="gated", action="store_false",
                   help="the down launch (default: the gated one)")
    p.add_argument("--nospec", nargs="*", help="integer arguments left unspecialized")
    p = sub.add_parser("moe-gluon-ws")
    p.add_argument("--stages", type=int, default=None, help="default: gluon_ws.stages'")
    p.add_argument("--producer-regs", type=int, default=None,
                   help="the producer's registers (default: gluon_ws.PRODUCER_REGISTERS)")
    p.add_argument("--n-out", type=int, default=None, help="the launch's N (its tile: "
                   "gluon_ws.block_n)")
    p.add_argument("--thread-arrive", action="store_true",
                   help="each math thread arrives on a stage's empty barrier "
                   "(gluon_ws.arrive_per_thread)")
    p.add_argument("--down", dest="gated", action="store_false",
                   help="the down launch (default: the gated one)")
    p.add_argument("--nospec", nargs="*", help="integer arguments left unspecialized")
    p = sub.add_parser("moe-align-one")
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--block-m", type=int, default=16)
    p.add_argument("--nospec", nargs="*", help="integer arguments left unspecialized")
    p = sub.add_parser("w4a16-dequant")
    p.add_argument("--format", choices=("nvfp4", "int4"), default="nvfp4")
    p.add_argument("--micro", action="store_true", help="the weights in micro-tiles")
    p.add_argument("--epilogue", action="store_true",
                   help="scale_columns' kernel instead of the dequantize kernel")
    p.add_argument("--nospec", nargs="*", help="integer arguments left unspecialized")
    p = sub.add_parser("index-score")
    p.add_argument("--block-q", type=int, default=1, help="tokens a program (1: decode)")
    p.add_argument("--key-tiles", type=int, default=8)
    p.add_argument("--warps", type=int, default=4)
    p.add_argument("--stages", type=int, default=3)
    p.add_argument("--nospec", nargs="*", help="integer arguments left unspecialized")
    p = sub.add_parser("topk")
    p.add_argument("--form", choices=("coop", "row", "bisect", "hist", "count", "write",
                                      "gather", "last_levels"), default="coop")
    p.add_argument("--gather", action="store_true",
                   help="the row or coop form with topk_triton.GATHER (gather and "
                        "last_levels: the chunks form's kernels of it)")
    p.add_argument("--block", type=int, default=2048, help="positions a step (or a chunk)")
    p.add_argument("--warps", type=int, default=8)
    p.add_argument("--nospec", nargs="*", help="integer arguments left unspecialized")
    args = parser.parse_args()
    report = {"topk": topk, "index-score": index_score, "moe": moe, "moe-quant": moe_quant,
              "moe-align-one": moe_align_one, "moe-fp8-gluon": moe_fp8_gluon,
              "moe-fp8-gluon-ws": moe_fp8_gluon_ws, "moe-gluon-ws": moe_gluon_ws, "w4a16": w4a16,
              "w4a16-dequant": w4a16_dequant, "mla-decode": mla_decode,
              "mla-decode-gluon": mla_decode_gluon, "mla-decode-flat": mla_decode_flat,
              "mla-prefill": mla_prefill, "dsa-sparse": dsa_sparse, "gqa-prefill": gqa,
              "gqa-decode": gqa}[args.kernel](args)
    print(json.dumps({"kernel": args.kernel, **{k: v for k, v in vars(args).items()
                                               if k != "kernel"}, **report}))


if __name__ == "__main__":
    main()
