"""The FP8 (W8A8, 128 x 128 block scales) grouped GEMM of the fused MoE in Gluon, for Hopper:
`launch`, one launch of fused_triton.py's data flow (gated: act = silu(x W_gate^T) * x W_up^T;
down: out = w * act W2^T), over the same sorted row blocks, A rows gathered the same way.

Why a second kernel: every K step of a block-scaled product is scaled on its own,
acc += dot(a_k, b_k) * s_a[row, k] * s_b[k], and Triton waits for each step's wgmma before
that multiply (sm90 SASS, Triton 3.6: `WARPGROUP.DEPBAR.LE gsb0, 0x0` right after the step's
QGMMAs, also with the product consumed one step late or two dots a step), so a program's
tensor cores idle through each step's scaling, its barrier and its next loads: at 8,192 tokens
the Triton kernel reaches 446-458 TFLOP/s, 32-33% of the H200's FP8 peak
(benchmarks/results/gpu_04e1157/). Here the products are promoted one step late (DeepGEMM's
way): step k's wgmmas are issued into fresh accumulators, then step k - 1's are retired
(`warpgroup_mma_wait(2)`) and added, scaled, to the fp32 accumulators while step k's run.

A program: row block b (BLOCK_M sorted pairs, one expert) x N tile n; BLOCK_M 64 (4 warps,
one warpgroup) or 128 (8 warps, two). A [BLOCK_M, 128] e4m3 rows (x_q's token rows, or act_q's
pair rows) and B [BLOCK_N, 128] weight rows (gate and up tiles apart when gated, or
interleaved in one with `one_dot`) reach shared memory by cp.async, STAGES deep; the copies
for step k + STAGES - 2 go out after step k's CTA barrier, into the stage step k - 2's wgmmas
read (every warpgroup retired those by then). Scales: s_a [rows, K / 128] fp32 per row and
step, s_b [E, N / 128, K / 128] one scalar a step per tile (the tile in one 128-row block),
copied with the step's operands into its stage (`smem_scales`, the default; else loaded the
step before its products are added). Two product sets alternate, UNROLL steps
an iteration, the last retired in it (`unroll`; the kernel's comment says why ptxas needs
that).

Bounds: CUDA sm90, N a multiple of 128, K's 128-steps an even count, 128-row weight scales
(`supports`). fused_triton.py's `_launch` calls it for fp8 where `backend` hands it the
launch (`takes`; "gluon", the default, both), BLOCK_M is 64 or 128 and `supports` holds
(timed: benchmarks/h200/fp8_gluon_h200.sh, fp8_act_quant_h200.sh, fp8_scales_w1_h200.sh).
quant/tune.py times one candidate of each row-block height it takes (`distinct_candidates`:
it reads no other tile key) where `takes_every_launch` holds.

What holds it (and Triton's kernel) near a third of the FP8 peak at 8,192 tokens (Nsight
Compute, gpu_ae64d49/call1 on the H200): not the issue slots (26-38% busy) nor DRAM (20-24%)
but latency at two warps a scheduler, long-scoreboard stalls first (the scale loads in the
loop, the down launch's six-step programs' dependent start), then fixed-latency waits.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

import torch

from moeserve.quant.packed import FP8_GROUP

gl: Any = None  # triton.experimental.gluon.language, bound by _kernels()
async_copy: Any = None
fence_async_shared: Any = None
warpgroup_mma: Any = None
warpgroup_mma_wait: Any = None

BLOCK_K = FP8_GROUP  # one scale column a step
# The switch (kernels_quant --fp8-moe): "triton" keeps fused_triton's kernel; "gluon" takes
# this one wherever `supports` holds and the looked-up BLOCK_M is 64 or 128; "gluon-128" also
# makes every FP8 op's row blocks 128 high (the align's too); "gluon-down" takes only the down
# launch (the gated one stays Triton's, whose epilogue can quantize act: fused_triton's
# fuse_act_quant). "gluon" by default: on an H100 (benchmarks/results/gpu_6433006/call1,
# gpu_9d50325/call1) qwen3-30b-a3b's experts at 1,024 tokens 0.313-0.318 ms against Triton's
# 0.332-0.338 (5-7%), at 8,192 1.358-1.378 against 1.366-1.386, GLM-5's at 8,192 9.12-9.50
# against 10.02, 1,024 level; below ~512 tokens the looked-up row blocks are 16-32 high and
# Triton's kernel runs.
backend = "gluon"
BACKENDS = ("triton", "gluon", "gluon-128", "gluon-down", "gluon-ws")
# "gluon-ws": fp8_gluon_ws.py's warp-specialized kernel (loads in their own warps, STAGES
# ahead), 128-row blocks as with "gluon-128"; an experiment, slower in both of its
# forms (fp8_gluon_ws.py says by how much)
# The gated launch's gate and up rows interleaved in one weight tile, one wgmma a step reading
# A once (two: A read for each; kernels_quant --fp8-gluon-dot). One by default: level or ahead
# on an H100 (gpu_6433006/call1: 8,192 tokens 1.358 against 1.371 ms, 1,024 0.318 / 0.320).
one_dot = True
# The launches' N tiles (switches, untimed). ptxas serializes every wgmma when a product set
# stays in flight across the loop's back edge while another runs (sm90, Triton 3.6), so each
# UNROLL steps end in a drain, and UNROLL is 2 where the three product sets take 192
# registers (4 spills): 128 accumulator columns a row. Down: 128 (one m64n128 wgmma a step, A
# read once per 128 output columns; 239-250 registers at UNROLL 2) or 64 (UNROLL 4).
# Gated: 64 (gate and up 64 each; 246-252 registers at UNROLL 2) or 32 (with one_dot one
# m64n64 wgmma a step over 32 gate and 32 up rows; ~200 registers at UNROLL 4).
down_block_n = 128
gated_block_n = 64
# Shared-memory stages (a switch, untimed): step k + STAGES - 2's copies go out at step k, so
# 4 keeps two steps of loads in flight; 24 KB a stage at 64 rows (32 KB at 128), so 4 lets two
# 64-row programs share an SM and 5 or 6 hold one further ahead.
stages = 4
# Each step's scales (the rows' and the tile's) copied into its shared-memory stage with its
# operands (cp.async, STAGES - 2 steps ahead) and read from there, not loaded from global
# memory in the step that uses them: the long-scoreboard stalls Nsight Compute puts first
# (gpu_ae64d49/call1). On (kernels_quant --fp8-gluon-scales global smem): on an H100
# (benchmarks/results/gpu_106c118/call1) qwen3-30b-a3b's experts at 8,192 tokens 1.302
# against 1.366 ms, at 1,024 level (0.315 / 0.312); the same bits.
smem_scales = True


def block_m(config: dict) -> int:
    """The op's row-block height under the switch: 128 with "gluon-128" and "gluon-ws", else
    the config's."""
    if backend not in BACKENDS:
        raise ValueError(f"fp8_gluon.backend {backend!r} is not one of {BACKENDS}")
    return 128 if backend in ("gluon-128", "gluon-ws") else config["BLOCK_M"]


