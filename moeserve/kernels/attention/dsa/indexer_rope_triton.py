"""The DSA indexer's step between its projections and its scores, in two Triton launches: the
key's LayerNorm, its RoPE and its write into the paged indexer-key cache (`indexer_keys_triton`),
and the query's RoPE over every head (`indexer_q_rope_triton`). And their torch references, the
ops layers/dsa.py's Indexer runs off CUDA (`indexer_keys_ref`, `indexer_q_rope_ref`).

    k [T, D]  (in_proj's indexer-key rows of token t)
      --LayerNorm (weight, bias [D], eps)--> y --RoPE of y[:R] at t's position-->
      [rotated evens | rotated odds | y[R:]]            -> index_cache[slot]
    q [T, H, D]  (wq_b's output)
      --RoPE of q[t, h, :R]--> [rotated | q[t, h, R:]]    -> a new [T, H, D]

The indexer splits q / k as [rope | pass] (the main attention's q is [nope | rope]); RoPE as
mla/rope_cache_triton.py's `rotate_pairs` (pairs (x[2i], x[2i + 1]) laid out as [rotated evens |
rotated odds], or (x[i], x[i + R / 2])), with cos / sin [T, R / 2] the rows the MLA layer's
fused step already gathered at each token's position (`Projected.cos` / `.sin`).

Why: the unfused ops are about twenty launches a full DSA layer and step (the key's norm, per
rotation two casts of cos / sin, four products, a sum, a difference and two cats, the write's
index_copy_; the query's rotation likewise): at a decode step of few rows each is a few
microseconds of an attention that takes ~0.1 ms at 32 rows of 8k (benchmarks/results/
gpu_613e1d1/README.md). Fused, the key write and query RoPE take 0.0107 ms in place of 0.0497
at 32 decode tokens (H100, CUDA graphs; benchmarks/results/gpu_56e6f7e/call1): on by default
since (`FUSED_ON_CUDA`, layers/dsa.py; `Indexer.fused` forces either way).

Agreement with the references: RoPE and the write bit exact (cos / sin rounded to the dtype,
each product and sum rounded to the dtype, no fma: rope_cache_triton's `_round` / `_rotate`);
the LayerNorm as torch's: the mean and variance in fp32, (x - mean) * rstd * weight + bias in
fp32, rounded once to the dtype. Its sums run in another order, so the normed key can differ in
its last fp32 bits, and in half precision a small fraction of its values by one ulp of the
dtype. A slot outside [0, num_slots) is not written (no host sync to raise); duplicate slots
(CUDA-graph padding) leave one of their rows. CUDA-graph capturable: the launch shape depends
on T only, slots read on the device, no step-varying int an argument. Triton is imported on
first use; on CPU the kernels run only under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

import torch

from moeserve.kernels.attention.mla import rope_cache_triton
from moeserve.kernels.attention.mla.rope_cache_triton import rotate_pairs
from moeserve.kernels.triton_common import next_pow2, require_triton_device

tl: Any = None  # triton.language, bound by _kernels(): the kernels read it as a global
_round: Any = None  # rope_cache_triton's jitted helpers, bound by _kernels()
_rotate: Any = None
_norm_at: Any = None  # jitted by _kernels()


def rope_first(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               interleaved: bool) -> torch.Tensor:
    """x [..., D] with its first R = 2 cos.shape[-1] dims rotated (rotate_pairs) and the rest
    as they are: the indexer's [rope | pass] RoPE."""
    r = 2 * cos.shape[-1]
    return torch.cat([rotate_pairs(x[..., :r], cos, sin, interleaved), x[..., r:]], dim=-1)


def indexer_keys_ref(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     weight: torch.Tensor, bias: torch.Tensor, eps: float,
                     index_cache: torch.Tensor, slot_mapping: torch.Tensor,
                     interleaved: bool) -> torch.Tensor:
    """The unfused ops: LayerNorm(k) with RoPE on its first R dims, written at slot_mapping
    (every slot must be in range: index_copy_ raises otherwise). Returns the keys [T, D]."""
    keys = rope_first(torch.nn.functional.layer_norm(k, k.shape[-1:], weight, bias, eps),
                      cos, sin, interleaved)
    index_cache.view(-1, index_cache.shape[-1]).index_copy_(0, slot_mapping, keys)
    return keys


