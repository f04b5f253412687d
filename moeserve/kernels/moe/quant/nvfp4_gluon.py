"""The NVFP4 fused MoE's 64- and 128-row tiles in Gluon, so that a K step's nibble decode runs
while the tensor cores work on the step before: `launch`, fused_triton._launch's contract for
one grouped GEMM. An experiment, off unless MOESERVE_NVFP4_GLUON=1 (envs.py).

Why: Triton's tile (fused_triton.py) decodes a step's weights in registers, stores them to
shared memory for wgmma and waits for every wgmma group at once (sm90 SASS of the 64 x 128 x
128 gated tile: four HGMMA groups a step, each followed by WARPGROUP.DEPBAR 0), so the decode
(ALU), the products (tensor cores) and the reads take turns: at GLM-5's expert shape and 1,024
tokens about 1.2 + 1.6 + 1.3 ms against the 4.3 ms measured (29% of the read bound,
benchmarks/results/gpu_4705423/). Here a program (row block, N tile; a warpgroup a 64 rows):

    stages (cp.async, STAGES of them, D = STAGES - 2 tiles ahead):
        A   [BM, BK]            the rows' activations, gathered by token (x's dtype, bf16)
        W   [BN, BK / 2] x 1|2  the packed bytes of the gate (and up) rows
        S   [BN, BK / 16] x 1|2 their e4m3 group scales
    step k: issue the copies of tile k + D into step k - 2's stage, wait for tile k's, decode
        W * S (inline PTX, nvfp4_tile's rule: the weight x 2^-10) into decoded buffer k % 2 as
        [BN, BK] in K order (_E2M1_PAIRS_ASM), wgmma (async) A @ decoded^T,
        then wait until only step k's wgmmas are in flight (step k - 1's done)
    epilogue: the global scales x 2^10 per output column, silu(gate) * up (gated) or the
        routing weight per row, stored by pair

so the decode of step k runs beside the wgmmas of step k - 1. bf16 activations on sm90 only;
K a multiple of BLOCK_K and N of BLOCK_N (`takes`). The weights' bits are fused_triton's "asm"
decode's, and each product's terms are the same: the output should equal the Triton tile's up
to the order of the fp32 sums (the GPU test compares them).
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

import torch

from moeserve import envs

enabled = envs.nvfp4_gluon()
BLOCK_MS = (64, 128)  # one or two warpgroups' wgmma rows (4 or 8 warps)
STAGES = 4  # copies two tiles ahead: a stage is rewritten only after its wgmmas are done
# (BLOCK_N, BLOCK_K) of each launch, its own (the config's BLOCK_M alone is shared: the rows'
# blocks): sm90 offline at 64 rows 127 / 124 registers, 82 KB of shared memory (two CTAs an
# SM), at 128 rows 126 / 120 registers, 114 KB (one); no spill. The gated launch's 64 x 128 x
# 128 took 164 KB, and 128 x 128 did not fit
TILES = {True: (64, 64), False: (128, 64)}

# The packed bytes' decode as bf16 PAIRS in K order: four bytes ($4) and their scale x 2^116
# in bf16 ($5; the pack's four bytes lie in one 16-weight group, so $6 is the same scale and
# unused) -> $0, $1 = (low, high nibble) of bytes 0 and 1, $2, $3 of bytes 2 and 3, each the
# weight x 2^-10 (nvfp4_tile's asm decode's rule). prmt puts a byte's low nibble (from the
# word shifted by 4) at bits 12-15 of one half and its high nibble at bits 28-31, so the
# decoded tile needs no interleave of the low and high tiles after it (whose two PRMTs per
# four weights the first version paid); the other bits of each half are masked off.
_E2M1_PAIRS_ASM = "{\n.reg .b32 w4, r, m, s;\nshl.b32 w4, $4, 4;\n" + "".join(
    f"prmt.b32 r, w4, $4, {select:#06x};\n"  # byte b's low nibble (from w4), its high one
    "and.b32 m, r, 0x70007000; shr.b32 m, m, 6; and.b32 s, r, 0x80008000; or.b32 m, m, s;\n"
    f"mul.rn.bf16x2 ${b}, m, $5;\n" for b, select in enumerate((0x4000, 0x5010, 0x6020, 0x7030))
) + "}"
gl: Any = None  # triton.experimental.gluon.language, bound by _kernels()
async_copy: Any = None
fence_async_shared: Any = None
warpgroup_mma: Any = None
warpgroup_mma_wait: Any = None
_E2M1_ASM: Any = None


def takes(x: torch.Tensor, config: dict, n_out: int, k_dim: int, group: int,
          gated: bool) -> bool:
    """Whether this kernel runs the launch: the switch on, bf16 activations on an sm90 GPU,
    the config's 64- or 128-row blocks, group 16 (NVFP4's), K and N whole tiles of TILES'."""
    block_n, block_k = TILES[gated]
    return (enabled and x.is_cuda and x.dtype == torch.bfloat16 and _is_sm90(x.device.index)
            and config["BLOCK_M"] in BLOCK_MS and group == 16
            and k_dim % block_k == 0 and n_out % block_n == 0)


