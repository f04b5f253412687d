"""The split-K combine of the absorbed MLA decode (mla/absorbed_triton.py) and of DSA's sparse MLA
(dsa/sparse_triton.py): each (row, head)'s partitions, as (running max, sum of exp2, fp32
accumulator) partials, weighted into one output row. Jitted on first use, as the kernels it
follows."""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

import torch

from moeserve.kernels.attention.paged_triton import MAX_SPLITS
from moeserve.kernels.triton_common import next_pow2

REDUCE_BLOCK_L = 128  # latent columns the split reduce combines per step (bounds its registers)

tl: Any = None  # triton.language, bound by _kernels(): the kernel below reads it as a global
_max: Any = None  # mla_triton's jitted reductions, bound by _kernels() too
_sum: Any = None


def reduce_splits(part_m: torch.Tensor, part_l: torch.Tensor, part_acc: torch.Tensor,
                  out: torch.Tensor, query_start_loc: torch.Tensor | None,
                  rows: torch.Tensor | None, num_rows: int, num_splits: int) -> None:
    """Combine split partials (part_m, part_l [n, H, S] fp32 base-2 max and sum, part_acc
    [n, H, S, L]) into out [T, H, L]: partial row i is output token query_start_loc[rows[i]]
    (rows None: query_start_loc[i]; query_start_loc None: token i, as DSA's sparse MLA)."""
    num_heads, kv_lora_rank = out.shape[1:]
    _kernels().decode_reduce[(num_rows, num_heads)](
        part_m, part_l, part_acc, out,
        out if query_start_loc is None else query_start_loc,  # unused when TOKEN_ROWS
        rows if rows is not None else query_start_loc if query_start_loc is not None
        else part_m,  # unused when USE_ROWS is off
        num_splits, out.stride(0), out.stride(1),
        # one BLOCK_S for every split count: one compiled variant, not one per power of two
        NUM_HEADS=num_heads, L=kv_lora_rank, BLOCK_L=min(kv_lora_rank, REDUCE_BLOCK_L),
        BLOCK_S=next_pow2(max(2, MAX_SPLITS)), USE_ROWS=rows is not None,
        TOKEN_ROWS=query_start_loc is None, num_warps=4)


@functools.cache
def _kernels() -> SimpleNamespace:
    """Import triton and jit the kernel, once (interpreted if TRITON_INTERPRET=1 now)."""
    global tl, _max, _sum
    import triton
    import triton.language

    from moeserve.kernels.attention.mla import absorbed_triton as mla_triton

    mla_triton._kernels()
    tl = triton.language
    _max, _sum = mla_triton._max, mla_triton._sum
    # the split count varies by step; the row ids may be sliced at any offset
    return SimpleNamespace(decode_reduce=triton.jit(
        _decode_reduce_kernel, do_not_specialize=["num_splits"],
        do_not_specialize_on_alignment=["rows_ptr"]))


# ---- Triton kernel (jitted by _kernels; pointer arguments are untyped, as Triton expects) ----

def _decode_reduce_kernel(part_m_ptr, part_l_ptr, part_acc_ptr, out_ptr, query_start_loc_ptr,
                          rows_ptr, num_splits, stride_ot, stride_oh,
                          NUM_HEADS: tl.constexpr, L: tl.constexpr, BLOCK_L: tl.constexpr,
                          BLOCK_S: tl.constexpr, USE_ROWS: tl.constexpr,
                          TOKEN_ROWS: tl.constexpr):
    """Program (i, head): combine the split partials of row i, query head `head`, BLOCK_L
    latent columns at a time, into its output token (TOKEN_ROWS: token i)."""
    i = tl.program_id(0)
    head = tl.program_id(1)
    if USE_ROWS:
        req = tl.load(rows_ptr + i)
    else:
        req = i
    if TOKEN_ROWS:
        tok = i
    else:
        tok = tl.load(query_start_loc_ptr + req)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_L)
    s_ok = s < num_splits
    base = (i * NUM_HEADS + head) * num_splits
    m = tl.load(part_m_ptr + base + s, mask=s_ok, other=float("-inf"))  # [S]
    l_s = tl.load(part_l_ptr + base + s, mask=s_ok, other=0.0)  # [S]
    m_max = _max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_max)  # [S]; empty partitions (max -inf) weigh 0
    total = _sum(w * l_s, 0)
    w = w / tl.where(total == 0.0, 1.0, total)
    acc_rows = part_acc_ptr + (base + s)[:, None].to(tl.int64) * L  # [S, 1]
    out_row = out_ptr + tok * stride_ot + head * stride_oh
    for d0 in range(0, L, BLOCK_L):
        acc = tl.load(acc_rows + d0 + d[None, :], mask=s_ok[:, None], other=0.0)  # [S, BL]
        o = _sum(acc * w[:, None], 0)  # [BL]
        tl.store(out_row + d0 + d, o.to(out_ptr.dtype.element_ty))
