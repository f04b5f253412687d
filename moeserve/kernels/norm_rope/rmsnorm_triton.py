"""RMSNorm, optionally fused with the residual add before it: one Triton kernel and the reference.

Hugging Face's order of operations (Qwen3 / Mixtral), which both paths follow:

    residual given:  s = residual + x        in x's dtype (HF's `hidden = residual + hidden`)
                     x = s, and s is returned as the new residual
    parts:           x [T, S, D] with residual [T, D]: x is first x.sum(1) in x's dtype (fp32
                     sum, rounded once, as torch's), so the MoE layer's k weighted expert rows
                     [T, k, D] are added here instead of in a pass of their own (the "sum"
                     combine: 0.85 ms of a 30 ms decode step at 1,024 rows on the H200, plus a
                     write and a read of [T, D])
    x32 = x.float();  y = x32 * rsqrt(mean(x32^2, -1) + eps)                fp32
    out = weight * y.to(x.dtype)        one product, rounded to promote(weight.dtype, x.dtype)

`_rms_norm_kernel`: one program normalises BLOCK_ROWS rows of D (1 row of 2048 for the hidden
norms, 16 rows of 128 for the per-head q/k norms), in registers, one read and one write per
element. x is [..., D] with a unit last stride; a 3-D x [T, H, D] may be a strided view (q and k
split from the fused qkv output): row r is (t, h) = (r // H, r % H), addressed through both
strides, so no copy is made. The outputs are new contiguous tensors.

Agreement with `rms_norm_ref`: the residual sum is bit exact (an fp32 add of two values of the
dtype, rounded once, as torch computes it) and so is the weight product (exact in fp32, rounded
once); y differs only by the order of the fp32 sum of squares and by rsqrt's implementation
(a few fp32 ulps), which flips the rounding of a small fraction of half-precision outputs by one
ulp of the dtype (tests/kernels/test_norm_rope_triton.py states the bounds).

NOTE: CUDA-graph capturable: no host syncs, the launch shape depends on shapes only. Triton is
imported on first use (`_kernels`); on CPU the kernel runs only under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

import torch

from moeserve.kernels.triton_common import next_pow2, require_triton_device

MAX_DIM = 16384  # one row lives in registers
ROW_ELEMENTS = 2048  # elements per program: rows of 2048 one by one, rows of 128 16 at a time
tl: Any = None  # triton.language, bound by _kernels(): the kernel reads it as a global


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None
                 ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The torch reference (HF's exact ops). Returns out, or (out, new residual) with residual.
    With residual [..., D] and x [..., S, D] (parts), x.sum(-2) is the x added."""
    if residual is not None and x.dim() == residual.dim() + 1:
        x = x.squeeze(-2) if x.shape[-2] == 1 else x.sum(-2)
    if residual is not None:
        x = residual = residual + x
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * x32.to(x.dtype)
    return out if residual is None else (out, residual)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float,
                    residual: torch.Tensor | None = None
                    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dimension, fused with the residual add when `residual` is given.

    Args:
        x: [..., D], unit stride on the last dimension (a 3-D strided view is read in place;
            other layouts are copied first).
        weight: [D], contiguous.
        eps: added to the mean square.
        residual: None, or a tensor of x's shape and dtype (any strides, as x); or, with x
            [T, S, D] (parts, any strides with a unit last one), a contiguous [T, D] of x's
            dtype: the x added to it is x.sum(1).
    Returns:
        out [..., D] (dtype promote(weight, x)), or (out, s) with s = residual + x [..., D] in
        x's dtype: the next layer's residual. Both contiguous, new tensors.
    """
    _check(x, weight, residual)
    d = x.shape[-1]
    parts = residual is not None and x.dim() == residual.dim() + 1
    shape = residual.shape if parts else x.shape
    out = torch.empty(shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    new_residual = None
    if residual is not None:
        new_residual = torch.empty(shape, dtype=x.dtype, device=x.device)
    if parts:  # x [T, S, D]: row t sums x[t, 0..S-1]
        num_parts, stride_part = x.shape[1], x.stride(1)
        x3, r3 = x[:, :1], residual.unsqueeze(1)  # [T, 1, D] each
    else:
        num_parts, stride_part = 1, 0
        x3 = _rows_view(x)  # [A, B, D]: row r = (r // B, r % B)
        r3 = _rows_view(residual) if residual is not None else x3
    num_rows = x3.shape[0] * x3.shape[1]
    if num_rows == 0:
        return out if residual is None else (out, new_residual)
    block_d = next_pow2(d)
    block_rows = max(1, ROW_ELEMENTS // block_d)
    grid = (-(-num_rows // block_rows),)
    _kernels().rms_norm[grid](
        x3, r3, weight, out, new_residual if residual is not None else out,
        num_rows, x3.shape[1], x3.stride(0), x3.stride(1), stride_part, r3.stride(0),
        r3.stride(1), 1.0 / d, eps, D=d, BLOCK_D=block_d, BLOCK_ROWS=block_rows,
        HAS_RESIDUAL=residual is not None, NUM_PARTS=num_parts,
        num_warps=min(8, max(1, block_rows * block_d // 256)), enable_fp_fusion=False)
    return out if residual is None else (out, new_residual)


def _rows_view(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] as [A, B, D] with a unit last stride (a view where one exists)."""
    d = x.shape[-1]
    if x.stride(-1) != 1 and x.numel() > 0:
        x = x.contiguous()
    if x.dim() == 1:
        return x.view(1, 1, d)
    if x.dim() == 2:
        return x.unsqueeze(1)  # [N, 1, D]
    if x.dim() == 3:
        return x
    return x.reshape(-1, x.shape[-2], d)


