"""Rotary position embedding (neox style, rotate_half) on q and k in one Triton launch, and the
torch reference.

    c, s = cos[positions].to(q.dtype), sin[positions].to(q.dtype)     tables [P, R] fp32, R <= D
    q_rot, q_pass = q[..., :R], q[..., R:]
    q' = cat(q_rot * c + rotate_half(q_rot) * s, q_pass)
    rotate_half(x) = cat(-x[..., R/2:], x[..., :R/2])                 (the same for k)

R (rotary_dim, the tables' width) is the head_dim D for full RoPE; R < D is partial rotary
(GLM-4.5's partial_rotary_factor 0.5, as transformers' glm4_moe apply_rotary_pos_emb): the
first R dims of each head rotate, the last D - R pass through unchanged.

`_rope_kernel`: grid (T,); one program rotates every q head and every k head of one token,
reading that token's cos/sin rows once. Each half of a head's rotary part is loaded separately,
so rotate_half costs nothing: out1 = x1 * c1 - x2 * s1, out2 = x2 * c2 + x1 * s2; the pass
part (partial rotary) is copied as is, or left alone in place.

Rounding: as Hugging Face, cos/sin are rounded to q's dtype, then each product and the sum are
rounded to q's dtype (a product of two values of a half dtype is exact in fp32, and torch adds
two half values in fp32 and rounds once), so the result equals `rope_ref` bit for bit in fp32,
fp16 and bf16. NOTE: that needs `enable_fp_fusion=False` (no fma contraction of the fp32
products into the sum); the kernel is memory bound, so it costs nothing.

q [T, H, D] and k [T, KVH, D] may be strided views (of the fused qkv output): any token and head
strides, unit last stride. Out of place (default), the results are new contiguous tensors;
`inplace=True` writes into q and k (safe: a program reads its heads before it writes them).
NOTE: CUDA-graph capturable (no host syncs; positions are read on the device, unchecked: they
must be < P). Triton is imported on first use; on CPU it runs only under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

import torch

from moeserve.kernels.triton_common import next_pow2, require_triton_device

tl: Any = None  # triton.language, bound by _kernels(): the kernel reads it as a global


def rope_ref(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
             sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch reference (HF's exact ops): q [T, H, D], k [T, KVH, D], positions [T],
    cos/sin [P, R] fp32 (R <= D: the first R dims rotate) -> (q', k') in q's dtype."""
    c = cos[positions].to(q.dtype)[:, None, :]  # [T, 1, R]
    s = sin[positions].to(q.dtype)[:, None, :]  # [T, 1, R]
    r = cos.shape[-1]
    if r == q.shape[-1]:
        return q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s
    q_rot, k_rot = q[..., :r], k[..., :r]
    return (torch.cat((q_rot * c + _rotate_half(q_rot) * s, q[..., r:]), dim=-1),
            torch.cat((k_rot * c + _rotate_half(k_rot) * s, k[..., r:]), dim=-1))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_triton(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, inplace: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE on q and k at `positions`, one launch.

    Args:
        positions: [T] integer, each < P (not checked: no host sync).
        q: [T, H, D], k: [T, KVH, D], same floating dtype, unit stride on D (token and head
            strides free).
        cos, sin: [P, R] fp32 contiguous tables (layers/rope.py's), R even and <= D: dims
            [0, R) of each head rotate, [R, D) pass through (partial rotary when R < D).
        inplace: write into q and k instead of new tensors (the pass dims are not touched).
    Returns:
        (q', k'): new contiguous tensors, or q and k themselves when inplace.
    """
    _check(positions, q, k, cos, sin)
    q_out = q if inplace else torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = k if inplace else torch.empty(k.shape, dtype=k.dtype, device=k.device)
    t, h, d = q.shape
    if t == 0:
        return q_out, k_out
    kvh = k.shape[1]
    half = cos.shape[1] // 2
    num_pass = 0 if inplace else d - 2 * half  # in place, the pass dims stay where they are
    block_h = next_pow2(max(h, kvh))
    _kernels().rope[(t,)](
        positions, q, k, q_out, k_out, cos, sin,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1), cos.stride(0),
        NUM_Q_HEADS=h, NUM_K_HEADS=kvh, BLOCK_QH=next_pow2(h), BLOCK_KH=next_pow2(kvh),
        HALF=half, BLOCK_HALF=next_pow2(half), PASS=num_pass, BLOCK_PASS=next_pow2(num_pass),
        num_warps=min(8, max(1, block_h * next_pow2(d // 2) // 512)), enable_fp_fusion=False)
    return q_out, k_out


def _check(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
           sin: torch.Tensor) -> None:
    def need(ok: bool, what: str) -> None:
        if not ok:
            raise ValueError(f"rope_triton: {what}")

    need(q.dim() == 3 and k.dim() == 3, f"q, k must be [T, H, D], got {tuple(q.shape)}, "
         f"{tuple(k.shape)}")
    t, _, d = q.shape
    need(k.shape[0] == t and k.shape[2] == d and positions.shape == (t,),
         f"shapes disagree: q {tuple(q.shape)}, k {tuple(k.shape)}, positions "
         f"{tuple(positions.shape)}")
    need(d % 2 == 0 and q.stride(2) == 1 and k.stride(2) == 1,
         "head_dim must be even with unit stride")
    need(q.dtype == k.dtype and q.is_floating_point(), f"q {q.dtype}, k {k.dtype}")
    need(not positions.is_floating_point(), f"positions must be integer, got {positions.dtype}")
    for name, table in (("cos", cos), ("sin", sin)):
        need(table.dim() == 2 and 0 < table.shape[1] <= d and table.shape[1] % 2 == 0
             and table.dtype == torch.float32 and table.is_contiguous(),
             f"{name} must be contiguous fp32 [P, R], R even and <= head_dim {d}, got "
             f"{tuple(table.shape)} {table.dtype}")
    need(cos.shape == sin.shape, "cos and sin shapes differ")
    devices = {positions.device, q.device, k.device, cos.device, sin.device}
    need(len(devices) == 1, f"tensors on several devices: {devices}")
    require_triton_device(q.device, "rope_triton")


@functools.cache
def _kernels() -> SimpleNamespace:
    """Import triton and jit the kernel and its helper, once (interpreted if TRITON_INTERPRET=1
    now). The kernel calls `_rotate_heads` by global name, so it is rebound here."""
    global tl, _rotate_heads
    import triton
    import triton.language

    tl = triton.language
    _rotate_heads = triton.jit(_rotate_heads)
    return SimpleNamespace(rope=triton.jit(_rope_kernel))


# ---- Triton kernel (jitted by _kernels; pointer arguments are untyped, as Triton expects) ----

def _rotate_heads(x_ptr, out_ptr, stride_h, stride_oh, c1, c2, s1, s2,
                  NUM_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, HALF: tl.constexpr,
                  BLOCK_HALF: tl.constexpr, PASS: tl.constexpr, BLOCK_PASS: tl.constexpr):
    """One token's heads: x [NUM_HEADS, 2 * HALF + PASS] (row stride stride_h) -> out: the
    first 2 * HALF dims rotated, the next PASS copied (0: none). c1, c2, s1, s2 [BLOCK_HALF]
    fp32, already rounded to x's dtype."""
    h = tl.arange(0, BLOCK_H)  # [BH]
    i = tl.arange(0, BLOCK_HALF)  # [BHALF]
    mask = (h < NUM_HEADS)[:, None] & (i < HALF)[None, :]  # [BH, BHALF]
    offs = h[:, None] * stride_h + i[None, :]
    out_offs = h[:, None] * stride_oh + i[None, :]
    x1 = tl.load(x_ptr + offs, mask=mask, other=0.0)  # [BH, BHALF] first halves
    x2 = tl.load(x_ptr + offs + HALF, mask=mask, other=0.0)  # second halves
    dt = x_ptr.dtype.element_ty
    x1, x2 = x1.to(tl.float32), x2.to(tl.float32)
    # x * cos + rotate_half(x) * sin, each product and the sum rounded to dt (as torch does)
    o1 = (x1 * c1[None, :]).to(dt).to(tl.float32) + (-x2 * s1[None, :]).to(dt).to(tl.float32)
    o2 = (x2 * c2[None, :]).to(dt).to(tl.float32) + (x1 * s2[None, :]).to(dt).to(tl.float32)
    tl.store(out_ptr + out_offs, o1.to(dt), mask=mask)
    tl.store(out_ptr + out_offs + HALF, o2.to(dt), mask=mask)
    if PASS > 0:  # partial rotary, out of place: dims [2 * HALF, 2 * HALF + PASS) as they are
        p = tl.arange(0, BLOCK_PASS)  # [BPASS]
        pass_mask = (h < NUM_HEADS)[:, None] & (p < PASS)[None, :]  # [BH, BPASS]
        xp = tl.load(x_ptr + h[:, None] * stride_h + 2 * HALF + p[None, :], mask=pass_mask)
        tl.store(out_ptr + h[:, None] * stride_oh + 2 * HALF + p[None, :], xp, mask=pass_mask)


def _rope_kernel(positions_ptr, q_ptr, k_ptr, q_out_ptr, k_out_ptr, cos_ptr, sin_ptr,
                 stride_qt, stride_qh, stride_kt, stride_kh,
                 stride_qot, stride_qoh, stride_kot, stride_koh, stride_cos,
                 NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, BLOCK_QH: tl.constexpr,
                 BLOCK_KH: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
                 PASS: tl.constexpr, BLOCK_PASS: tl.constexpr):
    """Token pid: q [H, D] and k [KVH, D] rotated by the cos/sin rows at its position (their
    first 2 * HALF dims; the next PASS dims copied)."""
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + t).to(tl.int64)
    i = tl.arange(0, BLOCK_HALF)  # [BHALF]
    im = i < HALF
    dt = q_ptr.dtype.element_ty
    row = pos * stride_cos
    # cos/sin rounded to q's dtype first (HF's .to(q.dtype)), then used in fp32
    c1 = tl.load(cos_ptr + row + i, mask=im, other=0.0).to(dt).to(tl.float32)  # [BHALF]
    c2 = tl.load(cos_ptr + row + HALF + i, mask=im, other=0.0).to(dt).to(tl.float32)
    s1 = tl.load(sin_ptr + row + i, mask=im, other=0.0).to(dt).to(tl.float32)
    s2 = tl.load(sin_ptr + row + HALF + i, mask=im, other=0.0).to(dt).to(tl.float32)
    _rotate_heads(q_ptr + t * stride_qt, q_out_ptr + t * stride_qot, stride_qh, stride_qoh,
                  c1, c2, s1, s2, NUM_Q_HEADS, BLOCK_QH, HALF, BLOCK_HALF, PASS, BLOCK_PASS)
    _rotate_heads(k_ptr + t * stride_kt, k_out_ptr + t * stride_kot, stride_kh, stride_koh,
                  c1, c2, s1, s2, NUM_K_HEADS, BLOCK_KH, HALF, BLOCK_HALF, PASS, BLOCK_PASS)