def takes(gated: bool) -> bool:
    """Whether the switch hands this launch (gated or down) to this kernel, where `supports`
    holds and the row blocks are 64 or 128 high (fused_triton's `_gluon_takes`)."""
    block_m({"BLOCK_M": 0})  # the switch's value checked
    return backend != "triton" and (backend != "gluon-down" or not gated)


def takes_every_launch(hidden: int, inter: int, scale_rows: int,
                       device: torch.device) -> bool:
    """Whether both of an op's launches run this kernel (or fp8_gluon_ws's) wherever its row
    blocks are 64 or 128 high: a switch value that hands it both, an sm90 device, `supports`'
    shape rules for the gated ([E, 2I, H]) and down ([E, H, I]) weights."""
    return (backend in ("gluon", "gluon-128", "gluon-ws") and device.type == "cuda"
            and torch.cuda.get_device_capability(device) == (9, 0) and scale_rows == 128
            and hidden % 128 == 0 and inter % 128 == 0
            and unroll(hidden, False) > 0 and unroll(inter, False) > 0)


def distinct_candidates(configs: list[dict]) -> list[dict]:
    """configs less those that launch the same kernels as one before them, where
    `takes_every_launch` holds: of a row-block height this kernel takes (`block_m`: 64 or 128)
    the first only, since it reads no other key (BLOCK_N, warps, stages, GROUP_M, SUB_M and
    a "down" entry are Triton's tiles); the other heights' configs all kept (quant/tune.py's
    FP8 grid: half its candidates at 1,024 tokens and more were one op timed again)."""
    seen: set[int] = set()
    kept = []
    for config in configs:
        height = block_m(config)
        if height in (64, 128):
            if height in seen:
                continue
            seen.add(height)
        kept.append(config)
    return kept