def _check(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> None:
    def need(ok: bool, what: str) -> None:
        if not ok:
            raise ValueError(f"rms_norm_triton: {what}")

    need(x.dim() >= 1 and 0 < x.shape[-1] <= MAX_DIM, f"last dimension must be in "
         f"1..{MAX_DIM}, got shape {tuple(x.shape)}")
    d = x.shape[-1]
    need(weight.shape == (d,) and weight.is_contiguous(), f"weight must be contiguous [{d}], got "
         f"{tuple(weight.shape)}")
    need(x.is_floating_point() and weight.is_floating_point(), "x and weight must be floating")
    need(weight.device == x.device, f"weight on {weight.device}, x on {x.device}")
    if residual is not None and x.dim() == 3 and residual.dim() == 2:  # parts
        need(residual.shape == (x.shape[0], d) and residual.is_contiguous()
             and residual.dtype == x.dtype and residual.device == x.device
             and x.stride(-1) == 1 and x.shape[1] >= 1,
             f"parts: residual must be contiguous [{x.shape[0]}, {d}] {x.dtype} for x "
             f"{tuple(x.shape)} with a unit last stride, got {tuple(residual.shape)} "
             f"{residual.dtype}")
    elif residual is not None:
        need(residual.shape == x.shape and residual.dtype == x.dtype
             and residual.device == x.device,
             f"residual must match x {tuple(x.shape)} {x.dtype} (or be [T, D] for x [T, S, D]), "
             f"got {tuple(residual.shape)} {residual.dtype}")
    require_triton_device(x.device, "rms_norm_triton")


@functools.cache
def _kernels() -> SimpleNamespace:
    """Import triton and jit the kernel, once (interpreted if TRITON_INTERPRET=1 now)."""
    global tl, _sum
    import triton
    import triton.language

    tl = triton.language
    _sum = triton.jit(_sum)
    # the row count changes every step: no variant per value (paged_attention_triton.py)
    return SimpleNamespace(rms_norm=triton.jit(_rms_norm_kernel, do_not_specialize=["num_rows"]))


# ---- Triton kernel (jitted by _kernels; pointer arguments are untyped, as Triton expects) ----

def _sum(x, AXIS: tl.constexpr):
    """Sum over AXIS, as tl.sum but without its own jit wrapper, so it also runs in the
    interpreter when triton was imported before TRITON_INTERPRET=1 was set."""
    return tl.reduce(x, AXIS, tl.standard._sum_combine)


def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, num_rows, heads,
                     stride_xa, stride_xb, stride_xp, stride_ra, stride_rb, inv_d, eps,
                     D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                     HAS_RESIDUAL: tl.constexpr, NUM_PARTS: tl.constexpr):
    """Rows pid * BLOCK_ROWS .. + BLOCK_ROWS of x [A, B, D] (strided) -> out [A * B, D]
    (contiguous); NUM_PARTS > 1: x := the fp32 sum of the NUM_PARTS rows stride_xp apart,
    rounded to x's dtype; HAS_RESIDUAL: x := res + x, stored to res_out [A * B, D] first."""
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)  # [R]
    cols = tl.arange(0, BLOCK_D)  # [BD]
    mask = (rows < num_rows)[:, None] & (cols < D)[None, :]  # [R, BD]
    rows = rows.to(tl.int64)
    a, b = rows // heads, rows % heads  # [R]
    x_offs = (a * stride_xa + b * stride_xb)[:, None] + cols[None, :]  # [R, BD]
    x = tl.load(x_ptr + x_offs, mask=mask, other=0.0)  # [R, BD] x's dtype
    if NUM_PARTS > 1:  # the MoE's k expert rows of each token, in order, as torch's sum
        part_sum = x.to(tl.float32)
        for j in range(1, NUM_PARTS):
            part_sum += tl.load(x_ptr + x_offs + j * stride_xp, mask=mask,
                                other=0.0).to(tl.float32)
        x = part_sum.to(x_ptr.dtype.element_ty)
    out_offs = rows[:, None] * D + cols[None, :]  # [R, BD] contiguous outputs
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + (a * stride_ra + b * stride_rb)[:, None] + cols[None, :],
                    mask=mask, other=0.0)
        x = (r.to(tl.float32) + x.to(tl.float32)).to(x_ptr.dtype.element_ty)  # torch's add
        tl.store(res_out_ptr + out_offs, x, mask=mask)
    x32 = x.to(tl.float32)
    mean_sq = _sum(x32 * x32, 1) * inv_d  # [R]; * (1 / D): torch's CUDA mean
    y = x32 * tl.rsqrt(mean_sq + eps)[:, None]  # [R, BD] fp32
    y = y.to(x_ptr.dtype.element_ty).to(tl.float32)  # HF casts before the weight multiply
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)  # [BD]
    tl.store(out_ptr + out_offs, (w[None, :] * y).to(out_ptr.dtype.element_ty), mask=mask)
