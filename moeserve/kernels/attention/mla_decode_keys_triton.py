"""Absorbed MLA decode in the keys-major form: the cached keys are the rows of both dots, so a
program with few query heads still runs Hopper's warp-group MMA.

mla_triton's decode kernel computes S = Q K^T with the heads of a program as the MMA's M
dimension. Hopper's wgmma takes M in multiples of 64, so a tile of 16 or 32 heads (GLM-4.7-Flash's
20, a 64-head row split in tiles) compiles to Ampere's mma.sync at a fraction of the tensor-core
rate (sm90 SASS: HMMA, no HGMMA; about 128 TFLOP/s measured at 64 and 128 heads). Here each step
computes the transposes instead:

    S^T [BLOCK_N, H] = K [BLOCK_N, L] . Q_lat^T [L, H] + K_pe [BLOCK_N, R] . Q_pe^T [R, H]
    O^T [L, H]      += K^T [L, BLOCK_N] . P^T [BLOCK_N, H]     (the values are the latents)

whose M dimensions are BLOCK_N keys and L = 512 latent columns, and whose N is the heads (wgmma
takes N from 8 up). Softmax runs down the key axis (axis 0). Same contract, grid, split
partials and reduce as mla_triton's decode (`_launch_decode` picks the form): program
(head_tile, i, split) over one context partition of decode row i, the last partition running to
the row's seq_len; partials (max, sum, acc) in mla_triton's [n, H, S(, L)] layout.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

tl: Any = None  # triton.language, bound by _kernels(): the kernels below read it as a global
_tile_rows: Any = None  # mla_triton's, bound by _kernels() too


@functools.cache
def _kernels() -> SimpleNamespace:
    """Import triton and jit the kernel, once (interpreted if TRITON_INTERPRET=1 now); the
    helpers and `tl` are read by global name, so they are bound here."""
    global tl, _max0, _sum0, _attend_keys, _tile_rows
    import triton
    import triton.language

    from moeserve.kernels.attention import mla_triton

    tl = triton.language
    _max0, _sum0, _attend_keys = (triton.jit(f) for f in (_max0, _sum0, _attend_keys))
    mla_triton._kernels()  # jits the helper this kernel shares with it
    _tile_rows = mla_triton._tile_rows
    # step-varying ints are exempt from specialisation (see paged_triton._kernels)
    return SimpleNamespace(decode=triton.jit(
        _decode_keys_kernel, do_not_specialize=["partition", "num_splits", "stride_table"],
        do_not_specialize_on_alignment=["rows_ptr"]))


# ---- Triton kernels (jitted by _kernels; pointer arguments are untyped, as Triton expects) ----

def _max0(x):
    """Max over axis 0 of fp32 x (see paged_triton._max)."""
    return tl.reduce(x, 0, tl.standard._elementwise_max)


def _sum0(x):
    """Sum over axis 0 of fp32 x."""
    return tl.reduce(x, 0, tl.standard._sum_combine)


def _attend_keys(q_lat_t, q_pe_t, acc_t, m_i, l_i, cache_ptr, row, valid, scale_log2,
                 L: tl.constexpr, R: tl.constexpr, IEEE: tl.constexpr):
    """One online-softmax step of the heads (q_lat_t [L, H], q_pe_t [R, H]; acc_t [L, H]) over
    the cached latent rows at element offsets `row` [N]; rows not `valid` [N] are neither read
    nor scored."""
    dl = tl.arange(0, L)
    dr = tl.arange(0, R)
    kv = tl.load(cache_ptr + row[:, None] + dl[None, :], mask=valid[:, None], other=0.0)  # [N, L]
    k_pe = tl.load(cache_ptr + row[:, None] + L + dr[None, :], mask=valid[:, None],
                   other=0.0)  # [N, R]
    if IEEE:  # fp32: exact products (the reference's precision)
        s_t = (tl.dot(kv, q_lat_t, input_precision="ieee")
               + tl.dot(k_pe, q_pe_t, input_precision="ieee"))
    else:
        s_t = tl.dot(kv, q_lat_t) + tl.dot(k_pe, q_pe_t)
    s_t = tl.where(valid[:, None], s_t * scale_log2, float("-inf"))  # [N, H] base-2 logits
    m_new = tl.maximum(m_i, _max0(s_t))  # [H]
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key seen yet: alpha 0, p 0
    alpha = tl.exp2(m_i - m_ref)
    p_t = tl.exp2(s_t - m_ref[None, :])  # [N, H]
    l_i = l_i * alpha + _sum0(p_t)
    if IEEE:
        acc_t = acc_t * alpha[None, :] + tl.dot(tl.trans(kv), p_t, input_precision="ieee")
    else:
        acc_t = acc_t * alpha[None, :] + tl.dot(tl.trans(kv), p_t.to(kv.dtype))
    return acc_t, m_new, l_i


def _decode_keys_kernel(q_ptr, cache_ptr, out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr,
                        block_tables_ptr, seq_lens_ptr, query_start_loc_ptr, rows_ptr,
                        scale_log2, partition, num_splits,
                        stride_qt, stride_qh, stride_ot, stride_oh, stride_table,
                        NUM_HEADS: tl.constexpr, HEADS_PER_TILE: tl.constexpr,
                        BLOCK_H: tl.constexpr, L: tl.constexpr, R: tl.constexpr,
                        BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                        USE_ROWS: tl.constexpr, SPLIT: tl.constexpr, IEEE: tl.constexpr):
    """Program (head_tile, i, split): the HEADS_PER_TILE query heads of head_tile for decode
    row i, over context partition `split` (the last one runs to seq_len)."""
    head_tile = tl.program_id(0)
    i = tl.program_id(1)
    split = tl.program_id(2)
    if USE_ROWS:
        req = tl.load(rows_ptr + i)
    else:
        req = i
    tok = tl.load(query_start_loc_ptr + req)
    seq_len = tl.load(seq_lens_ptr + req)
    start = split * partition
    end = tl.where(split == num_splits - 1, seq_len, tl.minimum(seq_len, start + partition))
    h = tl.arange(0, BLOCK_H)  # [H'] head within the tile (padded)
    head = head_tile * HEADS_PER_TILE + h
    h_ok = (h < HEADS_PER_TILE) & (head < NUM_HEADS)
    dl = tl.arange(0, L)
    dr = tl.arange(0, R)
    q_col = q_ptr + tok * stride_qt + head[None, :] * stride_qh  # [1, H']
    q_lat_t = tl.load(q_col + dl[:, None], mask=h_ok[None, :], other=0.0)  # [L, H']
    q_pe_t = tl.load(q_col + L + dr[:, None], mask=h_ok[None, :], other=0.0)  # [R, H']
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_H], 0.0, tl.float32)
    acc_t = tl.full([L, BLOCK_H], 0.0, tl.float32)
    table = block_tables_ptr + req.to(tl.int64) * stride_table
    row, valid = _tile_rows(table, start, end, L, R, BLOCK_SIZE, BLOCK_N)  # looked up a tile
    for n0 in range(start, end, BLOCK_N):  # ahead, as in mla_triton's decode
        row_next, valid_next = _tile_rows(table, n0 + BLOCK_N, end, L, R, BLOCK_SIZE, BLOCK_N)
        acc_t, m_i, l_i = _attend_keys(q_lat_t, q_pe_t, acc_t, m_i, l_i, cache_ptr, row, valid,
                                       scale_log2, L, R, IEEE)
        row, valid = row_next, valid_next
    if SPLIT:
        part = (i * NUM_HEADS + head) * num_splits + split  # [H']
        tl.store(part_m_ptr + part, m_i, mask=h_ok)
        tl.store(part_l_ptr + part, l_i, mask=h_ok)
        tl.store(part_acc_ptr + part[None, :].to(tl.int64) * L + dl[:, None], acc_t,
                 mask=h_ok[None, :])
    else:
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # an empty row (seq_len 0 padding) writes 0
        o_t = acc_t / l_safe[None, :]
        tl.store(out_ptr + tok * stride_ot + head[None, :] * stride_oh + dl[:, None],
                 o_t.to(out_ptr.dtype.element_ty), mask=h_ok[None, :])
