"""The NVFP4 fused MoE with the decoded weights as wgmma's A operand in registers, in Gluon: an
experiment for the next GPU call, off unless MOESERVE_NVFP4_REGS=1 (envs.py). `launch` is
fused_triton._launch's contract for one grouped GEMM over weights in the "mma" layout
(`to_mma_words`).

Why: two Gluon forms that took the decoded tile through shared memory lost to Triton's tile
(90f405a; 8502acf measured ~2x slower even at 64 tokens, where only the reads and the decode
count: the packed bytes' copy to shared memory, the decoded tile's store and the barriers
cost more than wgmma's padding saved). Here the decoded weights never touch shared memory:

    program (row block b of BT pairs, N tile n), 8 warps; M = 128 weight rows (gated: 64 gate
    rows, warpgroup 0, then their 64 up rows, warpgroup 1), e = expert_ids[b]:
      a ring of STAGES shared stages, D = STAGES - 1 K steps copied ahead (cp.async): a step's
        X tile [BT, 128], its packed words (each thread copies the 2 x 16 bytes it decodes)
        and their e4m3 scales (each lane copies its rows' 8 bytes)
      step k: its words and scales read back (LDS), decoded by inline PTX straight into
        wgmma's A-operand registers (the weight x 2^-10, nvfp4_tile's rule), then
        acc^T [M, BT] += A @ X_k^T (wgmma, B the stage read transposed), retired at once
      epilogue: fused_triton's (global scales x 2^10, silu(gate) * up through shared memory,
        or the routing weight), stored by pair

History: its first form (f396a81) loaded the words straight into registers one step ahead
and let one wgmma group run on beside the next decode: wrong outputs on an H100 (gpu_f396a81:
NaN in some programs' tiles). Its sm90 SASS rewrote the A registers of the group still in
flight; ptxas does not hold an async wgmma's A registers, and the wait's deps do not help:
Triton passes them as the bf16 halves (%rs), not the packed pairs (%r) the HGMMA reads (PTX
of this kernel, session 48). So the group is retired at once here, and the decode overlaps
the other program's wgmmas on the SM (121 registers, 112 KB at BT 64 with 4 stages: two
programs an SM). Timed so, that first form was level with the Triton tile at 64-pair
blocks (GLM-5 3.775 against 3.731 ms at 1,024 tokens): the ring's bytes in flight (D steps,
not one) are what this form adds.

The "mma" layout makes a thread's A fragment one 16-byte load. wgmma's A fragment (bf16,
k_width 2) gives lane l of a warp rows l // 4 and l // 4 + 8 of its 16 and, in every 16
columns, k = 2c, 2c + 1, 2c + 8, 2c + 9 (c = l % 4): two e2m1 bytes of each 8. On micro-tiles
(16 rows x 64 bytes, a K step of 128), the 64 bytes of a tile row are reordered so that byte
16 s + 4 b + c (span s of 32 k, its b-th byte of c's) moves to 16 c + 4 s + b: lane c's 16
bytes, four words (s = 0..3) of the bytes it decodes, are contiguous. The decode's word
holds k = 32 s + 16 (b // 2) + 8 (b % 2) + 2 c + {0, 1}; join, permute and reshape put the
eight values in K order, and the layout then is wgmma's A layout as it stands
(`convert_layout(..., assert_trivial=True)`: the compile fails otherwise).

bf16 activations on sm90, group 16, K a multiple of 128, N of 64 (gated) or 128, the row
blocks 16 / 32 / 64 (`takes`).
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

import torch

from moeserve import envs

enabled = envs.nvfp4_regs()  # benchmarks and tests set it
BLOCK_TS = (16, 32, 64)  # the row blocks' heights it takes: wgmma's N
ROWS = 128  # decoded weight rows a step: wgmma's M over two warpgroups
WARPS = ROWS // 16
BLOCK_K = 128  # a micro-tile row a step
BLOCK_N = {True: ROWS // 2, False: ROWS}  # output columns a program, by launch (gated or not)
STAGES = 4  # the ring's stages, STAGES - 1 K steps copied ahead

# Four bytes ($8, one word of lane c's: bytes c, c + 4 of a span's first 16 k, then c + 8,
# c + 12 of its second) and the two groups' scales x 2^116 in bf16 ($9 the first group's,
# $10 the second's) -> eight bf16 weights x 2^-10: $0 / $1 the low / high nibble of byte 0,
# $2 / $3 of byte 1, ... (nvfp4_tile's asm rule: a nibble s m2 m1 m0 set at bf16 bits
# s << 15 | m << 6 is its e2m1 value x 2^-126; the scale's 2^116 makes the product the weight
# x 2^-10, exact). prmt puts a byte's low nibble (from the word shifted left by 4) at bits
# 12-15 of the low half and its high nibble at bits 28-31.
_E2M1_WORD_ASM = ("{\n.reg .b32 w4, r, m, s, sa, sb, o;\nmov.b32 sa, {$9, $9};\n"
                  "mov.b32 sb, {$10, $10};\nshl.b32 w4, $8, 4;\n" + "".join(
                      f"prmt.b32 r, w4, $8, {select:#06x};\n"
                      "and.b32 m, r, 0x70007000; shr.b32 m, m, 6; and.b32 s, r, 0x80008000; "
                      "or.b32 m, m, s;\n"
                      f"mul.rn.bf16x2 o, m, {'sa' if b < 2 else 'sb'};\n"
                      f"mov.b32 {{${2 * b}, ${2 * b + 1}}}, o;\n"
                      for b, select in enumerate((0x4000, 0x5010, 0x6020, 0x7030))) + "}")
gl: Any = None  # triton.experimental.gluon.language, bound by _kernels()
async_copy: Any = None
fence_async_shared: Any = None
warpgroup_mma: Any = None
warpgroup_mma_wait: Any = None
_E2M1_ASM: Any = None


def to_mma_words(q: torch.Tensor) -> torch.Tensor:
    """Micro-tiled packed NVFP4 bytes [E, N, C] (micro_tiles.to_micro) -> the "mma" layout:
    in every 64-byte tile row, byte 16 s + 4 b + c moved to 16 c + 4 s + b (module doc)."""
    e, n, c = q.shape
    if q.dtype != torch.uint8 or c % 64:
        raise ValueError(f"the mma layout takes micro-tiled uint8 bytes, 64 a tile row; got "
                         f"[{e}, {n}, {c}] {q.dtype}")
    rows = q.reshape(-1, 4, 4, 4)  # [tile rows, s, b, c]
    return rows.permute(0, 3, 1, 2).contiguous().reshape(e, n, c)


def from_mma_words(q: torch.Tensor) -> torch.Tensor:
    """The inverse of `to_mma_words`."""
    e, n, c = q.shape
    return q.reshape(-1, 4, 4, 4).permute(0, 2, 3, 1).contiguous().reshape(e, n, c)


REFUSED = ("NVFP4 experts in nvfp4_regs' mma layout run through its kernel only: "
           "MOESERVE_NVFP4_REGS=1, bf16 activations on an sm90 GPU, row blocks of 16 / 32 / 64, "
           "K a multiple of 128 and N of 64 (gated) or 128")


def has_mma_words(w: Any) -> bool:
    """Whether a quantized weight's packed bytes are in the mma layout (`to_mma_words`)."""
    return bool(getattr(w, "mma_words", False))


