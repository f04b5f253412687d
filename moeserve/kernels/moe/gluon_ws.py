"""The bf16 / fp16 fused MoE's grouped GEMM in Gluon for Hopper, warp-specialized and
persistent, for many rows an expert (prefill and mixed steps): `launch`, one of
fused_triton._launch's launches (gated: act = silu(a W_gate^T) * a W_up^T; down: c = w * act
W2^T) over the same sorted 128-row blocks, A rows gathered the same way.

Why: at 8,192 tokens Triton's kernel runs the MoE at 53-67% of the bf16 peak (glm-4.7-flash's
experts on the H200: the gated launch 0.78 ms, the down 0.41, the committed tune's best tiles),
and W1's mixed steps spend about half their time there (benchmarks/results/gpu_4705423/call1:
58 of 125 ms at 62% of the FLOP bound). A 128 x 128 tile needs ~12 TB/s from L2 to keep the
tensor cores busy; this kernel's 128 x 256 tiles need two thirds of that, and its loads run in
their own warps, STAGES steps ahead, so neither each tile's start nor its epilogue waits for
memory (the warp-specialized, persistent mainloops of CUTLASS and DeepGEMM):

    program: tiles (row block b of 128 sorted pairs, one expert; N tile n), N fastest, from
        program_id by num_programs (one program an SM)
    producer (worker, PRODUCER_W warps, few registers): per step j of its tiles, stage
        s = j % STAGES: (j >= STAGES) wait `empty[s]`; cp.async the A rows' 64 K columns
        (gathered by sorted pair) and the weight tile's rows; each thread's copies arrive on
        `full[s]` as they land (cp.async.mbarrier.arrive.noinc: `full[s]` counts its threads)
    math (default partition, 8 warps, two warpgroups of 64 rows): per step wait `full[s]`,
        issue the wgmma into the accumulator, retire the step before (wait(1)) and arrive on
        its stage's `empty`; then the tile's epilogue: silu(gate) * up (gate and up rows
        interleaved in one weight tile, one wgmma a step) or the routing weight, stored by
        pair while the producer fills the next tile's stages

Bounds (`supports`): CUDA sm90, bf16 / fp16, K a multiple of 64, N of the launch's N tile
(`block_n`), "sum" combine (no atomics), every last dimension contiguous. fused_triton's
`_launch` calls it where `takes` holds: `mode` "on", or "auto" where the op has a full row
block an expert on average (pairs >= 128 x experts), the row blocks 128 high. "off" by
default: on an H100 (benchmarks/results/gpu_c06bad4/, kernels_moe's "gluon_ws" backend, the
whole routed layer) it is correct (8 GPU tests) but barely ahead: glm-4.7-flash's experts at
8,192 tokens 1.396 / 1.500 ms against Triton's 1.445 / 1.567 (dummy / skewed routing; 56% of
787 TFLOP/s), qwen3-30b-a3b's level (1.448 / 1.441), at 2,048 tokens with skewed routing 4-7%
slower. What binds it (Nsight Compute on an H100 at 8,192 tokens, benchmarks/results/
gpu_a8d729a/call1): L2's bandwidth to the SMs, at 79-80% of its peak in both this kernel and
Triton's (6.9-7.4 TB/s), the tensor pipe 69 / 64% active in the gated / down launch (Triton's
58 / 59%); the per-thread stage release (`arrive_per_thread`) measured level. A 128 x 256
tile needs ~9 TB/s of L2 at the bf16 peak; what would lift it is fewer L2 bytes a FLOP: the
weight tile multicast over a cluster of CTAs (TMA multicast: Gluon 3.6's TMA copy has no
multicast form) or a taller tile than two math warpgroups' registers hold.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

import torch

from moeserve import envs

gl: Any = None  # triton.experimental.gluon.language, bound by _kernels()
async_copy: Any = None
fence_async_shared: Any = None
warpgroup_mma: Any = None
warpgroup_mma_wait: Any = None
mbarrier: Any = None

# the switch: "off", "auto" (many rows an expert) or "on" (kernels_moe's "gluon_ws");
# MOESERVE_MOE_GLUON_WS sets it for a served A/B
mode = envs.moe_gluon_ws("off")
MODES = ("off", "auto", "on")
BLOCK_M = 128  # two math warpgroups of 64 rows
BLOCK_K = 64  # a row's 128 bytes a step: the 128-byte swizzle
MATH_WARPS = 8
PRODUCER_WARPS = 4
# registers a producer thread (setmaxnreg): its rows' addresses (sm90 compile: 88 spill 8 bytes
# in the gated launch, 96 none); the math warps take what the 384 threads' share leaves (208)
PRODUCER_REGISTERS = 96
SMEM_BYTES = 227 * 1024  # sm90's shared memory a block
# How the math warps release a stage (a switch, untimed): False, `mbarrier.arrive` (a barrier
# of the 8 warps, then one thread's arrive: `empty` counts 1); True, each math thread's own
# arrive (cp.async.mbarrier.arrive.noinc, which with no copy of its own in flight arrives at
# once: `empty` counts 256), no barrier a step, the warpgroups free to drift apart
arrive_per_thread = False
# accumulator columns a launch: the gated one's gate and up halves of 128 each (interleaved,
# one wgmma), the down one's 256; smaller where the width does not divide (`block_n`)
GATED_WIDTH, DOWN_WIDTH = 256, 256


def block_n(n_out: int, gated: bool) -> int:
    """The launch's N tile (the gated one's gate and up columns each): the widest of 128 / 64
    (gated) or 256 / 128 / 64 (down) that divides N; 0 if none does."""
    widest = GATED_WIDTH // 2 if gated else DOWN_WIDTH
    return next((n for n in (256, 128, 64) if n <= widest and n_out % n == 0), 0)


def stages(width: int, elem_bytes: int) -> int:
    """Shared-memory stages a program holds, at most 6: a stage is A [128, 64] and the weight
    tile [width, 64]; the epilogue's layout change takes ~16 KB beside them (ptxas's shared
    bytes, sm90 compile: 4 stages at width 256 213,060, gated or down)."""
    stage = (BLOCK_M + width) * BLOCK_K * elem_bytes
    return min(6, (SMEM_BYTES - 20 * 1024) // stage)


def supports(a: torch.Tensor, w: torch.Tensor, c: torch.Tensor, gated: bool) -> bool:
    """Whether this kernel can run the launch (module docstring's bounds)."""
    n_out = w.shape[1] // 2 if gated else w.shape[1]
    return (a.device.type == "cuda" and torch.cuda.get_device_capability(a.device) == (9, 0)
            and a.dtype in (torch.bfloat16, torch.float16) and w.dtype == a.dtype
            and c.dtype == a.dtype and w.shape[2] % BLOCK_K == 0
            and block_n(n_out, gated) > 0 and a.stride(1) == 1 and w.stride(2) == 1
            and c.stride(1) == 1)


def takes(a: torch.Tensor, w: torch.Tensor, c: torch.Tensor, block_m: int, gated: bool,
          atomic: bool, c_row_div: int, num_pairs: int) -> bool:
    """Whether fused_triton's launch is handed to this kernel: `mode` "on", or "auto" with
    num_pairs >= 128 x the experts in w; 128-row blocks, the "sum" combine's plain row stores,
    `supports`."""
    if mode not in MODES:
        raise ValueError(f"gluon_ws.mode {mode!r} is not one of {MODES}")
    wanted = mode == "on" or (mode == "auto" and num_pairs >= BLOCK_M * w.shape[0])
    return (wanted and block_m == BLOCK_M and not atomic and c_row_div == 1
            and supports(a, w, c, gated))


def launch(a: torch.Tensor, w: torch.Tensor, c: torch.Tensor, topk_weights: torch.Tensor,
           sorted_ids: torch.Tensor, expert_ids: torch.Tensor, num_pairs: int, *,
           a_row_div: int, gated: bool) -> None:
    """c[pair] = a[pair // a_row_div] @ w[e].T over the sorted 128-row blocks; gated (w:
    [E, 2I, K]): c[pair, n] = silu(gate) * up; else (w: [E, N, K]) times the pair's routing
    weight (topk_weights, flat by pair)."""
    n_out = w.shape[1] // 2 if gated else w.shape[1]
    k_dim = w.shape[2]
    bn = block_n(n_out, gated)
    width = 2 * bn if gated else bn
    num_tiles = expert_ids.shape[0] * (n_out // bn)
    grid = (min(num_tiles, num_sms(a.device)),)  # persistent: one program an SM
    _kernels().moe[grid](
        a, w, c, topk_weights, sorted_ids, expert_ids, num_pairs, num_tiles, n_out, k_dim,
        a.stride(0), w.stride(0), w.stride(1), c.stride(0), A_ROW_DIV=a_row_div, GATED=gated,
        BLOCK_N=bn, STAGES=stages(width, a.element_size()), MATH_W=MATH_WARPS,
        THREAD_ARRIVE=arrive_per_thread,
        PRODUCER_W=PRODUCER_WARPS, PRODUCER_REGS=PRODUCER_REGISTERS, num_warps=MATH_WARPS)


@functools.cache
def num_sms(device: torch.device) -> int:
    """The device's SMs: a persistent launch's programs (also fp8_gluon_ws's)."""
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def _kernels() -> SimpleNamespace:
    """Jit the kernel on first use (gluon imported here only), the Hopper builtins bound as
    module globals (where the compiler resolves names)."""
    global gl, async_copy, fence_async_shared, warpgroup_mma, warpgroup_mma_wait, mbarrier
    global _producer, _math, _moe_ws_kernel, _tile_of, _store_tile, _release
    from triton.experimental import gluon
    from triton.experimental.gluon import language
    from triton.experimental.gluon.language.nvidia import hopper

    gl = language
    async_copy, fence_async_shared = hopper.async_copy, hopper.fence_async_shared
    warpgroup_mma, warpgroup_mma_wait = hopper.warpgroup_mma, hopper.warpgroup_mma_wait
    mbarrier = hopper.mbarrier
    _producer, _math, _tile_of, _store_tile, _release = (
        gluon.jit(f) for f in (_producer, _math, _tile_of, _store_tile, _release))
    _moe_ws_kernel = gluon.jit(do_not_specialize=["num_pairs", "num_tiles"])(_moe_ws_kernel)
    return SimpleNamespace(moe=_moe_ws_kernel)


# ---- Gluon functions (jitted by _kernels; module globals, where the compiler finds names) ----

def _tile_of(tile, N, expert_ids_ptr, BLOCK_N: gl.constexpr):
    """A persistent program's tile (N fastest): its row block b, first column n0 and the
    block's expert e (-1 past the used blocks). Also fp8_gluon_ws's."""
    num_n = N // BLOCK_N
    b = tile // num_n
    return b, (tile % num_n) * BLOCK_N, gl.load(expert_ids_ptr + b)


def _store_tile(acc, c_ptr, weights_ptr, sorted_ids_ptr, b, n0, num_pairs, stride_cm,
               GATED: gl.constexpr, BLOCK_N: gl.constexpr, W: gl.constexpr):
    """A tile's epilogue: each real pair's row of C in C's dtype (16-byte stores) from the fp32
    accumulators [128, WIDE] in wgmma's layout: gated, silu(gate) * up (even columns gate,
    odd up), else times the pair's routing weight. Also fp8_gluon_ws's."""
    st_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [W, 1], [1, 0])
    if GATED:
        gate, up = gl.split(gl.reshape(acc, [128, BLOCK_N, 2]))
        out = gate / (1.0 + gl.exp(-gate)) * up  # silu(gate) * up, fp32
    else:
        ra = gl.arange(0, 128, layout=gl.SliceLayout(1, acc.type.layout))
        pair_a = gl.load(sorted_ids_ptr + b * 128 + ra)
        w_pair = gl.load(weights_ptr + pair_a, mask=pair_a < num_pairs, other=0.0)
        out = acc * w_pair[:, None]
    out = gl.convert_layout(out.to(c_ptr.dtype.element_ty), st_l)
    ro = gl.arange(0, 128, layout=gl.SliceLayout(1, st_l))
    pair_o = gl.load(sorted_ids_ptr + b * 128 + ro)
    co = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, st_l))
    gl.store(c_ptr + pair_o.to(gl.int64)[:, None] * stride_cm + n0 + co[None, :], out,
             mask=(pair_o < num_pairs)[:, None])


