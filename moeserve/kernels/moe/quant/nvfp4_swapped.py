"""The NVFP4 fused MoE with the products transposed, in Gluon: the decoded weights as wgmma's M
(64 rows a warpgroup), a row block's tokens as its N (16, 32 or 64), so a block of ~32 real
rows costs 32 rows of tensor-core work where the plain tile pays wgmma's 64. `launch`:
fused_triton._launch's contract for one grouped GEMM. An experiment, off unless
MOESERVE_NVFP4_SWAPPED=1 (envs.py).

Why: on an H100 GLM-5's experts at 1,024 tokens (~32 rows an expert) run at ~49% of the 4-bit
read bound with Triton's tile and SUB_M (benchmarks/results/gpu_306980f/); offline sm90 SASS
put ~1.3 ms of it in wgmma's 64-row products (half of them padding), ~1.1 ms in the decode and
1.6 ms in the reads, taking turns within a program. Two earlier forms lost: Triton's transposed
tile (941ba87: layout conversions) and a Gluon 64 / 128-row tile with the decode beside the
previous step's wgmmas (90f405a: 4.95 against 4.38 ms on the H200 at 1,024 tokens, its
products still 64 token rows). This one is that Gluon pipeline transposed:

    program (row block b of BT pairs, N tile n of BLOCK_N weight rows), e = expert_ids[b]:
    stages (cp.async, STAGES of them, D = STAGES - 2 tiles ahead):
        X   [BT, BK]             the block's activations, gathered by token (bf16)
        W   [BLOCK_N, BK / 2]    the packed bytes of the gate (and up) rows, per step
        S   [BLOCK_N, BK / 16]   their e4m3 group scales
    step k: copies of tile k + D; wait for tile k; decode W * S (inline PTX, nvfp4_tile's
        rule: the weight x 2^-10) into decoded buffer k % 2 as [BLOCK_N, BK] in K order;
        acc^T [BLOCK_N, BT] += decoded @ X^T (async wgmma: A the decoded tile, B the stage's
        X read transposed), then wait until only step k's wgmmas are in flight
    epilogue: the global scales x 2^10 per weight row, silu(gate) * up (gated) or the
        routing weight per pair, stored by pair through a layout with 8 output columns a
        thread

Micro-tiled weights (micro_tiles.py) are read in place: at BK 128 a row's step is one
micro-tile row, 64 contiguous bytes. bf16 activations on sm90 only, group 16, K a multiple of
128 and N of BLOCK_N, scales K-contiguous (`takes`). The weights' bits are the "asm" decode's
and each product's terms the Triton tile's: the output equals it up to the order of the fp32
sums (the GPU test compares them).
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

import torch

from moeserve import envs
from moeserve.kernels.moe.quant import micro_tiles

enabled = envs.nvfp4_swapped()  # benchmarks and tests set it
BLOCK_TS = (16, 32, 64)  # the row blocks' heights it takes: wgmma's N
ROWS = 128  # decoded weight rows a step (wgmma's M, two warpgroups): gated 64 gate + 64 up
WARPS = ROWS // 16
BLOCK_N = {True: ROWS // 2, False: ROWS}  # output columns a program, by launch (gated or not)
# K a step (a micro-tile row: 128; 64 its half) and stages: at 64 x 3 a program takes ~74 KB
# of shared memory (three an SM), at 128 x 4 ~150 KB (one); benchmarks set them
BLOCK_K = 64
STAGES = 3  # copies STAGES - 2 tiles ahead: a stage is rewritten after its wgmma is done

# The packed bytes' decode as bf16 PAIRS in K order: four bytes ($4) and their scale x 2^116
# in bf16 ($5; the pack's four bytes lie in one 16-weight group, so $6 is the same scale and
# unused) -> $0, $1 = (low, high nibble) of bytes 0 and 1, $2, $3 of bytes 2 and 3, each the
# weight x 2^-10 (nvfp4_tile's asm decode's rule). prmt puts a byte's low nibble (from the
# word shifted by 4) at bits 12-15 of one half and its high nibble at bits 28-31, so the
# decoded tile needs no interleave of the low and high tiles; the other bits of each half are
# masked off.
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


def takes(x: torch.Tensor, w: Any, config: dict, gated: bool) -> bool:
    """Whether this kernel runs the launch: the switch on, NVFP4 weights (group 16, scales
    K-contiguous) under bf16 activations on an sm90 GPU, the config's row blocks of
    BLOCK_TS' heights, K a multiple of BLOCK_K and N of BLOCK_N[gated]."""
    if not (enabled and w.format == "nvfp4" and x.is_cuda and x.dtype == torch.bfloat16):
        return False
    n_out = w.shape[1] // 2 if gated else w.shape[1]
    return (_is_sm90(x.device.index) and config["BLOCK_M"] in BLOCK_TS and w.group == 16
            and w.shape[2] % BLOCK_K == 0 and n_out % BLOCK_N[gated] == 0
            and w.scale.stride(2) == 1 and w.qweight.stride(2) == 1)