def mma_words_in_place(w: Any) -> None:
    """A micro-tiled NVFP4 weight's bytes rewritten in the mma layout, `w.mma_words` set
    (benchmarks and tests: only this module's kernel reads them)."""
    from moeserve.kernels.moe.quant.micro_tiles import is_micro

    if w.format != "nvfp4" or not is_micro(w):
        raise ValueError(f"the mma layout takes micro-tiled NVFP4 weights, got {w.format} "
                         f"{'micro-tiled' if is_micro(w) else 'in rows'}")
    w.qweight.data = to_mma_words(w.qweight.data)
    w.mma_words = True


def mma_words_undone(w: Any) -> None:
    """`mma_words_in_place` undone: the micro-tiles back."""
    w.qweight.data = from_mma_words(w.qweight.data)
    w.mma_words = False


def takes(x: torch.Tensor, w: Any, config: dict, gated: bool) -> bool:
    """Whether this kernel runs the launch: the switch on, NVFP4 weights in the mma layout
    (`w.mma_words`), group 16, scales K-contiguous, bf16 activations on an sm90 GPU, the
    config's row blocks of BLOCK_TS' heights, K a multiple of BLOCK_K, N of BLOCK_N[gated]."""
    if not (enabled and w.format == "nvfp4" and has_mma_words(w) and x.is_cuda
            and x.dtype == torch.bfloat16):
        return False
    n_out = w.shape[1] // 2 if gated else w.shape[1]
    return (_is_sm90(x.device.index) and config["BLOCK_M"] in BLOCK_TS and w.group == 16
            and w.shape[2] % BLOCK_K == 0 and n_out % BLOCK_N[gated] == 0
            and w.scale.stride(2) == 1 and w.qweight.is_contiguous())


