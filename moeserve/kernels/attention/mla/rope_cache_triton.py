"""The MLA layer's step between its projections and the attention, in one Triton launch: the
latent's RMSNorm (kv_a_layernorm), RoPE of the query's and the key's rotary parts, and the write
of the token's latent row into the paged latent cache. And its torch reference, the unfused ops
(`rotate_pairs`, MLA's RoPE, lives here too: layers/mla.py and layers/dsa.py use it).

    kv_a [T, L + R]  (in_proj's kv_a rows of token t: c_kv (L) | k_rope (R))
    q [T, H, nope + R]  (q_b_proj's output, or in_proj's q rows without q_lora)
      c_kv --RMSNorm (weight [L], eps)-->               -> latent_cache[slot][:L]
      k_rope --RoPE at positions[t]-->                  -> latent_cache[slot][L:]
      q[t, :, nope:] --RoPE at positions[t]-->          -> q_rope [T, H, R] (new, contiguous;
                                                         or the caller's q_out, e.g. the tail
                                                         of the absorbed query [T, H, L + R])
      cos_table[pos], sin_table[pos] (the rows used)    -> cos, sin [T, R / 2] (new, fp32)

RoPE as `rotate_pairs`: pairs (x[2i], x[2i + 1]) laid out as [rotated evens | rotated odds]
(interleaved) or pairs (x[i], x[i + R / 2]) (half-split); the tables are [P, R / 2], one angle
per pair. The kernel gathers the table rows at each token's position itself and hands them back
as cos / sin (the layer's `Projected` carries them for the DSA indexer's RoPE): no gather
launches.

`_mla_rope_cache_kernel`: grid (T,); one program reads token t's kv_a row once (the latent and
k_rope), its query's rotary parts once (all heads), and its two table rows; it writes the
token's cache row [L + R], q_rope's row [H, R] and cos / sin's rows. Given `q_out`, q_rope is
written there (any token and head strides): layers/mla.py hands it the last R columns of the
absorbed attention's query buffer, so no copy assembles that query (the copy took 0.25 ms of
glm-4.7-flash's 1,024-row decode step on the H200, 1.4 ms of W1's mixed step:
gpu_4705423/call1, `direct_copy_kernel_cuda`). On CUDA it replaces 24
launches per layer and step in bf16, 22 in fp32 (the latent's copy and Triton norm, two table
gathers, per rotation the two casts of cos / sin (bf16), four products, a sum, a difference and
a cat, then the latent's cat and index_copy_).

Agreement with the reference `mla_rope_cache_ref` (the ops layers/mla.py runs off CUDA):
  * RMSNorm, HF's op order: fp32 sum of squares, * (1 / L), + eps, rsqrt, rounded to the dtype,
    then one weight product rounded to the dtype. The sum of squares runs in another order (and
    rsqrt may differ): a few fp32 ulps of the normed latent, which in half precision flips the
    rounding of a small fraction of its values by one ulp of the dtype.
  * RoPE, the table rows and the write: bit exact (cos / sin rounded to the dtype, each product
    and each sum rounded to the dtype, as torch does in the dtype; no fma:
    `enable_fp_fusion=False`). bf16 rounding is done on the fp32 bits (round to nearest even,
    what torch and CUDA's cvt.rn do), since Triton's interpreter truncates on a cast to bf16:
    so bf16 is bit exact on CPU under the interpreter too.
All of kv_a, q, the cache and the norm weight must share one dtype (the model's).

Slots: as `write_latent`, duplicate slots (CUDA-graph padding rows point at the null block's slot
0) leave one of their rows there, unspecified which. A slot outside [0, num_slots), e.g. -1, is
not written (write_latent's index_copy_ would raise; no host sync is allowed here to raise);
q_rope, cos and sin are computed for every token.

NOTE: CUDA-graph capturable: no host syncs, the launch shape depends on T only, positions and
slots are read on the device (positions unchecked: they must be < P, the tables' length). No
step-varying int is a kernel argument (T is the grid; strides and num_slots are the model's)
and positions / slots are exempt from alignment specialization, so one variant serves every
step. Triton is imported on first use; on CPU the kernel runs only under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

import torch

from moeserve.kernels.attention import e4m3_triton
from moeserve.kernels.attention.mla.reference import write_latent
from moeserve.kernels.attention.paged import FP8_CACHE_DTYPES
from moeserve.kernels.norm_rope.rmsnorm_triton import rms_norm_ref
from moeserve.kernels.triton_common import next_pow2, require_step_indices, require_triton_device

tl: Any = None  # triton.language, bound by _kernels(): the kernel reads it as a global
_round_e4m3: Any = None  # e4m3_triton.round_e4m3, jitted, bound by _kernels()


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 interleaved: bool) -> torch.Tensor:
    """RoPE of x [T, ..., R] with cos/sin [T, R / 2] (already at each token's position), in x's
    dtype as transformers. interleaved: pairs (x[2i], x[2i + 1]), output laid out as
    [rotated evens | rotated odds] (transformers' apply_rotary_pos_emb_interleave; the same
    permutation on q and k leaves q . k unchanged); else pairs (x[i], x[i + R / 2])."""
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[1],)
    c, s = cos.to(x.dtype).view(shape), sin.to(x.dtype).view(shape)
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def mla_rope_cache_ref(kv_a: torch.Tensor, q: torch.Tensor, positions: torch.Tensor,
                       cos_table: torch.Tensor, sin_table: torch.Tensor,
                       norm_weight: torch.Tensor, eps: float, latent_cache: torch.Tensor,
                       slot_mapping: torch.Tensor, interleaved: bool,
                       q_out: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The torch reference: the layer's unfused ops (same contract as `mla_rope_cache_triton`,
    except that every slot must be in range: write_latent raises otherwise)."""
    rope_dim = 2 * cos_table.shape[1]
    kv_lora_rank = kv_a.shape[1] - rope_dim
    c_kv = rms_norm_ref(kv_a[:, :kv_lora_rank].contiguous(), norm_weight, eps)  # [T, L]
    cos, sin = cos_table[positions], sin_table[positions]  # [T, R / 2]
    q_rope = rotate_pairs(q[..., q.shape[-1] - rope_dim:], cos, sin, interleaved)  # [T, H, R]
    k_rope = rotate_pairs(kv_a[:, kv_lora_rank:], cos, sin, interleaved)  # [T, R]
    write_latent(torch.cat([c_kv, k_rope], dim=-1), latent_cache, slot_mapping)
    if q_out is not None:
        q_rope = q_out.copy_(q_rope)
    return q_rope, cos, sin


def mla_rope_cache_triton(kv_a: torch.Tensor, q: torch.Tensor, positions: torch.Tensor,
                          cos_table: torch.Tensor, sin_table: torch.Tensor,
                          norm_weight: torch.Tensor, eps: float, latent_cache: torch.Tensor,
                          slot_mapping: torch.Tensor, interleaved: bool,
                          q_out: torch.Tensor | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The latent's norm, q's and k's RoPE and the latent write, one launch.

    Args:
        kv_a: [T, L + R], unit last stride (any row stride: a view of in_proj's output);
            not modified.
        q: [T, H, nope + R], unit last stride (any token and head strides); only its last R
            dims are read; not modified.
        positions: [T] integer, each < P (not checked: no host sync).
        cos_table, sin_table: [P, R / 2] fp32 contiguous, one angle per rotary pair.
        norm_weight: [L] contiguous, kv_a's dtype; eps: the norm's epsilon.
        latent_cache: [num_blocks, block_size, L + R] contiguous, kv_a's dtype or float8 e4m3
            (paged.to_cache_dtype's rule); written in place.
        slot_mapping: [T] int64: token t's row goes to flat slot slot_mapping[t] (out of range:
            not written).
        interleaved: RoPE pairs (x[2i], x[2i + 1]), else (x[i], x[i + R / 2]).
        q_out: where q_rope goes, [T, H, R] of q's dtype and device with a unit last stride
            (any token and head strides; not overlapping q's rotary part), or None: a new
            contiguous tensor.
    Returns:
        q_rope [T, H, R] (kv_a's dtype; q_out when given), cos and sin [T, R / 2] fp32 (the
        tables' rows at positions): new contiguous tensors.
    """
    _check(kv_a, q, positions, cos_table, sin_table, norm_weight, latent_cache, slot_mapping)
    t, heads = q.shape[:2]
    half = cos_table.shape[1]
    rope_dim = 2 * half
    kv_lora_rank = latent_cache.shape[-1] - rope_dim
    if q_out is None:
        q_rope = torch.empty(t, heads, rope_dim, dtype=q.dtype, device=q.device)
    else:
        _check_q_out(q_out, q, rope_dim)
        q_rope = q_out
    cos = torch.empty(t, half, dtype=torch.float32, device=q.device)
    sin = torch.empty_like(cos)
    if t == 0:
        return q_rope, cos, sin
    num_slots = latent_cache.shape[0] * latent_cache.shape[1]
    block_h, block_half, block_l = next_pow2(heads), next_pow2(half), next_pow2(kv_lora_rank)
    _kernels().mla_rope_cache[(t,)](
        kv_a, q, positions, cos_table, sin_table, norm_weight, latent_cache, slot_mapping,
        q_rope, cos, sin, kv_a.stride(0), q.stride(0), q.stride(1), q_rope.stride(0),
        q_rope.stride(1), num_slots,
        1.0 / kv_lora_rank, eps, NUM_HEADS=heads, BLOCK_H=block_h, NOPE=q.shape[-1] - rope_dim,
        HALF=half, BLOCK_HALF=block_half, L=kv_lora_rank, BLOCK_L=block_l,
        PAIR_STEP=2 if interleaved else 1, PAIR_OFFSET=1 if interleaved else half,
        BF16=kv_a.dtype == torch.bfloat16, FP8_CACHE=latent_cache.dtype in FP8_CACHE_DTYPES,
        num_warps=min(8, max(1, max(block_h * block_half, block_l) // 512)),
        enable_fp_fusion=False)
    return q_rope, cos, sin


def _check_q_out(q_out: torch.Tensor, q: torch.Tensor, rope_dim: int) -> None:
    want = (*q.shape[:2], rope_dim)
    if (q_out.shape != want or q_out.dtype != q.dtype or q_out.device != q.device
            or q_out.stride(2) != 1):
        raise ValueError(f"mla_rope_cache_triton: q_out must be {list(want)} {q.dtype} on "
                         f"{q.device} with a unit last stride, got {list(q_out.shape)} "
                         f"{q_out.dtype} on {q_out.device} strides {q_out.stride()}")


def _check(kv_a: torch.Tensor, q: torch.Tensor, positions: torch.Tensor,
           cos_table: torch.Tensor, sin_table: torch.Tensor, norm_weight: torch.Tensor,
           latent_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    def need(ok: bool, what: str) -> None:
        if not ok:
            raise ValueError(f"mla_rope_cache_triton: {what}")

    for name, table in (("cos_table", cos_table), ("sin_table", sin_table)):
        need(table.dim() == 2 and table.shape[1] > 0 and table.dtype == torch.float32
             and table.is_contiguous(),
             f"{name} must be contiguous fp32 [P, R / 2], got {tuple(table.shape)} "
             f"{table.dtype}")
    need(cos_table.shape == sin_table.shape,
         f"cos_table {tuple(cos_table.shape)} and sin_table {tuple(sin_table.shape)} differ")
    rope_dim = 2 * cos_table.shape[1]
    need(latent_cache.dim() == 3 and latent_cache.is_contiguous()
         and latent_cache.shape[-1] > rope_dim,
         f"latent_cache must be contiguous [num_blocks, block_size, L + R] with L > 0 "
         f"(R = {rope_dim}), got {tuple(latent_cache.shape)}")
    width, kv_lora_rank = latent_cache.shape[-1], latent_cache.shape[-1] - rope_dim
    t = kv_a.shape[0]
    need(kv_a.dim() == 2 and kv_a.shape[1] == width and kv_a.stride(1) == 1,
         f"kv_a must be [T, L + R] = [T, {width}] with a unit last stride, got "
         f"{tuple(kv_a.shape)} strides {kv_a.stride()}")
    need(q.dim() == 3 and q.shape[0] == t and q.shape[1] > 0 and q.shape[2] >= rope_dim
         and q.stride(2) == 1,
         f"q must be [{t}, H, nope + R] (R = {rope_dim}) with a unit last stride, got "
         f"{tuple(q.shape)} strides {q.stride()}")
    need(kv_a.is_floating_point() and q.dtype == kv_a.dtype
         and latent_cache.dtype in (kv_a.dtype, *FP8_CACHE_DTYPES),
         f"kv_a {kv_a.dtype} and q {q.dtype} must share one floating dtype, and latent_cache "
         f"{latent_cache.dtype} be it or one of {FP8_CACHE_DTYPES}")
    need(norm_weight.shape == (kv_lora_rank,) and norm_weight.is_contiguous()
         and norm_weight.dtype == kv_a.dtype,
         f"norm_weight must be contiguous [{kv_lora_rank}] {kv_a.dtype}, got "
         f"{tuple(norm_weight.shape)} {norm_weight.dtype}")
    require_step_indices(positions, slot_mapping, t, "mla_rope_cache_triton")
    tensors = (kv_a, q, positions, cos_table, sin_table, norm_weight, latent_cache, slot_mapping)
    devices = {x.device for x in tensors}
    need(len(devices) == 1, f"tensors on several devices: {devices}")
    require_triton_device(kv_a.device, "mla_rope_cache_triton")


@functools.cache
def _kernels() -> SimpleNamespace:
    """Import triton and jit the kernel and its helpers, once (interpreted if TRITON_INTERPRET=1
    now). The kernel calls its helpers by global name, so they are rebound here."""
    global tl, _round, _rotate, _round_e4m3
    import triton
    import triton.language

    tl = triton.language
    _round, _rotate = triton.jit(_round), triton.jit(_rotate)
    _round_e4m3 = e4m3_triton.jitted()
    # NOTE: no step-varying int is an argument (T is the grid); positions and slots may be
    # slices of a packed buffer at any offset, so their alignment is not specialized either
    return SimpleNamespace(mla_rope_cache=triton.jit(
        _mla_rope_cache_kernel, do_not_specialize_on_alignment=["positions_ptr", "slots_ptr"]))


# ---- Triton kernel (jitted by _kernels; pointer arguments are untyped, as Triton expects) ----

def _round(x, dt, BF16: tl.constexpr):
    """fp32 x rounded to dt (to nearest, ties to even), as fp32. bf16 on the bits: Triton's
    interpreter truncates on a cast to bf16 (CUDA rounds, to the same bits as this)."""
    if BF16:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & -65536  # keep the upper 16 bits
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(dt).to(tl.float32)


def _rotate(x1, x2, c, s, dt, BF16: tl.constexpr):
    """rotate_pairs' (x1 c - x2 s, x2 c + x1 s), each product and sum rounded to dt."""
    o1 = _round(_round(x1 * c, dt, BF16) - _round(x2 * s, dt, BF16), dt, BF16)
    o2 = _round(_round(x2 * c, dt, BF16) + _round(x1 * s, dt, BF16), dt, BF16)
    return o1, o2


def _mla_rope_cache_kernel(kv_ptr, q_ptr, positions_ptr, cos_ptr, sin_ptr, w_ptr, cache_ptr,
                           slots_ptr, q_out_ptr, cos_out_ptr, sin_out_ptr, stride_kv,
                           stride_qt, stride_qh, stride_ot, stride_oh, num_slots, inv_l, eps,
                           NUM_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, NOPE: tl.constexpr,
                           HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, L: tl.constexpr,
                           BLOCK_L: tl.constexpr, PAIR_STEP: tl.constexpr,
                           PAIR_OFFSET: tl.constexpr, BF16: tl.constexpr,
                           FP8_CACHE: tl.constexpr):
    """Token pid: kv row [L + 2 HALF] -> cache slot [normed latent | rotated k_rope];
    q[t, :, NOPE:] [H, 2 HALF] -> q_out row; the tables' rows [HALF] -> cos_out, sin_out rows.
    A pair i is (x[i * PAIR_STEP], x[i * PAIR_STEP + PAIR_OFFSET]): (2i, 2i + 1) interleaved,
    (i, i + HALF) half-split; its outputs land at i and HALF + i. FP8_CACHE: the cache is
    float8 e4m3; each value is rounded in the model's dtype first, as the unfused path."""
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + t).to(tl.int64)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    row_len = L + 2 * HALF
    # an out-of-range slot writes nothing: 0 elements of its row stored
    num_stored = tl.where((slot >= 0) & (slot < num_slots), row_len, 0)
    dt = kv_ptr.dtype.element_ty  # the model's dtype
    ct = cache_ptr.dtype.element_ty  # the cache's: dt, or float8 e4m3
    i = tl.arange(0, BLOCK_HALF)  # [BHALF]
    im = i < HALF
    c = tl.load(cos_ptr + pos * HALF + i, mask=im, other=0.0)  # [BHALF] fp32
    s = tl.load(sin_ptr + pos * HALF + i, mask=im, other=0.0)
    tl.store(cos_out_ptr + t * HALF + i, c, mask=im)
    tl.store(sin_out_ptr + t * HALF + i, s, mask=im)
    c = _round(c, dt, BF16)  # rotate_pairs' cos.to(x.dtype)
    s = _round(s, dt, BF16)
    # the latent: rms_norm_ref's ops (fp32 y rounded to dt, one weight product rounded to dt)
    kv_row = kv_ptr + t * stride_kv
    cache_row = cache_ptr + slot * row_len
    j = tl.arange(0, BLOCK_L)  # [BL]
    jm = j < L
    x = tl.load(kv_row + j, mask=jm, other=0.0).to(tl.float32)  # [BL]
    r = tl.rsqrt(tl.sum(x * x, axis=0) * inv_l + eps)
    w = tl.load(w_ptr + j, mask=jm, other=0.0).to(tl.float32)
    y = _round(w * _round(x * r, dt, BF16), dt, BF16)
    # NOTE: bounds on index tensors, not `mask & scalar_bool` (the interpreter makes it int32)
    if FP8_CACHE:
        y = _round_e4m3(y)
    tl.store(cache_row + j, y.to(ct), mask=jm & (j < num_stored))
    # k_rope -> the cache row's last 2 HALF
    k1 = tl.load(kv_row + L + i * PAIR_STEP, mask=im, other=0.0).to(tl.float32)
    k2 = tl.load(kv_row + L + i * PAIR_STEP + PAIR_OFFSET, mask=im, other=0.0).to(tl.float32)
    o1, o2 = _rotate(k1, k2, c, s, dt, BF16)
    if FP8_CACHE:
        o1, o2 = _round_e4m3(o1), _round_e4m3(o2)
    tl.store(cache_row + L + i, o1.to(ct), mask=im & (L + i < num_stored))
    tl.store(cache_row + L + HALF + i, o2.to(ct), mask=im & (L + HALF + i < num_stored))
    # q's rotary parts, every head -> q_out [H, 2 HALF]
    h = tl.arange(0, BLOCK_H)  # [BH]
    qm = (h < NUM_HEADS)[:, None] & im[None, :]  # [BH, BHALF]
    q_pairs = q_ptr + t * stride_qt + h[:, None] * stride_qh + NOPE + i[None, :] * PAIR_STEP
    q1 = tl.load(q_pairs, mask=qm, other=0.0).to(tl.float32)  # [BH, BHALF]
    q2 = tl.load(q_pairs + PAIR_OFFSET, mask=qm, other=0.0).to(tl.float32)
    o1, o2 = _rotate(q1, q2, c[None, :], s[None, :], dt, BF16)
    out = q_out_ptr + t * stride_ot + h[:, None] * stride_oh + i[None, :]
    tl.store(out, o1.to(dt), mask=qm)
    tl.store(out + HALF, o2.to(dt), mask=qm)
