"""The attention layer's step between the qkv GEMM and the attention read, in one Triton launch:
per-head q/k RMSNorm (Qwen3; optional), RoPE on q and k, and the K/V write into the paged cache.
And its torch reference, the three unfused steps.

    qkv [T, (H + 2 KVH) * D]  (the qkv GEMM's output; row t = q heads | k heads | v heads)
      q [H, D], k [KVH, D] of token t  --RMSNorm per head (if weights)--> --RoPE at positions[t]-->
      q -> q_out [T, H, D] (new, contiguous; the attention backend's input)
      k -> kv_cache[0] at slot slot_mapping[t]     [2, num_blocks, block_size, KVH, D]
      v (as is) -> kv_cache[1] at the same slot

Partial rotary (GLM-4.5): with cos/sin tables [P, R], R < D, RoPE rotates the first R dims of
each head and passes the last D - R through; the norm still runs over all D dims (as HF's
glm4_moe: use_qk_norm normalises the whole head, then apply_rotary_pos_emb splits it).

`_qk_rope_kv_kernel`: grid (T,); one program reads token t's row of qkv once, keeps it in
registers through the norm and the rotation, and writes q_out's row and the token's cache slot.
It replaces five launches per layer and step on CUDA (q norm, k norm, RoPE, two index_copy_).

Agreement with the reference `qk_rope_kv_ref` (= `rms_norm_ref` per head -> `rope_ref` ->
`write_kv`, the ops the layer runs on CPU):
  * RMSNorm, HF's op order: fp32 sum of squares, * (1 / D), + eps, rsqrt, cast to the dtype,
    then one weight product rounded to the dtype. As in `rmsnorm_triton.py`, the sum of squares
    runs in another order (and rsqrt may differ): a few fp32 ulps of y, which flips the rounding
    of a small fraction of half-precision values by one ulp of the dtype.
  * RoPE and the K/V write: bit exact given the same normed values (`rope_triton.py`'s
    arithmetic: cos/sin rounded to the dtype, each product and the sum rounded to the dtype).
    Without norm weights (Mixtral) the whole result is bit exact.
The weights must have qkv's dtype (the model's), so that the normed values stay in it.

Slots: as `write_kv`, duplicate slots (CUDA-graph padding rows all point at the null block's slot
0) leave one of their values there, unspecified which. A slot outside [0, num_slots) is not
written (write_kv's index_copy_ would raise; no host sync is allowed here to raise).

NOTE: CUDA-graph capturable: no host syncs, the launch shape depends on T only, and positions /
slots are read on the device (positions unchecked: they must be < P, the table's length). No
step-varying int is a kernel argument (T is the grid) and positions / slots are exempt from
alignment specialization, so one variant serves every step. It needs `enable_fp_fusion=False`
(no fma contraction, as rope_triton). Triton is imported on first use; on CPU the kernel runs
only under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

import torch

from moeserve.kernels.attention import e4m3_triton
from moeserve.kernels.attention.paged import FP8_CACHE_DTYPES, write_kv
from moeserve.kernels.norm_rope.rmsnorm_triton import rms_norm_ref
from moeserve.kernels.norm_rope.rope_triton import rope_ref
from moeserve.kernels.triton_common import next_pow2, require_step_indices, require_triton_device

tl: Any = None  # triton.language, bound by _kernels(): the kernel reads it as a global
_round_e4m3: Any = None  # e4m3_triton.round_e4m3, jitted, bound by _kernels()


def qk_rope_kv_ref(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                   num_heads: int, num_kv_heads: int, q_norm_weight: torch.Tensor | None = None,
                   k_norm_weight: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor:
    """The torch reference: the layer's unfused ops (same contract as `qk_rope_kv_triton`)."""
    q, k, v = split_qkv(qkv, num_heads, num_kv_heads, kv_cache.shape[-1])
    if q_norm_weight is not None:
        q, k = rms_norm_ref(q, q_norm_weight, eps), rms_norm_ref(k, k_norm_weight, eps)
    q, k = rope_ref(positions, q, k, cos, sin)
    write_kv(k, v, kv_cache, slot_mapping)
    return q


