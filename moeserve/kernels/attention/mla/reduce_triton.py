"""How many context partitions an MLA decode takes (`decode_num_splits`), and the split-K
combine of the absorbed MLA decode (mla/absorbed_triton.py) and of DSA's sparse MLA
(dsa/sparse_triton.py): each (row, head)'s partitions, as (running max, sum of exp2,
accumulator: fp32, or bf16 for a bf16 output with `half_partials`) partials, weighted into one
output row. Jitted on first use, as the kernels it follows."""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

import torch

from moeserve.kernels.attention.paged_triton import MAX_SPLITS, MIN_PARTITION_TOKENS
from moeserve.kernels.triton_common import num_sms, pdl_kwargs

tl: Any = None  # triton.language, bound by _kernels(): the kernel below reads it as a global


# A decode program (a head tile of one row) holds its heads' fp32 accumulators and 180-220 KB
# of shared memory: one program an SM. Context partitions beyond about two waves of them cost
# more than they fill (H200, 64 heads, benchmarks/results/gpu_039305d/call2_mla_profile/: DSA's
# sparse MLA over 256 rows x 2,048 keys 0.48 ms in 1 partition, 0.89 / 0.81 in 2 / 4; the dense
# decode over 256 rows x 2,048 keys 0.395 in 1, 0.696 in 4; 32 rows x 2,048 sparse keys best
# at 8 partitions, 256 programs). paged_triton's rule (1,024 programs) is for GQA's light ones.
DECODE_WAVES = 2
NOMINAL_SMS = 132  # off CUDA (the interpreter): an H200's, so a step splits as it would there
# Splits the combine reads at once: a program (row, head) loads SPLIT_BLOCK partitions' maxima,
# sums and accumulator rows as one masked block (one memory latency for up to 8 splits, a loop
# of blocks past them: one compiled variant for every split count); 0: a partition at a time,
# as before. The combine took 8.7 us of DSA's 0.106 ms decode step at 32 x 8k (4 splits, 2,048
# programs; Nsight Compute: 80% of its warps' samples waiting on those loads, in turn,
# gpu_de8d30e/call6). An A/B switch (kernels_dsa's reduce_block form) until timed
split_block = 0
# A bf16 output's split accumulators (part_acc) held in bf16, not fp32: half the bytes the
# split decode writes and the combine reads (at 32 x 8k DSA's sparse MLA writes 16.8 MB of
# fp32 partials beside its 78 MB of latents); a partial rounds to bf16 once, as the output
# does. An A/B switch (kernels_dsa's half_partials form) until timed
half_partials = False


