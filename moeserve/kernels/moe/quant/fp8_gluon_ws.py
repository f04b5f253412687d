"""The FP8 MoE's grouped GEMM in Gluon with its loads in their own warps (warp
specialization), persistent: `launch`, fp8_gluon.launch's contract, for 128-row blocks on sm90
(fp8_gluon's `backend` "gluon-ws").

Why: Nsight Compute puts fp8_gluon's kernel (and Triton's) at a third of the FP8 peak at 8,192
tokens for want of latency hiding, not of issue slots or DRAM (benchmarks/results/gpu_ae64d49/
call1: two warps a scheduler, long-scoreboard stalls first): each warpgroup computes its loads'
addresses, waits for its copies at a CTA barrier every step and can keep only two steps of
copies in flight. Here a producer partition (4 warps, few registers) runs STAGES steps ahead
of the math, as DeepGEMM and CUTLASS's warp-specialized mainloops do, and one program an SM
walks its tiles (program_id, + num_programs, ...), so the producer fills the next tile's
stages while the math stores this one's:

    program: tiles of (row block b of 128 sorted pairs, one expert; N tile n), N fastest
    producer (worker, 4 warps): per step j of its tiles, stage s = j % STAGES
        (j >= STAGES) wait `empty[s]`: the math retired step j - STAGES
        cp.async: the A rows' 128 K columns (gathered by sorted pair), the weight tile's rows,
        the rows' and the tile's scales (fp8_gluon._copy_step, scales through shared memory);
        each thread's copies arrive on `full[s]` as they land (cp.async.mbarrier.arrive.noinc:
        `full[s]` counts the producer's 128 threads)
    math (default partition, 8 warps, two warpgroups of 64 rows): per step j
        wait `full[s]`, fence, issue step j's wgmmas into fresh registers, read its scales;
        retire step j - 1 (its products added, scaled, as fp8_gluon promotes them) and arrive
        on `empty` of its stage; fp8_gluon's two product sets and UNROLL drain (ptxas's rule);
        each tile's epilogue: silu(gate) * up, or the routing weight, stored by pair

`mbarrier.arrive` in a partition is a barrier of its warps then one thread's arrive (sm90 PTX,
Triton 3.6: `bar.sync 0, 256` then `@tid0 mbarrier.arrive`), so `empty[s]` counts one arrival a
step, made after every math warp retired the step's wgmmas.

Shared memory: STAGES x (A 16 KB + weight tile 16 KB + scales 0.5 KB); one program an SM.
An experiment (backend "gluon-ws"), slower in both forms on an H100 (qwen3-30b-a3b's
experts): one tile a program (benchmarks/results/gpu_106c118/call1) 1.440 ms at 8,192 tokens
and 0.360 at 1,024 against fp8_gluon's two programs an SM at 1.370 / 0.312; this persistent
form (gpu_c06bad4/call2; its GPU test passed) 1.491 / 0.366 against 1.297 / 0.315. With the
per-step promotion's product sets a thread's registers allow no wider tile than 128 x 128,
which at the FP8 peak asks L2 for ~11 TB/s: the lever left is fewer L2 bytes a FLOP (the
weight tile multicast over a cluster by TMA), not deeper loads.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

import torch

from moeserve.kernels.moe import gluon_ws
from moeserve.kernels.moe.quant import fp8_gluon

gl: Any = None  # triton.experimental.gluon.language, bound by _kernels()
async_copy: Any = None
fence_async_shared: Any = None
warpgroup_mma: Any = None
mbarrier: Any = None
_copy_step: Any = None  # fp8_gluon's jitted helpers, bound by _kernels()
_promote: Any = None
_scales: Any = None
_tile_of: Any = None  # gluon_ws's
_store_tile: Any = None

BLOCK_M = 128  # two math warpgroups of 64 rows
MATH_WARPS = 8
PRODUCER_WARPS = 4
# registers a producer thread (setmaxnreg): its row addresses and masks; the math warps take
# what the 384 threads' share leaves
PRODUCER_REGISTERS = 80
# shared-memory stages: 32.5 KB each at 128 x 128 (one-dot gated, or down 128)
stages = 6


def launch(a: torch.Tensor, a_scale: torch.Tensor, w: Any, c: torch.Tensor,
           topk_weights: torch.Tensor, sorted_ids: torch.Tensor, expert_ids: torch.Tensor,
           num_pairs: int, *, a_row_div: int, gated: bool) -> None:
    """fp8_gluon.launch's grouped GEMM at 128-row blocks (the op's row blocks must be 128
    high): gated launches in the one-dot form, N tiles fp8_gluon's."""
    n_out = w.shape[1] // 2 if gated else w.shape[1]
    k_dim = w.shape[2]
    t = fp8_gluon.tiles(BLOCK_M, gated)
    unroll = fp8_gluon.unroll(k_dim, t["wide"])
    num_tiles = expert_ids.shape[0] * (n_out // t["BLOCK_N"])
    grid = (min(num_tiles, gluon_ws.num_sms(a.device)),)  # persistent: one program an SM
    _kernels().moe[grid](
        a, a_scale, w.qweight, w.scale, c, topk_weights, sorted_ids, expert_ids,
        num_pairs, num_tiles, n_out, k_dim, a.stride(0), a_scale.stride(0),
        w.qweight.stride(0), w.qweight.stride(1), w.scale.stride(0), w.scale.stride(1),
        c.stride(0), A_ROW_DIV=a_row_div, GATED=gated, BLOCK_N=t["BLOCK_N"],
        STAGES=stages, UNROLL=unroll, MATH_W=MATH_WARPS, PRODUCER_W=PRODUCER_WARPS,
        PRODUCER_REGS=PRODUCER_REGISTERS, num_warps=MATH_WARPS)


@functools.cache
def _kernels() -> SimpleNamespace:
    """Jit the kernel on first use, fp8_gluon's and gluon_ws's helpers and the Hopper builtins
    bound as module globals (where the compiler resolves names)."""
    global gl, async_copy, fence_async_shared, warpgroup_mma, mbarrier
    global _copy_step, _promote, _scales, _tile_of, _store_tile
    global _producer, _math, _wait_issue, _moe_fp8_ws_kernel
    from triton.experimental import gluon
    from triton.experimental.gluon.language.nvidia import hopper

    fp8_gluon._kernels()
    gl = fp8_gluon.gl
    async_copy, fence_async_shared = hopper.async_copy, hopper.fence_async_shared
    warpgroup_mma, mbarrier = hopper.warpgroup_mma, hopper.mbarrier
    _copy_step, _promote, _scales = fp8_gluon._copy_step, fp8_gluon._promote, fp8_gluon._scales
    gluon_ws._kernels()
    _tile_of, _store_tile = gluon_ws._tile_of, gluon_ws._store_tile
    _producer, _math, _wait_issue = (gluon.jit(f) for f in (_producer, _math, _wait_issue))
    _moe_fp8_ws_kernel = gluon.jit(do_not_specialize=["num_pairs", "num_tiles"])(
        _moe_fp8_ws_kernel)
    return SimpleNamespace(moe=_moe_fp8_ws_kernel)


# ---- Gluon functions (jitted by _kernels; module globals, where the compiler finds names) ----

def _producer(a_ptr, as_ptr, b_ptr, bs_ptr, sorted_ids_ptr, expert_ids_ptr, num_pairs,
              num_tiles, N, K, stride_am, stride_asm, stride_be, stride_bn, stride_se,
              stride_sn, a_s, b_s, as_s, ws_s, full, empty, A_ROW_DIV: gl.constexpr,
              GATED: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
              P: gl.constexpr):
    """Every step's copies of this program's tiles, STAGES ahead of the math, in P warps
    (module docstring); j counts the steps over the tiles (its stage j % STAGES)."""
    WIDE: gl.constexpr = 2 * BLOCK_N if GATED else BLOCK_N
    cp_l: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [P, 1], [1, 0])
    w_l: gl.constexpr = gl.BlockedLayout([2], [32], [P], [0])
    rc = gl.arange(0, 128, layout=gl.SliceLayout(1, cp_l))
    dk = gl.arange(0, 128, layout=gl.SliceLayout(0, cp_l))
    nc = gl.arange(0, WIDE, layout=gl.SliceLayout(1, cp_l))
    wi = gl.arange(0, 2, layout=w_l)
    num_k = K // 128
    g = 0  # steps issued before this tile
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        b, n0, e = _tile_of(tile, N, expert_ids_ptr, BLOCK_N)
        if e >= 0:  # blocks past the used ones: expert -1
            pair_c = gl.load(sorted_ids_ptr + b * 128 + rc)
            a_ok = pair_c < num_pairs
            a_rows = (pair_c // A_ROW_DIV).to(gl.int64) * stride_am
            w_base = e.to(gl.int64) * stride_be
            if GATED:  # one dot: row 2j gate n0 + j, 2j + 1 up
                b_rows = w_base + (n0 + nc // 2 + (nc % 2) * N).to(gl.int64) * stride_bn
            else:
                b_rows = w_base + (n0 + nc).to(gl.int64) * stride_bn
            s_base = bs_ptr + e.to(gl.int64) * stride_se
            sc = (as_ptr + (pair_c // A_ROW_DIV).to(gl.int64) * stride_asm,
                  gl.where(wi == 0, s_base + (n0 // 128) * stride_sn,
                           s_base + ((N + n0) // 128) * stride_sn),
                  (wi == 0) | GATED)
            for k in range(num_k):
                j = g + k
                s = j % STAGES
                if j >= STAGES:  # the math retired step j - STAGES, which read stage s
                    mbarrier.wait(empty.index(s), (j // STAGES - 1) & 1)
                _copy_step(k, num_k, a_rows, a_ok, dk, b_rows, b_rows, a_ptr, b_ptr,
                           a_s.index(s), b_s.index(s), b_s.index(s), sc, as_s.index(s),
                           ws_s.index(s), False, True)
                async_copy.mbarrier_arrive(full.index(s), increment_count=False)
            g += num_k


def _wait_issue(j, a_s, b_s, r, full, STAGES: gl.constexpr):
    """Step j (of all the program's): wait for its stage's copies, then issue its wgmmas
    into fresh registers r's."""
    s = j % STAGES
    mbarrier.wait(full.index(s), (j // STAGES) & 1)
    fence_async_shared()
    return warpgroup_mma(a_s.index(s), b_s.index(s).permute((1, 0)), r, use_acc=False,
                         is_async=True)


def _math(c_ptr, weights_ptr, sorted_ids_ptr, expert_ids_ptr, num_pairs, num_tiles, N, K,
          stride_cm, a_s, b_s, as_s, ws_s, full, empty, GATED: gl.constexpr,
          BLOCK_N: gl.constexpr, STAGES: gl.constexpr, UNROLL: gl.constexpr,
          W: gl.constexpr):
    """Per tile of this program: the wgmmas, the promotion a step late and the epilogue, in
    W warps (module docstring); g counts the steps of the tiles before (as the producer)."""
    WIDE: gl.constexpr = 2 * BLOCK_N if GATED else BLOCK_N
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[W, 1],
                                                    instr_shape=[16, WIDE, 32])
    row_l: gl.constexpr = gl.SliceLayout(1, acc_l)
    w_l: gl.constexpr = gl.BlockedLayout([2], [32], [W], [0])
    col_gate = gl.arange(0, WIDE, layout=gl.SliceLayout(0, acc_l)) % 2 == 0
    num_k = K // 128
    g = 0
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        b, n0, e = _tile_of(tile, N, expert_ids_ptr, BLOCK_N)
        if e >= 0:  # blocks past the used ones: expert -1
            # every wgmma of the tile before retired: the accumulators start from zeros
            acc = gl.zeros([128, WIDE], gl.float32, layout=acc_l)
            r_a = gl.zeros([128, WIDE], gl.float32, layout=acc_l)
            r_b = gl.zeros([128, WIDE], gl.float32, layout=acc_l)
            for it in range(num_k // UNROLL):
                for p in gl.static_range(UNROLL // 2):
                    j = g + it * UNROLL + 2 * p
                    d_a = _wait_issue(j, a_s, b_s, r_a, full, STAGES)
                    s_a, su_a = _scales(0, 0, 0, 0, j, as_s, ws_s, GATED, True, STAGES, row_l,
                                        w_l)
                    if p > 0:  # step j - 1, in set B (p is unrolled: bound at p - 1)
                        acc, _u, r_b, _d = _promote(acc, acc, d_b, d_b, s_b,  # noqa: F821
                                                    su_b, 1, False, GATED, col_gate)  # noqa: F821
                        mbarrier.arrive(empty.index((j - 1) % STAGES))
                    d_b = _wait_issue(j + 1, a_s, b_s, r_b, full, STAGES)
                    s_b, su_b = _scales(0, 0, 0, 0, j + 1, as_s, ws_s, GATED, True, STAGES,
                                        row_l, w_l)
                    acc, _u, r_a, _d = _promote(acc, acc, d_a, d_a, s_a, su_a, 1, False,
                                                GATED, col_gate)
                    mbarrier.arrive(empty.index(j % STAGES))
                acc, _u, r_b, _d = _promote(acc, acc, d_b, d_b, s_b, su_b, 0, False, GATED,
                                            col_gate)
                mbarrier.arrive(empty.index((g + it * UNROLL + UNROLL - 1) % STAGES))
            g += num_k

            # the epilogue, while the producer fills the next tile's stages
            _store_tile(acc, c_ptr, weights_ptr, sorted_ids_ptr, b, n0, num_pairs, stride_cm,
                       GATED, BLOCK_N, W)


def _moe_fp8_ws_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, weights_ptr, sorted_ids_ptr,
                       expert_ids_ptr, num_pairs, num_tiles, N, K, stride_am, stride_asm,
                       stride_be, stride_bn, stride_se, stride_sn, stride_cm,
                       A_ROW_DIV: gl.constexpr, GATED: gl.constexpr, BLOCK_N: gl.constexpr,
                       STAGES: gl.constexpr, UNROLL: gl.constexpr, MATH_W: gl.constexpr,
                       PRODUCER_W: gl.constexpr, PRODUCER_REGS: gl.constexpr):
    """A persistent program (tiles program_id, + num_programs, ...: row block b, N tile n,
    N-fastest): shared memory and barriers, then the producer and math partitions (module
    docstring)."""
    WIDE: gl.constexpr = 2 * BLOCK_N if GATED else BLOCK_N
    a_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([128, 128], gl.float8e4nv)
    b_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([WIDE, 128], gl.float8e4nv)
    sc_sl: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])  # a stage's, indexed
    a_s = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, 128, 128], a_sl)
    b_s = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, WIDE, 128], b_sl)
    as_s = gl.allocate_shared_memory(gl.float32, [STAGES, 128], sc_sl)
    ws_s = gl.allocate_shared_memory(gl.float32, [STAGES, 2], sc_sl)
    full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(full.index(s), count=32 * PRODUCER_W)  # the producer's threads
        mbarrier.init(empty.index(s), count=1)  # the math partition's arrive
    gl.warp_specialize([
        (_math, (c_ptr, weights_ptr, sorted_ids_ptr, expert_ids_ptr, num_pairs, num_tiles, N,
                 K, stride_cm, a_s, b_s, as_s, ws_s, full, empty, GATED, BLOCK_N, STAGES,
                 UNROLL, MATH_W)),
        (_producer, (a_ptr, as_ptr, b_ptr, bs_ptr, sorted_ids_ptr, expert_ids_ptr, num_pairs,
                     num_tiles, N, K, stride_am, stride_asm, stride_be, stride_bn, stride_se,
                     stride_sn, a_s, b_s, as_s, ws_s, full, empty, A_ROW_DIV, GATED, BLOCK_N,
                     STAGES, PRODUCER_W)),
    ], [PRODUCER_W], [PRODUCER_REGS])