def indexer_q_rope_ref(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       interleaved: bool) -> torch.Tensor:
    """The unfused ops: q [T, H, D] with RoPE on each head's first R dims."""
    return rope_first(q, cos, sin, interleaved)


def indexer_keys_triton(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        weight: torch.Tensor, bias: torch.Tensor, eps: float,
                        index_cache: torch.Tensor, slot_mapping: torch.Tensor,
                        interleaved: bool) -> None:
    """The key's LayerNorm, RoPE and cache write, one launch.

    Args:
        k: [T, D] floating, unit last stride (any row stride: a view of in_proj's output).
        cos, sin: [T, R / 2] fp32, unit last stride (the rows at each token's position), R
            even and at most D.
        weight, bias: [D] contiguous, k's dtype; eps: the norm's epsilon.
        index_cache: [num_blocks, block_size, D] contiguous, k's dtype; written in place.
        slot_mapping: [T] int64: token t's key goes to flat slot slot_mapping[t] (out of
            range: not written).
        interleaved: RoPE pairs (x[2i], x[2i + 1]), else (x[i], x[i + R / 2]).
    """
    _check_keys(k, cos, sin, weight, bias, index_cache, slot_mapping)
    t, dim = k.shape
    half = cos.shape[1]
    if t == 0:
        return
    _kernels().keys[(t,)](
        k, cos, sin, weight, bias, index_cache, slot_mapping, k.stride(0), cos.stride(0),
        sin.stride(0), index_cache.shape[0] * index_cache.shape[1], eps,
        D=dim, BLOCK_D=next_pow2(dim), HALF=half, BLOCK_HALF=next_pow2(half),
        PAIR_STEP=2 if interleaved else 1, PAIR_OFFSET=1 if interleaved else half,
        BF16=k.dtype == torch.bfloat16, num_warps=1, enable_fp_fusion=False)