@functools.cache
def _is_sm90(index: int | None) -> bool:
    return torch.cuda.get_device_capability(index)[0] == 9


def launch(a: torch.Tensor, w: Any, c: torch.Tensor, topk_weights: torch.Tensor,
           sorted_ids: torch.Tensor, expert_ids: torch.Tensor, num_pairs: int,
           config: dict[str, int], *, a_row_div: int, gated: bool) -> None:
    """c[rows] = a[rows] @ dequant(w[e]).T over the config's expert-sorted row blocks
    (fused_triton's _launch for nvfp4; `takes` must hold)."""
    n_out = w.shape[1] // 2 if gated else w.shape[1]
    words = w.qweight.view(torch.int32)  # [E, N, C / 4]
    scale, glob = w.scale, w.global_scale
    num_blocks = expert_ids.shape[0]
    grid = (num_blocks * (n_out // BLOCK_N[gated]),)
    _kernels().moe[grid](
        a, words, scale, glob, c, topk_weights, sorted_ids, expert_ids, num_pairs,
        num_blocks, n_out, w.shape[2], a.stride(0), words.stride(0), words.stride(1),
        scale.stride(0), scale.stride(1), glob.stride(0), glob.stride(1), c.stride(0),
        A_ROW_DIV=a_row_div, GATED=gated, BT=config["BLOCK_M"], GROUP_M=config["GROUP_M"],
        STAGES=STAGES, **layouts(config["BLOCK_M"]), num_warps=WARPS)


def layouts(bt: int) -> dict[str, Any]:
    """The kernel's layout constexprs for row blocks of bt: A_LAYOUT (the activations'
    copies), M, and the packed words' [M, 4 (lane c), 4 (span s)] (a thread's four spans
    contiguous: one 16-byte load, for rows r and r + 8 of its warp's 16) and their scales'
    [M, c, s, 2 groups] (each lane c of a row loads the row's 8)."""
    a = a_layout(bt)
    warp_rows = [[16 << i, 0, 0] for i in range(WARPS.bit_length() - 1)]
    lanes = [[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]]
    words = gl.DistributedLinearLayout(reg_bases=[[0, 0, 1], [0, 0, 2], [8, 0, 0]],
                                       lane_bases=lanes, warp_bases=warp_rows, block_bases=[],
                                       shape=[ROWS, 4, 4])
    scales = gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 0, 1], [0, 0, 1, 0], [0, 0, 2, 0], [8, 0, 0, 0]],
        lane_bases=[b + [0] for b in lanes], warp_bases=[b + [0] for b in warp_rows],
        block_bases=[], shape=[ROWS, 4, 4, 2])
    # unswizzled: a quarter warp's 16- (words) or 8-byte (scales) reads are 128 contiguous
    # bytes, no bank conflict
    return {"A_LAYOUT": a, "M": ROWS, "words_l": words, "scales_l": scales,
            "words_smem": gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0]),
            "scales8_l": gl.DistributedLinearLayout(
                reg_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4], [8, 0, 0]], lane_bases=lanes,
                warp_bases=warp_rows, block_bases=[], shape=[ROWS, 4, 8])}