def _release(bar, THREAD_ARRIVE: gl.constexpr):
    """The math warps' arrive on a stage's `empty` once they retired its wgmmas
    (`arrive_per_thread`)."""
    if THREAD_ARRIVE:
        async_copy.mbarrier_arrive(bar, increment_count=False)
    else:
        mbarrier.arrive(bar)


def _producer(a_ptr, b_ptr, sorted_ids_ptr, expert_ids_ptr, num_pairs, num_tiles, N, K,
              stride_am, stride_be, stride_bn, a_s, b_s, full, empty,
              A_ROW_DIV: gl.constexpr, GATED: gl.constexpr, BLOCK_N: gl.constexpr,
              STAGES: gl.constexpr, P: gl.constexpr):
    """Every step's copies of this program's tiles, STAGES ahead of the math, in P warps;
    j counts the steps over the tiles (its stage j % STAGES)."""
    WIDE: gl.constexpr = 2 * BLOCK_N if GATED else BLOCK_N
    # 16-byte copies: a row's 64 values over 8 threads
    cp_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [P, 1], [1, 0])
    rc = gl.arange(0, 128, layout=gl.SliceLayout(1, cp_l))
    dk = gl.arange(0, 64, layout=gl.SliceLayout(0, cp_l))
    nc = gl.arange(0, WIDE, layout=gl.SliceLayout(1, cp_l))
    num_k = K // 64
    j = 0
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        b, n0, e = _tile_of(tile, N, expert_ids_ptr, BLOCK_N)
        if e >= 0:  # blocks past the used ones: expert -1
            pair_c = gl.load(sorted_ids_ptr + b * 128 + rc)
            a_ok = pair_c < num_pairs  # padding rows zero-filled
            a_rows = (pair_c // A_ROW_DIV).to(gl.int64) * stride_am
            w_base = e.to(gl.int64) * stride_be
            if GATED:  # one dot: row 2i is gate row n0 + i, row 2i + 1 up row n0 + i
                b_rows = w_base + (n0 + nc // 2 + (nc % 2) * N).to(gl.int64) * stride_bn
            else:
                b_rows = w_base + (n0 + nc).to(gl.int64) * stride_bn
            for k in range(num_k):
                s = j % STAGES
                if j >= STAGES:  # the math retired step j - STAGES, which read stage s
                    mbarrier.wait(empty.index(s), (j // STAGES - 1) & 1)
                k0 = k * 64
                async_copy.async_copy_global_to_shared(
                    a_s.index(s), a_ptr + a_rows[:, None] + k0 + dk[None, :],
                    mask=a_ok[:, None])
                async_copy.async_copy_global_to_shared(
                    b_s.index(s), b_ptr + b_rows[:, None] + k0 + dk[None, :])
                async_copy.mbarrier_arrive(full.index(s), increment_count=False)
                j += 1


def _math(c_ptr, weights_ptr, sorted_ids_ptr, expert_ids_ptr, num_pairs, num_tiles, N, K,
          stride_cm, a_s, b_s, full, empty, GATED: gl.constexpr, BLOCK_N: gl.constexpr,
          STAGES: gl.constexpr, W: gl.constexpr, THREAD_ARRIVE: gl.constexpr):
    """Per tile of this program: the wgmmas, each step's stage released once the next one's
    wgmma is issued and it retired, then the epilogue, in W warps; j counts the steps as the
    producer does."""
    WIDE: gl.constexpr = 2 * BLOCK_N if GATED else BLOCK_N
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[W, 1],
                                                    instr_shape=[16, WIDE, 16])
    num_k = K // 64
    j = 0
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        b, n0, e = _tile_of(tile, N, expert_ids_ptr, BLOCK_N)
        if e >= 0:  # blocks past the used ones: expert -1
            acc = gl.zeros([128, WIDE], gl.float32, layout=acc_l)
            for k in range(num_k):
                s = j % STAGES
                mbarrier.wait(full.index(s), (j // STAGES) & 1)
                fence_async_shared()  # the cp.async writes before the wgmma's reads
                acc = warpgroup_mma(a_s.index(s), b_s.index(s).permute((1, 0)), acc,
                                    is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
                if k > 0:  # step j - 1 retired: its stage is the producer's again
                    _release(empty.index((j + STAGES - 1) % STAGES), THREAD_ARRIVE)
                j += 1
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            _release(empty.index((j + STAGES - 1) % STAGES), THREAD_ARRIVE)

            # the epilogue, while the producer fills the next tile's stages
            _store_tile(acc, c_ptr, weights_ptr, sorted_ids_ptr, b, n0, num_pairs, stride_cm,
                       GATED, BLOCK_N, W)


def _moe_ws_kernel(a_ptr, b_ptr, c_ptr, weights_ptr, sorted_ids_ptr, expert_ids_ptr,
                   num_pairs, num_tiles, N, K, stride_am, stride_be, stride_bn, stride_cm,
                   A_ROW_DIV: gl.constexpr, GATED: gl.constexpr, BLOCK_N: gl.constexpr,
                   STAGES: gl.constexpr, MATH_W: gl.constexpr, THREAD_ARRIVE: gl.constexpr,
                   PRODUCER_W: gl.constexpr,
                   PRODUCER_REGS: gl.constexpr):
    """A persistent program: shared memory and barriers, then the producer and math
    partitions (module docstring)."""
    WIDE: gl.constexpr = 2 * BLOCK_N if GATED else BLOCK_N
    dtype: gl.constexpr = a_ptr.dtype.element_ty
    a_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([128, 64], dtype)
    b_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([WIDE, 64], dtype)
    a_s = gl.allocate_shared_memory(dtype, [STAGES, 128, 64], a_sl)
    b_s = gl.allocate_shared_memory(dtype, [STAGES, WIDE, 64], b_sl)
    full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(full.index(s), count=32 * PRODUCER_W)  # the producer's threads
        # the math partition's arrive, or each of its threads' (THREAD_ARRIVE)
        mbarrier.init(empty.index(s), count=32 * MATH_W if THREAD_ARRIVE else 1)
    gl.warp_specialize([
        (_math, (c_ptr, weights_ptr, sorted_ids_ptr, expert_ids_ptr, num_pairs, num_tiles, N,
                 K, stride_cm, a_s, b_s, full, empty, GATED, BLOCK_N, STAGES, MATH_W,
                 THREAD_ARRIVE)),
        (_producer, (a_ptr, b_ptr, sorted_ids_ptr, expert_ids_ptr, num_pairs, num_tiles, N, K,
                     stride_am, stride_be, stride_bn, a_s, b_s, full, empty, A_ROW_DIV,
                     GATED, BLOCK_N, STAGES, PRODUCER_W)),
    ], [PRODUCER_W], [PRODUCER_REGS])