@functools.cache
def _is_sm90(index: int | None) -> bool:
    return torch.cuda.get_device_capability(index)[0] == 9


def launch(a: torch.Tensor, w: Any, c: torch.Tensor, topk_weights: torch.Tensor,
           sorted_ids: torch.Tensor, expert_ids: torch.Tensor, num_pairs: int,
           config: dict[str, int], *, a_row_div: int, gated: bool) -> None:
    """c[rows] = a[rows] @ dequant(w[e]).T over the config's expert-sorted row blocks
    (fused_triton's _launch for nvfp4; `takes` must hold)."""
    n_out = w.shape[1] // 2 if gated else w.shape[1]
    k_dim = w.shape[2]
    block_n, block_k = TILES[gated]
    qweight, scale, glob = w.qweight, w.scale, w.global_scale
    num_blocks = expert_ids.shape[0]
    grid = (num_blocks * (n_out // block_n),)
    _kernels().moe[grid](
        a, qweight, scale, glob, c, topk_weights, sorted_ids, expert_ids, num_pairs,
        num_blocks, n_out, k_dim, a.stride(0), qweight.stride(0), qweight.stride(1),
        scale.stride(0), scale.stride(1), glob.stride(0), glob.stride(1), c.stride(0),
        A_ROW_DIV=a_row_div, GATED=gated, BLOCK_N=block_n, BLOCK_K=block_k,
        BM=config["BLOCK_M"], GROUP_M=config["GROUP_M"], STAGES=STAGES,
        num_warps=config["BLOCK_M"] // 16)


@functools.cache
def _kernels() -> SimpleNamespace:
    """Jit the kernel on first use (gluon imported here only), with the Hopper builtins it
    calls bound as module globals (where the compiler resolves names)."""
    global gl, async_copy, fence_async_shared, warpgroup_mma, warpgroup_mma_wait, _E2M1_ASM
    global _nvfp4_moe_kernel, _decode_step, _copy_tile
    from triton.experimental import gluon
    from triton.experimental.gluon import language
    from triton.experimental.gluon.language.nvidia import hopper

    gl = language
    async_copy, fence_async_shared = hopper.async_copy, hopper.fence_async_shared
    warpgroup_mma, warpgroup_mma_wait = hopper.warpgroup_mma, hopper.warpgroup_mma_wait
    _E2M1_ASM = gl.constexpr(_E2M1_PAIRS_ASM)
    _decode_step, _copy_tile = gluon.jit(_decode_step), gluon.jit(_copy_tile)
    _nvfp4_moe_kernel = gluon.jit(do_not_specialize=["num_pairs", "num_blocks"])(
        _nvfp4_moe_kernel)
    return SimpleNamespace(moe=_nvfp4_moe_kernel)


# ---- Gluon functions (jitted by _kernels; module globals, where the compiler finds names) ----

def _nvfp4_moe_kernel(a_ptr, b_ptr, s_ptr, g_ptr, c_ptr, weights_ptr, sorted_ids_ptr,
                      expert_ids_ptr, num_pairs, num_blocks, N, K, stride_am, stride_be,
                      stride_bn, stride_se, stride_sn, stride_ge, stride_gn, stride_cm,
                      A_ROW_DIV: gl.constexpr, GATED: gl.constexpr, BM: gl.constexpr,
                      BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
                      STAGES: gl.constexpr):
    """Program pid: row block pid_m x N tile pid_n (GROUP_M row blocks side by side an N tile,
    as fused_triton's kernel), the module docstring's data flow."""
    W: gl.constexpr = BM // 16  # warps: a warpgroup a 64 rows
    HALF: gl.constexpr = BLOCK_K // 2  # packed bytes a weight row a step
    GROUPS: gl.constexpr = BLOCK_K // 16  # scale columns a step
    NW: gl.constexpr = 2 if GATED else 1  # weight matrices: gate and up, or one
    D: gl.constexpr = STAGES - 2  # tiles in flight ahead of the one decoded
    dtype: gl.constexpr = a_ptr.dtype.element_ty
    # copy layouts: A rows in 16-byte vectors; packed bytes in 16-byte vectors; scales 4 bytes
    a_l: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (BLOCK_K // 8), BLOCK_K // 8],
                                         [W, 1], [1, 0])
    w_l: gl.constexpr = gl.BlockedLayout([1, 16], [32 // (HALF // 16), HALF // 16], [W, 1],
                                         [1, 0])
    s_l: gl.constexpr = gl.BlockedLayout([1, 4], [32 // (GROUPS // 4), GROUPS // 4], [W, 1],
                                         [1, 0])
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[W, 1],
                                                    instr_shape=[16, BLOCK_N, 16])
    plain: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])

    pid = gl.program_id(0)
    num_pid_n = N // BLOCK_N
    group_size = GROUP_M * num_pid_n
    first_m = (pid // group_size) * GROUP_M
    group_m = gl.minimum(num_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % group_size) % group_m
    pid_n = (pid % group_size) // group_m
    expert = gl.load(expert_ids_ptr + pid_m)
    if expert >= 0:  # else past the used blocks
        e = expert.to(gl.int64)
        a_s = gl.allocate_shared_memory(dtype, [STAGES, BM, BLOCK_K],
                                        gl.NVMMASharedLayout.get_default_for([BM, BLOCK_K],
                                                                             dtype))
        w_s = gl.allocate_shared_memory(gl.uint8, [STAGES * NW, BLOCK_N, HALF], plain)
        sc_s = gl.allocate_shared_memory(s_ptr.dtype.element_ty, [STAGES * NW, BLOCK_N, GROUPS],
                                         plain)
        dec_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_K], dtype)
        dec_s = gl.allocate_shared_memory(dtype, [2 * NW, BLOCK_N, BLOCK_K], dec_l)

        # the rows: pairs, their tokens (A's rows), padding rows masked
        ra = gl.arange(0, BM, layout=gl.SliceLayout(1, a_l))
        pairs_a = gl.load(sorted_ids_ptr + pid_m * BM + ra)
        a_rows = (pairs_a // A_ROW_DIV).to(gl.int64)
        a_ok = pairs_a < num_pairs
        ka = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, a_l))
        a_at = a_ptr + a_rows[:, None] * stride_am + ka[None, :]
        rw = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, w_l))
        kw = gl.arange(0, HALF, layout=gl.SliceLayout(0, w_l))
        w_at = b_ptr + e * stride_be + rw.to(gl.int64)[:, None] * stride_bn + kw[None, :]
        rs = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_l))
        ks = gl.arange(0, GROUPS, layout=gl.SliceLayout(0, s_l))
        s_at = s_ptr + e * stride_se + rs.to(gl.int64)[:, None] * stride_sn + ks[None, :]
        up_w = N * stride_bn  # the up rows' offsets (gated)
        up_s = N * stride_sn

        num_k = K // BLOCK_K
        for j in gl.static_range(D):  # the first tiles in flight
            _copy_tile(a_s, w_s, sc_s, a_at, a_ok, w_at, s_at, up_w, up_s, j,
                       gl.minimum(j, num_k - 1) * BLOCK_K, NW)
            async_copy.commit_group()

        acc = gl.zeros([BM, BLOCK_N], gl.float32, layout=acc_l)
        acc_up = gl.zeros([BM, BLOCK_N], gl.float32, layout=acc_l)
        for k in range(num_k):
            # every thread is past the wait below: step k - 2's wgmmas, which read the stage
            # and the decoded buffer rewritten here, are done
            gl.thread_barrier()
            ahead = k + D
            _copy_tile(a_s, w_s, sc_s, a_at, a_ok, w_at, s_at, up_w, up_s, ahead % STAGES,
                       gl.minimum(ahead, num_k - 1) * BLOCK_K, NW)
            async_copy.commit_group()
            async_copy.wait_group(D)  # tile k landed (tiles k + 1 .. k + D may not have)
            gl.thread_barrier()
            st = k % STAGES
            buf = k % 2
            _decode_step(w_s.index(st * NW), sc_s.index(st * NW), dec_s.index(buf * NW),
                         BLOCK_N, BLOCK_K, W)
            if GATED:
                _decode_step(w_s.index(st * NW + 1), sc_s.index(st * NW + 1),
                             dec_s.index(buf * NW + 1), BLOCK_N, BLOCK_K, W)
            fence_async_shared()
            gl.thread_barrier()
            acc = warpgroup_mma(a_s.index(st), dec_s.index(buf * NW).permute((1, 0)), acc,
                                is_async=True)
            if GATED:
                acc_up = warpgroup_mma(a_s.index(st), dec_s.index(buf * NW + 1).permute((1, 0)),
                                       acc_up, is_async=True)
                # step k - 1's groups done, step k's in flight beside step k + 1's decode
                acc, acc_up = warpgroup_mma_wait(num_outstanding=2, deps=(acc, acc_up))
            else:
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
        async_copy.wait_group(0)
        if GATED:
            acc, acc_up = warpgroup_mma_wait(num_outstanding=0, deps=(acc, acc_up))
        else:
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))

        # epilogue: the global scales x 2^10 (the asm decode's tile is the weight x 2^-10)
        cn = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_l))
        g_at = g_ptr + e * stride_ge + cn.to(gl.int64) * stride_gn
        acc = acc * (gl.load(g_at) * 1024.0)[None, :]
        cm = gl.arange(0, BM, layout=gl.SliceLayout(1, acc_l))
        pairs_c = gl.load(sorted_ids_ptr + pid_m * BM + cm)
        c_ok = pairs_c < num_pairs
        if GATED:
            acc_up = acc_up * (gl.load(g_at + N * stride_gn) * 1024.0)[None, :]
            acc = acc / (1.0 + gl.exp(-acc)) * acc_up  # silu(gate) * up
        else:
            acc = acc * gl.load(weights_ptr + pairs_c, mask=c_ok, other=0.0)[:, None]
        c_at = c_ptr + pairs_c.to(gl.int64)[:, None] * stride_cm + cn[None, :]
        gl.store(c_at, acc.to(c_ptr.dtype.element_ty), mask=c_ok[:, None])