def a_layout(bt: int) -> Any:
    """The activations' copy layout over [bt, BLOCK_K] (WARPS warps): 16-byte vectors along
    K where the tile has a vector a thread, fewer where it is smaller, no thread copying what
    another does."""
    _kernels()
    per_thread = max(1, min(8, bt * BLOCK_K // (32 * WARPS)))
    cols = BLOCK_K // per_thread  # threads (then warps) along a row
    tc = min(32, cols)
    wc = max(1, cols // tc)
    return gl.BlockedLayout([1, per_thread], [32 // tc, tc], [WARPS // wc, wc], [1, 0])


@functools.cache
def _kernels() -> SimpleNamespace:
    """Jit the kernel on first use (gluon imported here only), with the Hopper builtins it
    calls bound as module globals (where the compiler resolves names)."""
    global gl, async_copy, fence_async_shared, warpgroup_mma, warpgroup_mma_wait, _E2M1_ASM
    global _nvfp4_regs_kernel, _copy_step, _decode_words, _weight_rows
    from triton.experimental import gluon
    from triton.experimental.gluon import language
    from triton.experimental.gluon.language.nvidia import hopper

    gl = language
    async_copy, fence_async_shared = hopper.async_copy, hopper.fence_async_shared
    warpgroup_mma, warpgroup_mma_wait = hopper.warpgroup_mma, hopper.warpgroup_mma_wait
    _E2M1_ASM = gl.constexpr(_E2M1_WORD_ASM)
    _copy_step, _decode_words, _weight_rows = (gluon.jit(f) for f in (
        _copy_step, _decode_words, _weight_rows))
    _nvfp4_regs_kernel = gluon.jit(do_not_specialize=["num_pairs", "num_blocks"])(
        _nvfp4_regs_kernel)
    return SimpleNamespace(moe=_nvfp4_regs_kernel)


# ---- Gluon functions (jitted by _kernels; module globals, where the compiler finds names) ----

def _nvfp4_regs_kernel(a_ptr, w_ptr, s_ptr, g_ptr, c_ptr, weights_ptr, sorted_ids_ptr,
                       expert_ids_ptr, num_pairs, num_blocks, N, K, stride_am, stride_we,
                       stride_wn, stride_se, stride_sn, stride_ge, stride_gn, stride_cm,
                       A_ROW_DIV: gl.constexpr, GATED: gl.constexpr, BT: gl.constexpr,
                       GROUP_M: gl.constexpr, STAGES: gl.constexpr, A_LAYOUT: gl.constexpr,
                       M: gl.constexpr, words_l: gl.constexpr, scales_l: gl.constexpr,
                       words_smem: gl.constexpr, scales8_l: gl.constexpr):
    """Program pid: row block pid_m x N tile pid_n (GROUP_M row blocks side by side an N tile,
    as fused_triton's kernel), the module docstring's data flow."""
    W: gl.constexpr = M // 16  # warps: 16 weight rows a warp
    BK: gl.constexpr = 128
    BLOCK_N: gl.constexpr = M // 2 if GATED else M  # output columns a program
    D: gl.constexpr = STAGES - 1  # K steps in flight ahead of the one multiplied
    dtype: gl.constexpr = a_ptr.dtype.element_ty
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[W, 1],
                                                    instr_shape=[16, BT, 16])
    dot_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_l, k_width=2)
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
        a_s = gl.allocate_shared_memory(dtype, [STAGES, BT, BK],
                                        gl.NVMMASharedLayout.get_default_for([BT, BK], dtype))
        ra = gl.arange(0, BT, layout=gl.SliceLayout(1, A_LAYOUT))
        pairs_a = gl.load(sorted_ids_ptr + pid_m * BT + ra)
        a_ok = pairs_a < num_pairs
        ka = gl.arange(0, BK, layout=gl.SliceLayout(0, A_LAYOUT))
        a_at = a_ptr + (pairs_a // A_ROW_DIV).to(gl.int64)[:, None] * stride_am + ka[None, :]

        # words: micro-tiles of 16 rows x 16 words a K step (stride_wn: words a row), lane c's
        # four at 4 c; scales: a row's 8 groups a step
        rw = _weight_rows(pid_n, N, M, GATED,
                          gl.SliceLayout(1, gl.SliceLayout(2, words_l)))[:, None, None]
        cw = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, words_l)))
        sw = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, words_l)))
        w_at = (w_ptr + e * stride_we + (rw // 16) * (16 * stride_wn) + (rw % 16) * 16
                + cw[None, :, None] * 4 + sw[None, None, :])
        # scales [M, 4 (lane c), 8 (a step's groups: span s, then its two)]: each lane c of a
        # row copies the row's 8 bytes (one 8-byte cp.async) and reads them back
        rs = _weight_rows(pid_n, N, M, GATED,
                          gl.SliceLayout(1, gl.SliceLayout(2, scales8_l)))[:, None, None]
        cs = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, scales8_l)))
        gs = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, scales8_l)))
        s_at = s_ptr + e * stride_se + rs * stride_sn + cs[None, :, None] * 0 + gs[None, None, :]

        # a stage: the X tile (read by wgmma: every thread's copies awaited, a barrier), the
        # packed words and their scales (each thread copies exactly what it reads back, so its
        # own wait_group suffices; the scales once for each lane c that decodes them)
        w_s = gl.allocate_shared_memory(gl.int32, [STAGES, M, 4, 4], words_smem)
        s_s = gl.allocate_shared_memory(s_ptr.dtype.element_ty, [STAGES, M, 4, 8],
                                        words_smem)
        num_k = K // BK
        for j in gl.static_range(D):  # the first steps in flight
            _copy_step(a_s, w_s, s_s, j, gl.minimum(j, num_k - 1), a_at, a_ok, w_at, s_at)
            async_copy.commit_group()

        acc = gl.zeros([M, BT], gl.float32, layout=acc_l)  # acc^T: weight rows x pairs
        for k in range(num_k):
            # step k - 1's wgmma (the last reader of the stage rewritten here) is retired:
            # every thread is past its wait
            gl.thread_barrier()
            ahead = k + D
            _copy_step(a_s, w_s, s_s, ahead % STAGES, gl.minimum(ahead, num_k - 1), a_at, a_ok,
                       w_at, s_at)
            async_copy.commit_group()
            async_copy.wait_group(D)  # step k's copies landed (this thread's)
            stage = k % STAGES
            scales = gl.reshape(s_s.index(stage).load(scales8_l), [M, 4, 4, 2])
            w_a = _decode_words(w_s.index(stage).load(words_l),
                                gl.convert_layout(scales, scales_l, assert_trivial=True),
                                words_l, dot_l, M)
            gl.thread_barrier()  # every thread's X copies of step k landed
            fence_async_shared()
            acc = warpgroup_mma(w_a, a_s.index(stage).permute((1, 0)), acc, is_async=True)
            # retired at once: ptxas does not keep an in-flight wgmma's A registers (the
            # packed pairs it reads) from the next decode, and a wait's deps name the bf16
            # values, not those pairs (gpu_f396a81: NaN with one group left in flight); the
            # decode overlaps the other programs' wgmmas on the SM instead
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        async_copy.wait_group(0)

        # the global scales x 2^10 per weight row; out [BLOCK_N, BT] (gated: silu(gate) * up
        # of rows r and BLOCK_N + r, through shared memory), 8 output columns a thread
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