def decode_num_splits(num_rows: int, num_head_tiles: int, context: int,
                      device: torch.device, waves: int = DECODE_WAVES) -> int:
    """Context partitions per decode row (a host int, the same inside a CUDA graph): up to
    `waves` programs an SM (DECODE_WAVES for the Triton kernels) over rows x head tiles x
    partitions, none shorter than MIN_PARTITION_TOKENS keys, at most MAX_SPLITS."""
    sms = num_sms(device) if device.type == "cuda" else NOMINAL_SMS
    by_length = -(-max(1, context) // MIN_PARTITION_TOKENS)
    by_programs = waves * sms // max(1, num_rows * num_head_tiles)
    return max(1, min(by_length, by_programs, MAX_SPLITS))


def split_partials(out: torch.Tensor, num_rows: int, num_splits: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The split decode's partials for out [T, H, L]: part_m, part_l [n, H, S] fp32 (running
    max of the base-2 logits, sum of exp2) and part_acc [n, H, S, L] fp32 (bf16 for a bf16 out
    with `half_partials`), which `reduce_splits` combines; with one split, out three times
    (the kernels then write out directly, and store part_acc in its own dtype)."""
    if num_splits == 1:
        return out, out, out
    num_heads, kv_lora_rank = out.shape[1:]
    part_m = torch.empty(num_rows, num_heads, num_splits, dtype=torch.float32,
                         device=out.device)
    acc_dtype = (torch.bfloat16 if half_partials and out.dtype == torch.bfloat16
                 else torch.float32)
    part_acc = torch.empty(num_rows, num_heads, num_splits, kv_lora_rank, dtype=acc_dtype,
                           device=out.device)
    return part_m, torch.empty_like(part_m), part_acc


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
        NUM_HEADS=num_heads, L=kv_lora_rank, USE_ROWS=rows is not None,
        TOKEN_ROWS=query_start_loc is None, SPLIT_BLOCK=split_block, num_warps=4,
        **pdl_kwargs(out.device))


@functools.cache
def _kernels() -> SimpleNamespace:
    """Import triton and jit the kernel, once (interpreted if TRITON_INTERPRET=1 now)."""
    global tl
    import triton
    import triton.language

    tl = triton.language
    # the split count varies by step; the row ids may be sliced at any offset
    return SimpleNamespace(decode_reduce=triton.jit(
        _decode_reduce_kernel, do_not_specialize=["num_splits"],
        do_not_specialize_on_alignment=["rows_ptr"]))


# ---- Triton kernel (jitted by _kernels; pointer arguments are untyped, as Triton expects) ----

def _decode_reduce_kernel(part_m_ptr, part_l_ptr, part_acc_ptr, out_ptr, query_start_loc_ptr,
                          rows_ptr, num_splits, stride_ot, stride_oh,
                          NUM_HEADS: tl.constexpr, L: tl.constexpr, USE_ROWS: tl.constexpr,
                          TOKEN_ROWS: tl.constexpr, SPLIT_BLOCK: tl.constexpr,
                          PDL: tl.constexpr):
    """Program (i, head): combine the split partials of row i, query head `head`, into its
    output token (TOKEN_ROWS: token i), a split at a time, or (SPLIT_BLOCK) SPLIT_BLOCK at a
    time, masked past num_splits: either loop runs whatever the count (one compiled variant;
    the earlier block of all 64 possible splits, masked, cost 16x the lanes at 4 splits).
    PDL (a level, triton_common.pdl): launched early, it first waits for the previous kernel
    (2: then lets its successor launch; 3: both once it has read its row's metadata)."""
    if PDL == 1 or PDL == 2:  # at the top; 3: once the step's metadata below is read
        tl.extra.cuda.gdc_wait()
    if PDL == 2:
        tl.extra.cuda.gdc_launch_dependents()
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
    if PDL == 3:  # the metadata read: now the previous kernel's outputs (triton_common.pdl)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    base = (i * NUM_HEADS + head).to(tl.int64) * num_splits
    m_max = tl.full([], float("-inf"), tl.float32)
    d = tl.arange(0, L)
    total = tl.full([], 0.0, tl.float32)
    o = tl.full([L], 0.0, tl.float32)
    if SPLIT_BLOCK == 0:
        for s in range(num_splits):
            m_max = tl.maximum(m_max, tl.load(part_m_ptr + base + s))
        m_ref = tl.where(m_max == float("-inf"), 0.0, m_max)
        for s in range(num_splits):
            w = tl.exp2(tl.load(part_m_ptr + base + s) - m_ref)  # empty partitions weigh 0
            total += w * tl.load(part_l_ptr + base + s)
            o += w * tl.load(part_acc_ptr + (base + s) * L + d).to(tl.float32)
    else:
        for s0 in range(0, num_splits, SPLIT_BLOCK):
            s = s0 + tl.arange(0, SPLIT_BLOCK)
            m = tl.load(part_m_ptr + base + s, mask=s < num_splits, other=float("-inf"))
            m_max = tl.maximum(m_max, tl.max(m, 0))
        m_ref = tl.where(m_max == float("-inf"), 0.0, m_max)
        for s0 in range(0, num_splits, SPLIT_BLOCK):
            s = s0 + tl.arange(0, SPLIT_BLOCK)
            ok = s < num_splits
            # empty partitions (-inf) and splits past num_splits weigh 0
            w = tl.exp2(tl.load(part_m_ptr + base + s, mask=ok, other=float("-inf")) - m_ref)
            total += tl.sum(w * tl.load(part_l_ptr + base + s, mask=ok, other=0.0), 0)
            acc = tl.load(part_acc_ptr + (base + s)[:, None] * L + d[None, :], mask=ok[:, None],
                          other=0.0).to(tl.float32)
            o += tl.sum(w[:, None] * acc, 0)
    o = o / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + tok * stride_ot + head * stride_oh + d, o.to(out_ptr.dtype.element_ty))