def _copy_tile(a_s, w_s, sc_s, a_at, a_ok, w_at, s_at, up_w, up_s, st, k0, NW: gl.constexpr):
    """cp.async of the K step at column k0 into stage st: the rows' activations, the packed
    bytes and scales of the gate (and up) rows. No branch around it (past the last step the
    caller copies the last one again, into a stage nothing reads): a branch in the loop made
    ptxas serialize the wgmmas."""
    async_copy.async_copy_global_to_shared(a_s.index(st), a_at + k0, mask=a_ok[:, None])
    async_copy.async_copy_global_to_shared(w_s.index(st * NW), w_at + k0 // 2)
    async_copy.async_copy_global_to_shared(sc_s.index(st * NW), s_at + k0 // 16)
    if NW == 2:
        async_copy.async_copy_global_to_shared(w_s.index(st * NW + 1), w_at + up_w + k0 // 2)
        async_copy.async_copy_global_to_shared(sc_s.index(st * NW + 1), s_at + up_s + k0 // 16)


def _decode_step(w_st, sc_st, dec, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                 W: gl.constexpr):
    """A stage's packed bytes [BN, BK / 2] and e4m3 scales [BN, BK / 16] -> the bf16 tile
    [BN, BK] (the weight x 2^-10, nvfp4_tile's rule) in `dec`, K in order (byte j's low nibble
    at 2j, its high one at 2j + 1)."""
    GROUPS: gl.constexpr = BLOCK_K // 16
    # [BN, G, 8] bytes, four consecutive in a thread (one 32-bit register for the asm)
    b3: gl.constexpr = gl.BlockedLayout([1, 1, 4], [32 // (GROUPS * 2), GROUPS, 2], [W, 1, 1],
                                        [2, 1, 0])
    byte = w_st.reshape([BLOCK_N, GROUPS, 8]).load(b3)
    scale = sc_st.load(gl.SliceLayout(2, b3)).to(gl.float32)  # [BN, G]
    step = (scale * 8.307674973655724e34).to(gl.bfloat16)  # x 2^116 (nvfp4_tile)
    step = gl.broadcast(step[:, :, None], byte)[0]
    # out_o[n, g, 4 p + i]: weight k = 16 g + 8 p + 4 o + i of row n (_E2M1_PAIRS_ASM)
    out0, out1 = gl.inline_asm_elementwise(_E2M1_ASM, "=r,=r,=r,=r,r,r,r", [byte, step],
                                           dtype=(gl.bfloat16, gl.bfloat16), is_pure=True,
                                           pack=4)
    w = gl.reshape(gl.join(out0, out1), [BLOCK_N, GROUPS, 2, 4, 2])  # [n, g, p, i, o]
    w = gl.reshape(gl.permute(w, (0, 1, 2, 4, 3)), [BLOCK_N, BLOCK_K])  # k = 16g + 8p + 4o + i
    dec.store(w)