def indexer_q_rope_triton(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                          interleaved: bool) -> torch.Tensor:
    """q [T, H, D] (unit last stride, any token and head strides; not modified) with RoPE on
    each head's first R = 2 cos.shape[1] dims, cos / sin [T, R / 2] fp32: a new contiguous
    [T, H, D], one launch."""
    _check_q(q, cos, sin)
    t, heads, dim = q.shape
    half = cos.shape[1]
    out = torch.empty(t, heads, dim, dtype=q.dtype, device=q.device)
    if t == 0:
        return out
    _kernels().q_rope[(t,)](
        q, cos, sin, out, q.stride(0), q.stride(1), cos.stride(0), sin.stride(0),
        NUM_HEADS=heads, BLOCK_H=next_pow2(heads), D=dim, HALF=half,
        BLOCK_HALF=next_pow2(half), BLOCK_PASS=next_pow2(max(1, dim - 2 * half)),
        PAIR_STEP=2 if interleaved else 1, PAIR_OFFSET=1 if interleaved else half,
        BF16=q.dtype == torch.bfloat16,
        num_warps=min(8, max(1, next_pow2(heads) * next_pow2(dim) // 1024)),
        enable_fp_fusion=False)
    return out


def _check_tables(cos: torch.Tensor, sin: torch.Tensor, t: int, dim: int, who: str) -> None:
    for name, table in (("cos", cos), ("sin", sin)):
        if (table.dim() != 2 or table.shape[0] != t or table.dtype != torch.float32
                or table.stride(1) != 1 or not 0 < 2 * table.shape[1] <= dim):
            raise ValueError(f"{who}: {name} must be fp32 [{t}, R / 2] with a unit last "
                             f"stride and 0 < R <= {dim}, got {tuple(table.shape)} "
                             f"{table.dtype} strides {table.stride()}")
    if cos.shape != sin.shape:
        raise ValueError(f"{who}: cos {tuple(cos.shape)} and sin {tuple(sin.shape)} differ")


def _check_keys(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor, index_cache: torch.Tensor,
                slot_mapping: torch.Tensor) -> None:
    who = "indexer_keys_triton"
    if k.dim() != 2 or not k.is_floating_point() or k.stride(1) != 1:
        raise ValueError(f"{who}: k must be floating [T, D] with a unit last stride, got "
                         f"{tuple(k.shape)} {k.dtype} strides {k.stride()}")
    t, dim = k.shape
    _check_tables(cos, sin, t, dim, who)
    for name, p in (("weight", weight), ("bias", bias)):
        if p.shape != (dim,) or p.dtype != k.dtype or not p.is_contiguous():
            raise ValueError(f"{who}: {name} must be contiguous [{dim}] {k.dtype}, got "
                             f"{tuple(p.shape)} {p.dtype}")
    if (index_cache.dim() != 3 or index_cache.shape[-1] != dim
            or index_cache.dtype != k.dtype or not index_cache.is_contiguous()):
        raise ValueError(f"{who}: index_cache must be contiguous [num_blocks, block_size, "
                         f"{dim}] {k.dtype}, got {tuple(index_cache.shape)} "
                         f"{index_cache.dtype}")
    if slot_mapping.shape != (t,) or slot_mapping.dtype != torch.int64:
        raise ValueError(f"{who}: slot_mapping must be int64 [{t}], got "
                         f"{tuple(slot_mapping.shape)} {slot_mapping.dtype}")
    tensors = (k, cos, sin, weight, bias, index_cache, slot_mapping)
    devices = {x.device for x in tensors}
    if len(devices) != 1:
        raise ValueError(f"{who}: tensors on several devices: {devices}")
    require_triton_device(k.device, who)


def _check_q(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    who = "indexer_q_rope_triton"
    if q.dim() != 3 or not q.is_floating_point() or q.stride(2) != 1:
        raise ValueError(f"{who}: q must be floating [T, H, D] with a unit last stride, got "
                         f"{tuple(q.shape)} {q.dtype} strides {q.stride()}")
    _check_tables(cos, sin, q.shape[0], q.shape[2], who)
    devices = {q.device, cos.device, sin.device}
    if len(devices) != 1:
        raise ValueError(f"{who}: tensors on several devices: {devices}")
    require_triton_device(q.device, who)


@functools.cache
def _kernels() -> SimpleNamespace:
    """Import triton and jit the kernels, once (interpreted if TRITON_INTERPRET=1 now), with
    rope_cache_triton's rounding helpers bound by global name."""
    global tl, _round, _rotate, _norm_at
    import triton
    import triton.language

    tl = triton.language
    rope_cache_triton._kernels()  # jits and binds its _round / _rotate
    _round, _rotate = rope_cache_triton._round, rope_cache_triton._rotate
    _norm_at = triton.jit(_norm_at)
    # slot ids may be a slice of a packed buffer at any offset: alignment not specialized
    return SimpleNamespace(keys=triton.jit(_keys_kernel,
                                           do_not_specialize_on_alignment=["slots_ptr"]),
                           q_rope=triton.jit(_q_rope_kernel))


# ---- Triton kernels (jitted by _kernels; pointer arguments are untyped, as Triton expects) ----

def _keys_kernel(k_ptr, cos_ptr, sin_ptr, w_ptr, b_ptr, cache_ptr, slots_ptr, stride_k,
                 stride_cos, stride_sin, num_slots, eps, D: tl.constexpr,
                 BLOCK_D: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
                 PAIR_STEP: tl.constexpr, PAIR_OFFSET: tl.constexpr, BF16: tl.constexpr):
    """Token pid: k row [D] -> its LayerNorm's statistics (fp32), then each output value's norm
    computed where it is read: the rotary pairs (x[i * PAIR_STEP], x[i * PAIR_STEP +
    PAIR_OFFSET]) rotated into the cache row's i and HALF + i, the rest copied at its place."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    # an out-of-range slot writes nothing: 0 elements of its row stored
    num_stored = tl.where((slot >= 0) & (slot < num_slots), D, 0)
    dt = k_ptr.dtype.element_ty
    row = k_ptr + t * stride_k
    cache_row = cache_ptr + slot * D
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    x = tl.load(row + d, mask=dm, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=0) / D
    xc = tl.where(dm, x - mean, 0.0)
    rstd = tl.rsqrt(tl.sum(xc * xc, axis=0) / D + eps)
    # the values past the rotary part, normed in place
    pm = dm & (d >= 2 * HALF)
    w = tl.load(w_ptr + d, mask=pm, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + d, mask=pm, other=0.0).to(tl.float32)
    y = _round(xc * rstd * w + b, dt, BF16)
    tl.store(cache_row + d, y.to(dt), mask=pm & (d < num_stored))
    # the rotary pairs, each value normed as read
    i = tl.arange(0, BLOCK_HALF)
    im = i < HALF
    i1, i2 = i * PAIR_STEP, i * PAIR_STEP + PAIR_OFFSET
    y1 = _norm_at(row, w_ptr, b_ptr, i1, im, mean, rstd, dt, BF16)
    y2 = _norm_at(row, w_ptr, b_ptr, i2, im, mean, rstd, dt, BF16)
    c = _round(tl.load(cos_ptr + t * stride_cos + i, mask=im, other=0.0), dt, BF16)
    s = _round(tl.load(sin_ptr + t * stride_sin + i, mask=im, other=0.0), dt, BF16)
    o1, o2 = _rotate(y1, y2, c, s, dt, BF16)
    tl.store(cache_row + i, o1.to(dt), mask=im & (i < num_stored))
    tl.store(cache_row + HALF + i, o2.to(dt), mask=im & (HALF + i < num_stored))


def _norm_at(row, w_ptr, b_ptr, idx, ok, mean, rstd, dt, BF16: tl.constexpr):
    """LayerNorm's output at positions idx of a row (fp32, rounded to dt once)."""
    x = tl.load(row + idx, mask=ok, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + idx, mask=ok, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + idx, mask=ok, other=0.0).to(tl.float32)
    return _round((x - mean) * rstd * w + b, dt, BF16)


def _q_rope_kernel(q_ptr, cos_ptr, sin_ptr, out_ptr, stride_qt, stride_qh, stride_cos,
                   stride_sin, NUM_HEADS: tl.constexpr, BLOCK_H: tl.constexpr,
                   D: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
                   BLOCK_PASS: tl.constexpr, PAIR_STEP: tl.constexpr,
                   PAIR_OFFSET: tl.constexpr, BF16: tl.constexpr):
    """Token pid: every head's rotary pairs rotated into out's i and HALF + i, the rest of each
    head's row copied; out is contiguous [T, H, D]."""
    t = tl.program_id(0).to(tl.int64)
    dt = q_ptr.dtype.element_ty
    h = tl.arange(0, BLOCK_H)
    hm = h < NUM_HEADS
    i = tl.arange(0, BLOCK_HALF)
    m = hm[:, None] & (i < HALF)[None, :]
    q_rows = q_ptr + t * stride_qt + h[:, None] * stride_qh
    out_rows = out_ptr + (t * NUM_HEADS + h[:, None]) * D
    q1 = tl.load(q_rows + i[None, :] * PAIR_STEP, mask=m, other=0.0).to(tl.float32)
    q2 = tl.load(q_rows + i[None, :] * PAIR_STEP + PAIR_OFFSET, mask=m,
                 other=0.0).to(tl.float32)
    c = _round(tl.load(cos_ptr + t * stride_cos + i, mask=i < HALF, other=0.0), dt, BF16)
    s = _round(tl.load(sin_ptr + t * stride_sin + i, mask=i < HALF, other=0.0), dt, BF16)
    o1, o2 = _rotate(q1, q2, c[None, :], s[None, :], dt, BF16)
    tl.store(out_rows + i[None, :], o1.to(dt), mask=m)
    tl.store(out_rows + HALF + i[None, :], o2.to(dt), mask=m)
    p = 2 * HALF + tl.arange(0, BLOCK_PASS)
    pm = hm[:, None] & (p < D)[None, :]
    tl.store(out_rows + p[None, :], tl.load(q_rows + p[None, :], mask=pm, other=0.0), mask=pm)