def unroll(k_dim: int, wide: bool) -> int:
    """The K steps an iteration of the kernel's loop, each iteration's last retired inside it
    (0: K's steps of 128 are not even): 2 where the accumulators span 128 columns a row
    (`wide`: three product sets take 192 registers a thread, and spill from 4), else 4 where
    it divides the steps, else 2 (sm90 compile, Triton 3.6: 64 columns spill at 8 with 64-row
    blocks)."""
    steps = k_dim // BLOCK_K if k_dim % BLOCK_K == 0 else 0
    return next((u for u in ((2,) if wide else (4, 2)) if steps and steps % u == 0), 0)


def supports(a: torch.Tensor, a_scale: torch.Tensor, w: Any, scale_rows: int,
             gated: bool) -> bool:
    """Whether this kernel runs the launch: CUDA sm90 (wgmma), N a multiple of 128, K's steps
    of 128 an even count, the weights' scales in 128-row blocks (a tile's rows share one) and
    every tensor's last dimension contiguous."""
    n_out = w.shape[1] // 2 if gated else w.shape[1]
    return (a.device.type == "cuda" and torch.cuda.get_device_capability(a.device) == (9, 0)
            and n_out % 128 == 0 and unroll(w.shape[2], False) > 0 and scale_rows == 128
            and a.stride(1) == 1 and a_scale.stride(1) == 1 and w.qweight.stride(2) == 1
            and w.scale.stride(2) == 1)


def tiles(block_m: int, gated: bool) -> dict[str, int]:
    """The launch's tile for fused_triton's BLOCK_M: BLOCK_N `gated_block_n` gated (its gate
    and up halves each; one_dot's weight tile twice as many rows), `down_block_n` down; 4
    `stages`; 4 warps for 64 rows, 8 for 128; UNROLL by the accumulators' width (`unroll`)."""
    if block_m not in (64, 128):
        raise ValueError(f"fp8_gluon: BLOCK_M {block_m} is not 64 or 128")
    if stages not in (3, 4, 5, 6):
        raise ValueError(f"fp8_gluon.stages {stages} is not 3, 4, 5 or 6")
    block_n = gated_block_n if gated else down_block_n
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "STAGES": stages, "num_warps": block_m // 16,
            "wide": (2 * block_n if gated else block_n) >= 128}