@functools.cache
def _is_sm90(index: int | None) -> bool:
    return torch.cuda.get_device_capability(index)[0] == 9


def launch(a: torch.Tensor, w: Any, c: torch.Tensor, topk_weights: torch.Tensor,
           sorted_ids: torch.Tensor, expert_ids: torch.Tensor, num_pairs: int,
           config: dict[str, int], *, a_row_div: int, gated: bool) -> None:
    """c[rows] = a[rows] @ dequant(w[e]).T over the config's expert-sorted row blocks
    (fused_triton's _launch for nvfp4; `takes` must hold)."""
    n_out = w.shape[1] // 2 if gated else w.shape[1]
    block_n = BLOCK_N[gated]
    qweight, scale, glob = w.qweight, w.scale, w.global_scale
    num_blocks = expert_ids.shape[0]
    grid = (num_blocks * (n_out // block_n),)
    _kernels().moe[grid](
        a, qweight, scale, glob, c, topk_weights, sorted_ids, expert_ids, num_pairs,
        num_blocks, n_out, w.shape[2], a.stride(0), qweight.stride(0), qweight.stride(1),
        scale.stride(0), scale.stride(1), glob.stride(0), glob.stride(1), c.stride(0),
        A_ROW_DIV=a_row_div, GATED=gated, BT=config["BLOCK_M"], BLOCK_K=BLOCK_K,
        GROUP_M=config["GROUP_M"], STAGES=STAGES, MICRO=micro_tiles.is_micro(w),
        A_LAYOUT=a_layout(config["BLOCK_M"], BLOCK_K), M=ROWS, num_warps=WARPS)


def a_layout(bt: int, block_k: int) -> Any:
    """The activations' copy layout over [bt, block_k] (WARPS warps): 16-byte vectors along
    K where the tile has a vector a thread, fewer bytes a thread where it is smaller, rows
    over the warps first, no thread copying what another does."""
    _kernels()
    per_thread = max(1, min(8, bt * block_k // (32 * WARPS)))
    cols = block_k // per_thread  # threads (then warps) along a row
    tc = min(32, cols)
    wc = max(1, cols // tc)
    return gl.BlockedLayout([1, per_thread], [32 // tc, tc], [WARPS // wc, wc], [1, 0])


@functools.cache
def _kernels() -> SimpleNamespace:
    """Jit the kernel on first use (gluon imported here only), with the Hopper builtins it
    calls bound as module globals (where the compiler resolves names)."""
    global gl, async_copy, fence_async_shared, warpgroup_mma, warpgroup_mma_wait, _E2M1_ASM
    global _nvfp4_swapped_kernel, _decode_step, _copy_tile, _weight_rows
    from triton.experimental import gluon
    from triton.experimental.gluon import language
    from triton.experimental.gluon.language.nvidia import hopper

    gl = language
    async_copy, fence_async_shared = hopper.async_copy, hopper.fence_async_shared
    warpgroup_mma, warpgroup_mma_wait = hopper.warpgroup_mma, hopper.warpgroup_mma_wait
    _E2M1_ASM = gl.constexpr(_E2M1_PAIRS_ASM)
    _decode_step, _copy_tile = gluon.jit(_decode_step), gluon.jit(_copy_tile)
    _weight_rows = gluon.jit(_weight_rows)
    _nvfp4_swapped_kernel = gluon.jit(do_not_specialize=["num_pairs", "num_blocks"])(
        _nvfp4_swapped_kernel)
    return SimpleNamespace(moe=_nvfp4_swapped_kernel)


# ---- Gluon functions (jitted by _kernels; module globals, where the compiler finds names) ----

def _nvfp4_swapped_kernel(a_ptr, b_ptr, s_ptr, g_ptr, c_ptr, weights_ptr, sorted_ids_ptr,
                          expert_ids_ptr, num_pairs, num_blocks, N, K, stride_am, stride_be,
                          stride_bn, stride_se, stride_sn, stride_ge, stride_gn, stride_cm,
                          A_ROW_DIV: gl.constexpr, GATED: gl.constexpr, BT: gl.constexpr,
                          BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                          MICRO: gl.constexpr, A_LAYOUT: gl.constexpr, M: gl.constexpr):
    """Program pid: row block pid_m x N tile pid_n (GROUP_M row blocks side by side an N tile,
    as fused_triton's kernel), the module docstring's data flow."""
    # M: decoded weight rows a step, wgmma's M (gated: gate rows, then up rows), 64 a warpgroup
    W: gl.constexpr = M // 16
    BLOCK_N: gl.constexpr = M // 2 if GATED else M  # output columns a program
    HALF: gl.constexpr = BLOCK_K // 2  # packed bytes a weight row a step
    GROUPS: gl.constexpr = BLOCK_K // 16  # scale columns a step
    D: gl.constexpr = STAGES - 2  # tiles in flight ahead of the one decoded
    dtype: gl.constexpr = a_ptr.dtype.element_ty
    # copy layouts: packed bytes in 16-byte vectors, scales 4 bytes (X's: A_LAYOUT, by BT)
    w_l: gl.constexpr = gl.BlockedLayout([1, 16], [32 // (HALF // 16), HALF // 16], [W, 1],
                                         [1, 0])
    s_l: gl.constexpr = gl.BlockedLayout([1, 4], [32 // (GROUPS // 4), GROUPS // 4], [W, 1],
                                         [1, 0])
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[W, 1],
                                                    instr_shape=[16, BT, 16])
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
        a_s = gl.allocate_shared_memory(dtype, [STAGES, BT, BLOCK_K],
                                        gl.NVMMASharedLayout.get_default_for([BT, BLOCK_K],
                                                                             dtype))
        w_s = gl.allocate_shared_memory(gl.uint8, [STAGES, M, HALF], plain)
        sc_s = gl.allocate_shared_memory(s_ptr.dtype.element_ty, [STAGES, M, GROUPS], plain)
        dec_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([M, BLOCK_K], dtype)
        dec_s = gl.allocate_shared_memory(dtype, [2, M, BLOCK_K], dec_l)

        # the block's pairs, their tokens (X's rows), padding rows masked
        ra = gl.arange(0, BT, layout=gl.SliceLayout(1, A_LAYOUT))
        pairs_a = gl.load(sorted_ids_ptr + pid_m * BT + ra)
        a_rows = (pairs_a // A_ROW_DIV).to(gl.int64)
        a_ok = pairs_a < num_pairs
        ka = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, A_LAYOUT))
        a_at = a_ptr + a_rows[:, None] * stride_am + ka[None, :]
        # the tile's weight rows (gated: BLOCK_N gate rows, then their up rows N further),
        # strided ([E, N, K / 2]) or in micro-tiles of 16 rows x 64 bytes (N % 16 == 0)
        rw = _weight_rows(pid_n, N, M, GATED, gl.SliceLayout(1, w_l))
        kw = gl.arange(0, HALF, layout=gl.SliceLayout(0, w_l))
        if MICRO:
            w_rows = (rw // 16) * (16 * stride_bn) + (rw % 16) * 64
        else:
            w_rows = rw * stride_bn
        w_at = b_ptr + e * stride_be + w_rows[:, None] + kw[None, :]
        rs = _weight_rows(pid_n, N, M, GATED, gl.SliceLayout(1, s_l))
        ks = gl.arange(0, GROUPS, layout=gl.SliceLayout(0, s_l))
        s_at = s_ptr + e * stride_se + rs[:, None] * stride_sn + ks[None, :]

        num_k = K // BLOCK_K
        for j in gl.static_range(D):  # the first tiles in flight
            _copy_tile(a_s, w_s, sc_s, a_at, a_ok, w_at, s_at, j,
                       gl.minimum(j, num_k - 1) * BLOCK_K, MICRO)
            async_copy.commit_group()

        acc = gl.zeros([M, BT], gl.float32, layout=acc_l)  # acc^T: weight rows x pairs
        for k in range(num_k):
            # every thread is past the wait below: step k - 2's wgmma, which read the stage
            # and the decoded buffer rewritten here, is done
            gl.thread_barrier()
            ahead = k + D
            _copy_tile(a_s, w_s, sc_s, a_at, a_ok, w_at, s_at, ahead % STAGES,
                       gl.minimum(ahead, num_k - 1) * BLOCK_K, MICRO)
            async_copy.commit_group()
            async_copy.wait_group(D)  # tile k landed (tiles k + 1 .. k + D may not have)
            gl.thread_barrier()
            st = k % STAGES
            _decode_step(w_s.index(st), sc_s.index(st), dec_s.index(k % 2), M, BLOCK_K, W)
            fence_async_shared()
            gl.thread_barrier()
            # X^T [BK, BT] read transposed from the stage; step k - 1's group done after,
            # step k's in flight beside step k + 1's decode
            acc = warpgroup_mma(dec_s.index(k % 2), a_s.index(st).permute((1, 0)), acc,
                                is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
        async_copy.wait_group(0)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))

        # the global scales x 2^10 per weight row (the asm decode's tile is the weight x
        # 2^-10); then out [BLOCK_N, BT] through shared memory (gated: silu(gate) * up of
        # rows r and BLOCK_N + r), 8 output columns a thread, stored by pair
        rg = _weight_rows(pid_n, N, M, GATED, gl.SliceLayout(1, acc_l))
        acc = acc * (gl.load(g_ptr + e * stride_ge + rg * stride_gn) * 1024.0)[:, None]
        out_l: gl.constexpr = gl.BlockedLayout([8, 1], [BLOCK_N // 8, 32 // (BLOCK_N // 8)],
                                               [1, W], [0, 1])
        if GATED:
            epi_s = gl.allocate_shared_memory(gl.float32, [M, BT], plain)
            epi_s.store(acc)
            gl.thread_barrier()
            gate = epi_s.slice(0, BLOCK_N).load(out_l)
            up = epi_s.slice(BLOCK_N, BLOCK_N).load(out_l)
            out = gate / (1.0 + gl.exp(-gate)) * up  # silu(gate) * up
        else:
            out = gl.convert_layout(acc, out_l)
        co = gl.arange(0, BT, layout=gl.SliceLayout(0, out_l))
        pairs_c = gl.load(sorted_ids_ptr + pid_m * BT + co)
        c_ok = pairs_c < num_pairs
        if not GATED:
            out = out * gl.load(weights_ptr + pairs_c, mask=c_ok, other=0.0)[None, :]
        no = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, out_l))
        c_at = c_ptr + pairs_c.to(gl.int64)[None, :] * stride_cm + no[:, None]
        gl.store(c_at, out.to(c_ptr.dtype.element_ty), mask=c_ok[None, :])


def _weight_rows(pid_n, N, M: gl.constexpr, GATED: gl.constexpr, layout: gl.constexpr):
    """The M weight rows of N tile pid_n (int64, in `layout`): M of them, or (GATED) M / 2
    gate rows then their up rows, N further."""
    r = gl.arange(0, M, layout=layout)
    if GATED:
        rows = pid_n * (M // 2) + r + gl.where(r >= M // 2, N - M // 2, 0)
    else:
        rows = pid_n * M + r
    return rows.to(gl.int64)


def _copy_tile(a_s, w_s, sc_s, a_at, a_ok, w_at, s_at, st, k0, MICRO: gl.constexpr):
    """cp.async of the K step at column k0 into stage st: the rows' activations, the packed
    bytes (micro-tiles: 1 KB a 128 columns, then 64 bytes a row; rows: k0 / 2 further) and
    the scales of the tile's weight rows. No branch around it (past the last step the caller
    copies the last one again, into a stage nothing reads): a branch in the loop made ptxas
    serialize the wgmmas."""
    if MICRO:
        w_off = (k0 // 128) * 1024 + (k0 % 128) // 2
    else:
        w_off = k0 // 2
    w_off = gl.multiple_of(w_off, 16)  # BLOCK_K >= 64: a step is 32-byte aligned
    async_copy.async_copy_global_to_shared(a_s.index(st), a_at + k0, mask=a_ok[:, None])
    async_copy.async_copy_global_to_shared(w_s.index(st), w_at + w_off)
    async_copy.async_copy_global_to_shared(sc_s.index(st), s_at + k0 // 16)


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