def _copy_step(a_s, w_s, s_s, stage, k, a_at, a_ok, w_at, s_at):
    """K step k's X tile, packed words (a micro-tile row: 256 words further a step) and e4m3
    scales (8 a row a step) -> shared stage `stage` (cp.async; the caller commits)."""
    async_copy.async_copy_global_to_shared(a_s.index(stage), a_at + k * 128, mask=a_ok[:, None])
    async_copy.async_copy_global_to_shared(w_s.index(stage), w_at + k * 256)
    async_copy.async_copy_global_to_shared(s_s.index(stage), s_at + k * 8)


def _decode_words(words, scales, words_l: gl.constexpr, dot_l: gl.constexpr, M: gl.constexpr):
    """Words [M, 4 (c), 4 (s)] and their scales [M, c, s, 2] -> the bf16 tile [M, 128] (the
    weight x 2^-10) in wgmma's A layout dot_l, K in order (module docstring)."""
    sc = (scales.to(gl.float32) * 8.307674973655724e34).to(gl.bfloat16)  # x 2^116
    s0, s1 = gl.split(sc)  # the span's first and second 16-weight group (words' layout)
    s0 = gl.convert_layout(s0, words_l, assert_trivial=True)
    s1 = gl.convert_layout(s1, words_l, assert_trivial=True)
    v = gl.inline_asm_elementwise(_E2M1_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r,h,h",
                                  [words, s0, s1], dtype=(gl.bfloat16,) * 8, is_pure=True,
                                  pack=1)
    # v[2 b + o]: k = 32 s + 16 (b // 2) + 8 (b % 2) + 2 c + o
    t = gl.join(gl.join(gl.join(v[0], v[1]), gl.join(v[2], v[3])),
                gl.join(gl.join(v[4], v[5]), gl.join(v[6], v[7])))  # [M, c, s, o, b % 2, b // 2]
    t = gl.permute(t, (0, 2, 5, 4, 1, 3))  # [M, s, b // 2, b % 2, c, o]
    return gl.convert_layout(gl.reshape(t, [M, 128]), dot_l, assert_trivial=True)