def launch(a: torch.Tensor, a_scale: torch.Tensor, w: Any, c: torch.Tensor,
           topk_weights: torch.Tensor, sorted_ids: torch.Tensor, expert_ids: torch.Tensor,
           num_pairs: int, block_m: int, *, a_row_div: int, gated: bool) -> None:
    """One grouped GEMM (fused_triton._launch's contract, fp8): c[pair] = a[row] @ w[e].T
    scaled by the blocks' scales; gated: c[pair, n] = silu(gate) * up, else times the pair's
    routing weight. a: [rows, K] e4m3, a_scale [rows, K / 128] fp32; w: fp8 QuantWeight
    ([E, N (x 2 gated), K] e4m3, scale [E, N / 128, K / 128] fp32)."""
    if backend == "gluon-ws" and block_m == 128:
        from moeserve.kernels.moe.quant import fp8_gluon_ws

        fp8_gluon_ws.launch(a, a_scale, w, c, topk_weights, sorted_ids, expert_ids, num_pairs,
                            a_row_div=a_row_div, gated=gated)
        return
    n_out = w.shape[1] // 2 if gated else w.shape[1]
    k_dim = w.shape[2]
    qweight, scale = w.qweight, w.scale
    t = tiles(block_m, gated)
    num_blocks = expert_ids.shape[0]
    grid = (num_blocks * (n_out // t["BLOCK_N"]),)
    _kernels().moe[grid](
        a, a_scale, qweight, scale, c, topk_weights, sorted_ids, expert_ids,
        num_pairs, n_out, k_dim, a.stride(0), a_scale.stride(0),
        qweight.stride(0), qweight.stride(1), scale.stride(0), scale.stride(1), c.stride(0),
        A_ROW_DIV=a_row_div, GATED=gated, BLOCK_M=t["BLOCK_M"], BLOCK_N=t["BLOCK_N"],
        STAGES=t["STAGES"], UNROLL=unroll(k_dim, t["wide"]), ONE_DOT=one_dot,
        SMEM_SCALES=smem_scales,
        num_warps=t["num_warps"])


@functools.cache
def _kernels() -> SimpleNamespace:
    """Jit the kernel on first use (gluon imported here only), with the Hopper builtins it
    calls bound as module globals (where the compiler resolves names)."""
    global gl, async_copy, fence_async_shared, warpgroup_mma, warpgroup_mma_wait
    global _moe_fp8_kernel, _copy_step, _issue, _promote, _scales, _program_tile
    from triton.experimental import gluon
    from triton.experimental.gluon import language
    from triton.experimental.gluon.language.nvidia import hopper

    gl = language
    async_copy, fence_async_shared = hopper.async_copy, hopper.fence_async_shared
    warpgroup_mma, warpgroup_mma_wait = hopper.warpgroup_mma, hopper.warpgroup_mma_wait
    _copy_step, _issue, _promote, _scales, _program_tile = (
        gluon.jit(f) for f in (_copy_step, _issue, _promote, _scales, _program_tile))
    _moe_fp8_kernel = gluon.jit(do_not_specialize=["num_pairs"])(_moe_fp8_kernel)
    return SimpleNamespace(moe=_moe_fp8_kernel)


# ---- Gluon functions (jitted by _kernels; module globals, where the compiler finds names) ----

def _copy_step(k, num_k, a_rows, a_ok, dk, b_rows, b_up_rows, a_ptr, b_ptr, a_dst, b_dst,
               bu_dst, sc, as_dst, ws_dst, GATED: gl.constexpr, SMEM_SCALES: gl.constexpr):
    """Step k's copies (cp.async; none past the last step: zero-filled, nothing read): the
    A rows' 128 K columns, the weight tile's rows (and the up tile's when gated); with
    SMEM_SCALES also the step's scales, the rows' (sc[0]: their pointers) into as_dst and
    the tile's gate and up ones (sc[1], masked by sc[2]) into ws_dst."""
    live = k < num_k
    k0 = k * 128
    if SMEM_SCALES:
        async_copy.async_copy_global_to_shared(as_dst, sc[0] + k, mask=a_ok & live)
        async_copy.async_copy_global_to_shared(ws_dst, sc[1] + k, mask=sc[2] & live)
    async_copy.async_copy_global_to_shared(a_dst, a_ptr + a_rows[:, None] + k0 + dk[None, :],
                                           mask=a_ok[:, None] & live)
    async_copy.async_copy_global_to_shared(b_dst, b_ptr + b_rows[:, None] + k0 + dk[None, :],
                                           mask=(b_rows >= 0)[:, None] & live)
    if GATED:
        async_copy.async_copy_global_to_shared(
            bu_dst, b_ptr + b_up_rows[:, None] + k0 + dk[None, :],
            mask=(b_up_rows >= 0)[:, None] & live)


def _issue(k, num_k, a_rows, a_ok, dk, b_rows, b_up_rows, a_ptr, b_ptr, a_s, b_s, bu_s, r,
           r_up, sc, as_s, ws_s, STAGES: gl.constexpr, GATED: gl.constexpr,
           SMEM_SCALES: gl.constexpr):
    """Step k: wait for its copies (every thread's: a CTA barrier, which also means every
    warpgroup retired step k - 2's wgmmas), send out step k + STAGES - 2's into the stage
    step k - 2 read, and issue step k's wgmmas into fresh accumulators in r's (r_up's)
    registers (the up tile's too when gated; else the second is the first). Returns their
    tokens."""
    async_copy.wait_group(STAGES - 3)
    gl.thread_barrier()
    fence_async_shared()
    ahead = k + STAGES - 2
    _copy_step(ahead, num_k, a_rows, a_ok, dk, b_rows, b_up_rows, a_ptr, b_ptr,
               a_s.index(ahead % STAGES), b_s.index(ahead % STAGES),
               bu_s.index(ahead % STAGES if GATED else 0), sc,
               as_s.index(ahead % STAGES if SMEM_SCALES else 0),
               ws_s.index(ahead % STAGES if SMEM_SCALES else 0), GATED, SMEM_SCALES)
    async_copy.commit_group()
    st = k % STAGES
    d = warpgroup_mma(a_s.index(st), b_s.index(st).permute((1, 0)), r, use_acc=False,
                      is_async=True)
    d_up = d
    if GATED:
        d_up = warpgroup_mma(a_s.index(st), bu_s.index(st).permute((1, 0)), r_up,
                             use_acc=False, is_async=True)
    return d, d_up


def _promote(acc, acc_up, d, d_up, s_row, s_row_up, AFTER: gl.constexpr, GATED: gl.constexpr,
             ONE_DOT: gl.constexpr, col_gate):
    """Retire the step whose tokens d (d_up) are, leaving the AFTER steps issued since in
    flight, and add its products to the accumulators, each row scaled by s_row (s_row_up).
    Returns the accumulators and the retired products (whose registers the set's next step
    writes)."""
    if GATED:
        d, d_up = warpgroup_mma_wait(num_outstanding=2 * AFTER, deps=(d, d_up))
        acc += d * s_row[:, None]
        acc_up += d_up * s_row_up[:, None]
    else:
        d = warpgroup_mma_wait(num_outstanding=AFTER, deps=(d,))
        if ONE_DOT:  # even columns gate, odd up: each its row scale
            acc += d * gl.where(col_gate[None, :], s_row[:, None], s_row_up[:, None])
        else:
            acc += d * s_row[:, None]
        d_up = d
    return acc, acc_up, d, d_up


def _program_tile(expert_ids_ptr, N, BLOCK_N: gl.constexpr):
    """This program's row block b, its N tile's first column n0 and the block's expert e
    (-1 past the used blocks)."""
    num_n = N // BLOCK_N
    pid = gl.program_id(0)
    b = pid // num_n
    return b, (pid % num_n) * BLOCK_N, gl.load(expert_ids_ptr + b)


def _scales(as_rows, row_ok, s_gate, s_up, k, as_s, ws_s, GATED: gl.constexpr,
            SMEM_SCALES: gl.constexpr, STAGES: gl.constexpr, ROW_L: gl.constexpr,
            W_L: gl.constexpr):
    """Step k's scale a row: its activation scale times the tile's weight scale (the up
    tile's own when gated; else the second is the first). SMEM_SCALES: read from the step's
    stage (copied with its operands, STAGES - 2 steps ahead), else loaded from global memory
    here."""
    if SMEM_SCALES:
        st = k % STAGES
        s_a = as_s.index(st).load(ROW_L)
        w = ws_s.index(st).load(W_L)  # [2]: gate, up
        first = gl.arange(0, 2, layout=W_L) == 0
        s_row = s_a * gl.sum(gl.where(first, w, 0.0), axis=0)
        s_row_up = s_row
        if GATED:
            s_row_up = s_a * gl.sum(gl.where(first, 0.0, w), axis=0)
    else:
        s_a = gl.load(as_rows + k, mask=row_ok, other=0.0)
        s_row = s_a * gl.load(s_gate + k)
        s_row_up = s_row
        if GATED:
            s_row_up = s_a * gl.load(s_up + k)
    return s_row, s_row_up


def _moe_fp8_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, weights_ptr, sorted_ids_ptr,
                    expert_ids_ptr, num_pairs, N, K, stride_am, stride_asm, stride_be,
                    stride_bn, stride_se, stride_sn, stride_cm,
                    A_ROW_DIV: gl.constexpr, GATED: gl.constexpr, BLOCK_M: gl.constexpr,
                    BLOCK_N: gl.constexpr, STAGES: gl.constexpr, UNROLL: gl.constexpr,
                    ONE_DOT: gl.constexpr, SMEM_SCALES: gl.constexpr = False):
    """Program (row block b, N tile n): the module docstring's loop and epilogue. ONE_DOT
    (gated): the gate and up rows interleaved in one [2 BLOCK_N, 128] weight tile (row 2j
    gate n0 + j, 2j + 1 up), one wgmma a step reading A once, not two."""
    W: gl.constexpr = BLOCK_M // 16  # warps: 16 rows each, four a warpgroup
    TWO: gl.constexpr = GATED and not ONE_DOT  # two dots a step, gate and up
    ONE: gl.constexpr = GATED and ONE_DOT  # one dot, gate and up rows interleaved
    WIDE: gl.constexpr = 2 * BLOCK_N if ONE else BLOCK_N  # a dot's N
    # copies: 16-byte vectors, a row's 128 bytes over 8 threads
    cp_l: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [W, 1], [1, 0])
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[W, 1],
                                                    instr_shape=[16, WIDE, 32])
    a_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, 128], gl.float8e4nv)
    b_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([WIDE, 128], gl.float8e4nv)
    a_s = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_M, 128], a_sl)
    b_s = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, WIDE, 128], b_sl)
    bu_s = gl.allocate_shared_memory(gl.float8e4nv, [STAGES if TWO else 1, WIDE, 128], b_sl)
    # SMEM_SCALES: each stage's scales, the rows' [BLOCK_M] and the tile's gate and up [2]
    row_l: gl.constexpr = gl.SliceLayout(1, acc_l)
    w_l: gl.constexpr = gl.BlockedLayout([2], [32], [W], [0])
    sc_sl: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])  # a stage's, indexed
    as_s = gl.allocate_shared_memory(gl.float32, [STAGES if SMEM_SCALES else 1, BLOCK_M],
                                     sc_sl)
    ws_s = gl.allocate_shared_memory(gl.float32, [STAGES if SMEM_SCALES else 1, 2], sc_sl)

    b, n0, e = _program_tile(expert_ids_ptr, N, BLOCK_N)
    if e >= 0:  # blocks past the used ones: expert -1
        num_k = K // 128
        # A rows (pairs' tokens; padding rows past num_pairs zero-filled) in the copies' layout
        rc = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, cp_l))
        pair_c = gl.load(sorted_ids_ptr + b * BLOCK_M + rc)
        a_ok = pair_c < num_pairs
        a_rows = (pair_c // A_ROW_DIV).to(gl.int64) * stride_am
        dk = gl.arange(0, 128, layout=gl.SliceLayout(0, cp_l))
        nc = gl.arange(0, WIDE, layout=gl.SliceLayout(1, cp_l))
        w_base = e.to(gl.int64) * stride_be
        if ONE:  # row 2j: gate n0 + j; 2j + 1: up
            b_rows = w_base + (n0 + nc // 2 + (nc % 2) * N).to(gl.int64) * stride_bn
        else:
            b_rows = w_base + (n0 + nc).to(gl.int64) * stride_bn
        b_up_rows = w_base + (N + n0 + nc).to(gl.int64) * stride_bn  # unused unless TWO

        # the rows' scales in the accumulator's row layout; the weights' a scalar a step
        ra = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, acc_l))
        pair_a = gl.load(sorted_ids_ptr + b * BLOCK_M + ra)
        row_ok = pair_a < num_pairs
        as_rows = as_ptr + (pair_a // A_ROW_DIV).to(gl.int64) * stride_asm
        s_gate = bs_ptr + e.to(gl.int64) * stride_se + (n0 // 128) * stride_sn
        s_up = bs_ptr + e.to(gl.int64) * stride_se + ((N + n0) // 128) * stride_sn
        # SMEM_SCALES' copies: the rows' scale pointers in the A copies' row layout; the
        # tile's gate and up scale pointers (the up one only when gated)
        wi = gl.arange(0, 2, layout=w_l)
        sc = (as_ptr + (pair_c // A_ROW_DIV).to(gl.int64) * stride_asm,
              gl.where(wi == 0, s_gate, s_up), (wi == 0) | GATED)

        for j in gl.static_range(STAGES - 2):  # the first steps in flight
            _copy_step(j, num_k, a_rows, a_ok, dk, b_rows, b_up_rows, a_ptr, b_ptr,
                       a_s.index(j), b_s.index(j), bu_s.index(j if TWO else 0), sc,
                       as_s.index(j if SMEM_SCALES else 0),
                       ws_s.index(j if SMEM_SCALES else 0), TWO, SMEM_SCALES)
            async_copy.commit_group()

        zero = gl.zeros([BLOCK_M, WIDE], gl.float32, layout=acc_l)
        acc = zero
        acc_up = zero
        # ONE_DOT: the columns' weight scale by parity (even gate, odd up)
        col_gate = gl.arange(0, WIDE, layout=gl.SliceLayout(0, acc_l)) % 2 == 0
        # two accumulator sets, A (even steps) and B (odd), by turns, UNROLL steps an
        # iteration: step k's wgmmas run while step k - 1's products are added, scaled, and
        # each writes its set's registers of two steps before (retired and added by then,
        # passed as the unused accumulator). The last step of an iteration is retired in it:
        # ptxas serializes every wgmma of the kernel when a non-wgmma instruction copies or
        # zeroes an accumulator register while a wgmma runs (C7514 / C7515), as the phi of a
        # token in flight across the loop's back edge does.
        r_a = zero
        ru_a = zero
        r_b = gl.zeros([BLOCK_M, WIDE], gl.float32, layout=acc_l)
        ru_b = gl.zeros([BLOCK_M, WIDE], gl.float32, layout=acc_l)
        for it in range(num_k // UNROLL):
            for p in gl.static_range(UNROLL // 2):
                k = it * UNROLL + 2 * p
                d_a, du_a = _issue(k, num_k, a_rows, a_ok, dk, b_rows, b_up_rows, a_ptr, b_ptr,
                                   a_s, b_s, bu_s, r_a, ru_a, sc, as_s, ws_s, STAGES, TWO,
                                   SMEM_SCALES)
                s_a, su_a = _scales(as_rows, row_ok, s_gate, s_up, k, as_s, ws_s, GATED,
                                    SMEM_SCALES, STAGES, row_l, w_l)
                if p > 0:  # step k - 1, in set B (p is unrolled: bound at p - 1)
                    acc, acc_up, r_b, ru_b = _promote(
                        acc, acc_up, d_b, du_b, s_b, su_b, 1, TWO, ONE,  # noqa: F821
                        col_gate)
                d_b, du_b = _issue(k + 1, num_k, a_rows, a_ok, dk, b_rows, b_up_rows, a_ptr,
                                   b_ptr, a_s, b_s, bu_s, r_b, ru_b, sc, as_s, ws_s, STAGES,
                                   TWO, SMEM_SCALES)
                s_b, su_b = _scales(as_rows, row_ok, s_gate, s_up, k + 1, as_s, ws_s, GATED,
                                    SMEM_SCALES, STAGES, row_l, w_l)
                acc, acc_up, r_a, ru_a = _promote(acc, acc_up, d_a, du_a, s_a, su_a, 1, TWO,
                                                  ONE, col_gate)
            acc, acc_up, r_b, ru_b = _promote(acc, acc_up, d_b, du_b, s_b, su_b, 0, TWO, ONE,
                                              col_gate)
        async_copy.wait_group(0)  # no copy left in flight at exit

        # epilogue: each real pair's row of C, in C's dtype (16-byte stores)
        st_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [W, 1], [1, 0])
        if ONE:  # even columns gate, odd up
            gate, up = gl.split(gl.reshape(acc, [BLOCK_M, BLOCK_N, 2]))
            out = gate / (1.0 + gl.exp(-gate)) * up  # silu(gate) * up, fp32
        elif GATED:
            out = acc / (1.0 + gl.exp(-acc)) * acc_up
        else:
            w_pair = gl.load(weights_ptr + pair_a, mask=row_ok, other=0.0)
            out = acc * w_pair[:, None]
        out = gl.convert_layout(out.to(c_ptr.dtype.element_ty), st_l)
        ro = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, st_l))
        pair_o = gl.load(sorted_ids_ptr + b * BLOCK_M + ro)
        co = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, st_l))
        gl.store(c_ptr + pair_o.to(gl.int64)[:, None] * stride_cm + n0 + co[None, :], out,
                 mask=(pair_o < num_pairs)[:, None])