def split_qkv(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv [T, (H + 2 KVH) * D] -> views q [T, H, D], k [T, KVH, D], v [T, KVH, D]."""
    t = qkv.shape[0]
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim,
                         num_kv_heads * head_dim], dim=-1)
    return (q.view(t, num_heads, head_dim), k.view(t, num_kv_heads, head_dim),
            v.view(t, num_kv_heads, head_dim))


def qk_rope_kv_triton(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                      num_heads: int, num_kv_heads: int,
                      q_norm_weight: torch.Tensor | None = None,
                      k_norm_weight: torch.Tensor | None = None,
                      eps: float = 0.0) -> torch.Tensor:
    """q/k norm (when weights are given), RoPE and the K/V cache write, one launch.

    Args:
        qkv: [T, (H + 2 KVH) * D], unit last stride (any row stride); not modified.
        positions: [T] integer, each < P (not checked: no host sync).
        cos, sin: [P, R] fp32 contiguous tables (layers/rope.py's), R even and <= D: dims
            [0, R) of each head rotate, [R, D) pass through (partial rotary when R < D).
        kv_cache: [2, num_blocks, block_size, KVH, D], contiguous, qkv's dtype or float8 e4m3
            (paged.to_cache_dtype's rule: rounded to qkv's dtype, then clamped to +-448);
            written in place.
        slot_mapping: [T] int64, token t's K/V go to flat slot slot_mapping[t].
        num_heads, num_kv_heads: H and KVH.
        q_norm_weight, k_norm_weight: both [D] contiguous in qkv's dtype, or both None (no norm).
        eps: the norms' epsilon.
    Returns:
        q [T, H, D]: normed and rotated, a new contiguous tensor.
    """
    _check(qkv, positions, cos, sin, kv_cache, slot_mapping, num_heads, num_kv_heads,
           q_norm_weight, k_norm_weight)
    t, d = qkv.shape[0], kv_cache.shape[-1]
    q_out = torch.empty(t, num_heads, d, dtype=qkv.dtype, device=qkv.device)  # [T, H, D]
    if t == 0:
        return q_out
    has_norm = q_norm_weight is not None
    k_cache = kv_cache[0].view(-1, num_kv_heads, d)  # [num_slots, KVH, D]
    v_cache = kv_cache[1].view(-1, num_kv_heads, d)  # [num_slots, KVH, D]
    half = cos.shape[1] // 2
    num_pass = d - 2 * half
    block_h = next_pow2(max(num_heads, num_kv_heads))
    _kernels().qk_rope_kv[(t,)](
        qkv, positions, cos, sin, q_norm_weight if has_norm else qkv,
        k_norm_weight if has_norm else qkv, q_out, k_cache, v_cache, slot_mapping,
        qkv.stride(0), cos.stride(0), k_cache.shape[0], k_cache.stride(0), 1.0 / d, eps,
        NUM_Q_HEADS=num_heads, NUM_K_HEADS=num_kv_heads, BLOCK_QH=next_pow2(num_heads),
        BLOCK_KH=next_pow2(num_kv_heads), HEAD_DIM=d, HALF=half, BLOCK_HALF=next_pow2(half),
        PASS=num_pass, BLOCK_PASS=next_pow2(num_pass), BLOCK_D=next_pow2(d), HAS_NORM=has_norm,
        FP8_CACHE=kv_cache.dtype in FP8_CACHE_DTYPES,
        num_warps=min(8, max(1, block_h * next_pow2(d // 2) // 512)), enable_fp_fusion=False)
    return q_out


def _check(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           kv_cache: torch.Tensor, slot_mapping: torch.Tensor, num_heads: int,
           num_kv_heads: int, q_norm_weight: torch.Tensor | None,
           k_norm_weight: torch.Tensor | None) -> None:
    def need(ok: bool, what: str) -> None:
        if not ok:
            raise ValueError(f"qk_rope_kv_triton: {what}")

    need(kv_cache.dim() == 5 and kv_cache.shape[0] == 2 and kv_cache.is_contiguous(),
         f"kv_cache must be contiguous [2, num_blocks, block_size, KVH, D], got "
         f"{tuple(kv_cache.shape)}")
    d = kv_cache.shape[-1]
    need(num_heads > 0 and kv_cache.shape[3] == num_kv_heads > 0 and d % 2 == 0,
         f"kv_cache {tuple(kv_cache.shape)} does not hold {num_kv_heads} KV heads of an even "
         f"head_dim (num_heads {num_heads})")
    width = (num_heads + 2 * num_kv_heads) * d
    need(qkv.dim() == 2 and qkv.shape[1] == width and qkv.stride(1) == 1,
         f"qkv must be [T, (H + 2 KVH) * D] = [T, {width}] with a unit last stride, got "
         f"{tuple(qkv.shape)} strides {qkv.stride()}")
    t = qkv.shape[0]
    need(qkv.is_floating_point() and kv_cache.dtype in (qkv.dtype, *FP8_CACHE_DTYPES),
         f"kv_cache {kv_cache.dtype} must be qkv's floating dtype ({qkv.dtype}) or one of "
         f"{FP8_CACHE_DTYPES}")
    require_step_indices(positions, slot_mapping, t, "qk_rope_kv_triton")
    for name, table in (("cos", cos), ("sin", sin)):
        need(table.dim() == 2 and 0 < table.shape[1] <= d and table.shape[1] % 2 == 0
             and table.dtype == torch.float32 and table.is_contiguous(),
             f"{name} must be contiguous fp32 [P, R], R even and <= head_dim {d}, got "
             f"{tuple(table.shape)} {table.dtype}")
    need(cos.shape == sin.shape, f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)} differ")
    tensors = [qkv, positions, cos, sin, kv_cache, slot_mapping]
    need((q_norm_weight is None) == (k_norm_weight is None),
         "give both q_norm_weight and k_norm_weight, or neither")
    for name, w in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
        if w is not None:
            need(w.shape == (d,) and w.is_contiguous() and w.dtype == qkv.dtype,
                 f"{name} must be contiguous [{d}] {qkv.dtype}, got {tuple(w.shape)} {w.dtype}")
            tensors.append(w)
    devices = {x.device for x in tensors}
    need(len(devices) == 1, f"tensors on several devices: {devices}")
    require_triton_device(qkv.device, "qk_rope_kv_triton")


@functools.cache
def _kernels() -> SimpleNamespace:
    """Import triton and jit the kernel and its helper, once (interpreted if TRITON_INTERPRET=1
    now). The kernel calls `_norm_rope_heads` by global name, so it is rebound here."""
    global tl, _norm_rope_heads, _round_e4m3
    import triton
    import triton.language

    tl = triton.language
    _norm_rope_heads, _round_e4m3 = triton.jit(_norm_rope_heads), e4m3_triton.jitted()
    # NOTE: no step-varying int is an argument (T is the grid); positions and slots may be
    # slices of a packed buffer at any offset, so their alignment is not specialized either
    return SimpleNamespace(qk_rope_kv=triton.jit(
        _qk_rope_kv_kernel, do_not_specialize_on_alignment=["positions_ptr", "slots_ptr"]))


# ---- Triton kernel (jitted by _kernels; pointer arguments are untyped, as Triton expects) ----

def _norm_rope_heads(x_ptr, w_ptr, out_ptr, stride_oh, num_stored, c1, c2, s1, s2, inv_d, eps,
                     NUM_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr,
                     HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, PASS: tl.constexpr,
                     BLOCK_PASS: tl.constexpr, HAS_NORM: tl.constexpr,
                     FP8_OUT: tl.constexpr):
    """One token's heads x [NUM_HEADS, HEAD_DIM] (contiguous) -> RMSNorm over all HEAD_DIM
    dims (HAS_NORM) -> RoPE on the first 2 * HALF dims, the last PASS (= HEAD_DIM - 2 * HALF)
    as normed -> out (head stride stride_oh); heads >= num_stored are not stored (0: none).
    c1, c2, s1, s2 [BLOCK_HALF] fp32, already rounded to x's dtype. FP8_OUT: out is a float8
    e4m3 cache, stored as the unfused path does (rounded to x's dtype, clamped to +-448)."""
    h = tl.arange(0, BLOCK_H)  # [BH]
    i = tl.arange(0, BLOCK_HALF)  # [BHALF]
    mask = (h < NUM_HEADS)[:, None] & (i < HALF)[None, :]  # [BH, BHALF]
    offs = h[:, None] * HEAD_DIM + i[None, :]  # [BH, BHALF]
    dt = x_ptr.dtype.element_ty
    x1 = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)  # first halves
    x2 = tl.load(x_ptr + offs + HALF, mask=mask, other=0.0).to(tl.float32)  # second halves
    if PASS > 0:  # partial rotary: the dims after the rotary ones
        p = tl.arange(0, BLOCK_PASS)  # [BPASS]
        pass_mask = (h < NUM_HEADS)[:, None] & (p < PASS)[None, :]  # [BH, BPASS]
        pass_offs = h[:, None] * HEAD_DIM + 2 * HALF + p[None, :]  # [BH, BPASS]
        xp = tl.load(x_ptr + pass_offs, mask=pass_mask, other=0.0).to(tl.float32)
    if HAS_NORM:  # rms_norm_ref's ops: fp32 y, cast to dt, one weight product rounded to dt
        sum_sq = (tl.reduce(x1 * x1, 1, tl.standard._sum_combine)
                  + tl.reduce(x2 * x2, 1, tl.standard._sum_combine))  # [BH]
        if PASS > 0:  # the norm spans the whole head
            sum_sq += tl.reduce(xp * xp, 1, tl.standard._sum_combine)
        r = tl.rsqrt(sum_sq * inv_d + eps)[:, None]  # [BH, 1]
        w1 = tl.load(w_ptr + i, mask=i < HALF, other=0.0).to(tl.float32)  # [BHALF]
        w2 = tl.load(w_ptr + HALF + i, mask=i < HALF, other=0.0).to(tl.float32)
        x1 = (w1[None, :] * (x1 * r).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        x2 = (w2[None, :] * (x2 * r).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        if PASS > 0:
            wp = tl.load(w_ptr + 2 * HALF + p, mask=p < PASS, other=0.0).to(tl.float32)
            xp = (wp[None, :] * (xp * r).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    # x * cos + rotate_half(x) * sin, each product and the sum rounded to dt (as torch does)
    o1 = (x1 * c1[None, :]).to(dt).to(tl.float32) + (-x2 * s1[None, :]).to(dt).to(tl.float32)
    o2 = (x2 * c2[None, :]).to(dt).to(tl.float32) + (x1 * s2[None, :]).to(dt).to(tl.float32)
    out_offs = h[:, None] * stride_oh + i[None, :]  # [BH, BHALF]
    # NOTE: a bound on h, not `mask & scalar_bool`: the interpreter turns the latter into int32
    store_mask = (h < num_stored)[:, None] & (i < HALF)[None, :]  # [BH, BHALF]
    ot = out_ptr.dtype.element_ty
    o1, o2 = o1.to(dt), o2.to(dt)
    if FP8_OUT:
        o1, o2 = _round_e4m3(o1.to(tl.float32)), _round_e4m3(o2.to(tl.float32))
    tl.store(out_ptr + out_offs, o1.to(ot), mask=store_mask)
    tl.store(out_ptr + out_offs + HALF, o2.to(ot), mask=store_mask)
    if PASS > 0:
        pass_store = (h < num_stored)[:, None] & (p < PASS)[None, :]  # [BH, BPASS]
        xp = xp.to(dt)
        if FP8_OUT:
            xp = _round_e4m3(xp.to(tl.float32))
        tl.store(out_ptr + h[:, None] * stride_oh + 2 * HALF + p[None, :], xp.to(ot),
                 mask=pass_store)


def _qk_rope_kv_kernel(qkv_ptr, positions_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, q_out_ptr,
                       k_cache_ptr, v_cache_ptr, slots_ptr, stride_qkv, stride_cos, num_slots,
                       stride_slot, inv_d, eps, NUM_Q_HEADS: tl.constexpr,
                       NUM_K_HEADS: tl.constexpr, BLOCK_QH: tl.constexpr,
                       BLOCK_KH: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
                       BLOCK_HALF: tl.constexpr, PASS: tl.constexpr, BLOCK_PASS: tl.constexpr,
                       BLOCK_D: tl.constexpr, HAS_NORM: tl.constexpr,
                       FP8_CACHE: tl.constexpr):
    """Token pid: q [H, D] -> q_out row; k [KVH, D] -> k_cache slot; v [KVH, D] -> v_cache slot.
    Caches are [num_slots, KVH, D] (slot stride stride_slot, head stride HEAD_DIM = D); RoPE
    on each head's first 2 * HALF dims, the last PASS = D - 2 * HALF pass through."""
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + t).to(tl.int64)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    # out-of-range slots are not written: 0 heads stored
    num_kv_stored = tl.where((slot >= 0) & (slot < num_slots), NUM_K_HEADS, 0)
    i = tl.arange(0, BLOCK_HALF)  # [BHALF]
    im = i < HALF
    dt = qkv_ptr.dtype.element_ty
    row = pos * stride_cos
    # cos/sin rounded to q's dtype first (HF's .to(q.dtype)), then used in fp32
    c1 = tl.load(cos_ptr + row + i, mask=im, other=0.0).to(dt).to(tl.float32)  # [BHALF]
    c2 = tl.load(cos_ptr + row + HALF + i, mask=im, other=0.0).to(dt).to(tl.float32)
    s1 = tl.load(sin_ptr + row + i, mask=im, other=0.0).to(dt).to(tl.float32)
    s2 = tl.load(sin_ptr + row + HALF + i, mask=im, other=0.0).to(dt).to(tl.float32)
    q_ptr = qkv_ptr + t * stride_qkv  # [H, D] heads of this token's row
    k_ptr = q_ptr + NUM_Q_HEADS * HEAD_DIM  # [KVH, D]
    v_ptr = k_ptr + NUM_K_HEADS * HEAD_DIM  # [KVH, D]
    _norm_rope_heads(q_ptr, qw_ptr, q_out_ptr + t * (NUM_Q_HEADS * HEAD_DIM), HEAD_DIM,
                     NUM_Q_HEADS, c1, c2, s1, s2, inv_d, eps, NUM_Q_HEADS, BLOCK_QH, HEAD_DIM,
                     HALF, BLOCK_HALF, PASS, BLOCK_PASS, HAS_NORM, False)
    slot_offs = slot * stride_slot
    _norm_rope_heads(k_ptr, kw_ptr, k_cache_ptr + slot_offs, HEAD_DIM, num_kv_stored,
                     c1, c2, s1, s2, inv_d, eps, NUM_K_HEADS, BLOCK_KH, HEAD_DIM, HALF,
                     BLOCK_HALF, PASS, BLOCK_PASS, HAS_NORM, FP8_CACHE)
    h = tl.arange(0, BLOCK_KH)  # [BKH]
    d = tl.arange(0, BLOCK_D)  # [BD]
    v_offs = h[:, None] * HEAD_DIM + d[None, :]  # [BKH, BD]
    v = tl.load(v_ptr + v_offs, mask=(h < NUM_K_HEADS)[:, None] & (d < HEAD_DIM)[None, :],
                other=0.0)  # [BKH, BD]
    if FP8_CACHE:
        v = _round_e4m3(v.to(tl.float32))
    tl.store(v_cache_ptr + slot_offs + v_offs, v.to(v_cache_ptr.dtype.element_ty),
             mask=(h < num_kv_stored)[:, None] & (d < HEAD_DIM)[None, :])
