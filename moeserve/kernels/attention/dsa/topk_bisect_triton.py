"""DSA's top-k for rows of up to MAX_KEYS positions in one launch of a program a token, the
whole row in registers: `radix_topk_bisect`, topk_triton.radix_topk's contract (its "bisect"
form).

Why: at 32 tokens of 8k positions the other forms take 0.036-0.041 ms of the DSA decode step's
0.12 (H100, benchmarks/results/gpu_6b1031a), about a third of it: the chunks form's six launches
of ~7 us each, the row form's histograms (Triton's costs a thread ~BINS / 32 instructions an
element, ~8 clocks a position). Here a program holds its token's scores as unsigned keys u (the
ord's sign bit flipped) and builds the threshold T bit by bit from the top:

    T = 0; for bit 31 .. 0: if count(u >= T | 2^bit) >= topk: T |= 2^bit

a compare and an add an element and one block reduction a bit, stopping early once a count is
exactly topk (then {u >= T} is the selection: no ties to break; random scores get there after
about 20 bits). T is then the topk-th largest key (or such a cut), and one scan writes the
positions above it and T's first (lowest) positions up to topk, in position order. No
workspace, no atomics. Estimated (not yet timed): 8k positions ~32 x (2 instructions x 16
elements + a reduction) a thread, ~5-7 us a token an SM.

Rows past MAX_KEYS (a step's or a decode graph's max_seq_len) are refused: the row must fit
the registers (BLOCK positions over WARPS warps; two compiled variants, 4,096 and 16,384).
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

import torch

from moeserve.kernels.attention.dsa import topk_triton
from moeserve.kernels.attention.metadata import AttentionMetadata

MAX_KEYS = 16384
# (BLOCK, warps): the row's registers, 16 and 32 keys a thread
SHAPES = ((4096, 8), (16384, 16))

tl: Any = None  # triton.language, bound by _kernels() (the kernel reads it as a global)
_context_end: Any = None  # topk_triton's jitted helpers, bound by _kernels()
_above_and_rank: Any = None


def block_shape(num_keys: int) -> tuple[int, int]:
    """(BLOCK, warps) of the variant holding rows of num_keys positions; ValueError past
    MAX_KEYS."""
    for block, warps in SHAPES:
        if num_keys <= block:
            return block, warps
    raise ValueError(f"radix_topk bisect: rows of {num_keys} positions, at most {MAX_KEYS} "
                     "(a row is held in registers)")


def radix_topk_bisect(scores: torch.Tensor, meta: AttentionMetadata, t0: int, topk: int,
                      out: torch.Tensor, count_boundary_ties: bool = False) -> int:
    """topk_triton.radix_topk's contract, a program a token (the module docstring). Returns
    the boundary ties' count (a host sync) with count_boundary_ties, else 0."""
    n, num_keys = scores.shape
    block, warps = block_shape(num_keys)
    ties = torch.empty(n if count_boundary_ties else 1, dtype=torch.int32,
                       device=scores.device)
    _kernels().bisect[(n,)](scores, out, meta.positions, meta.seq_lens, meta.token_to_req, t0,
                            ties, num_keys, topk, out.stride(0),
                            COUNT_TIES=count_boundary_ties, BLOCK=block, num_warps=warps)
    return int(ties.sum()) if count_boundary_ties else 0


@functools.cache
def _kernels() -> SimpleNamespace:
    """Import triton and jit the kernel, once (interpreted if TRITON_INTERPRET=1 now); the
    helpers it calls bound as globals. Step-varying ints are not specialised."""
    global tl, _context_end, _above_and_rank
    import triton
    import triton.language

    tl = triton.language
    topk_triton._kernels()  # binds topk_triton's jitted helpers
    _context_end, _above_and_rank = topk_triton._context_end, topk_triton._above_and_rank
    varying = ["t0", "num_keys", "topk", "stride_out"]
    return SimpleNamespace(bisect=triton.jit(_bisect_kernel, do_not_specialize=varying))


def _bisect_kernel(scores_ptr, out_ptr, positions_ptr, seq_lens_ptr, token_to_req_ptr, t0,
                   ties_ptr, num_keys, topk, stride_out, COUNT_TIES: tl.constexpr,
                   BLOCK: tl.constexpr):
    """Program i: token t0 + i's select, its row of ord scores in registers (the module
    docstring). COUNT_TIES: ties_ptr[i] = 1 where T's scores outnumber those taken."""
    i = tl.program_id(0)
    end = _context_end(positions_ptr, seq_lens_ptr, token_to_req_ptr, t0 + i, num_keys)
    out = out_ptr + i.to(tl.int64) * stride_out
    if end <= topk:  # the whole context, -1 after it
        for j in range(0, topk, BLOCK):
            place = j + tl.arange(0, BLOCK)
            tl.store(out + place, tl.where(place < end, place, -1), mask=place < topk)
        if COUNT_TIES:
            tl.store(ties_ptr + i, 0)
    else:
        n = tl.arange(0, BLOCK)
        ok = n < end
        s = tl.load(scores_ptr + i.to(tl.int64) * num_keys + n, mask=ok, other=0)
        u = (s ^ -2147483648).to(tl.uint32, bitcast=True)  # ord's order, unsigned
        thr = (end * 0).to(tl.uint32)
        bit = end * 0 + 31
        exact = end * 0
        while (bit >= 0) & (exact == 0):
            cand = thr | ((end * 0 + 1).to(tl.uint32) << bit.to(tl.uint32))
            count = tl.sum((ok & (u >= cand)).to(tl.int32), 0)
            thr = tl.where(count >= topk, cand, thr)
            exact = (count == topk).to(tl.int32)
            bit -= 1
        above = ok & (u > thr)
        equal = ok & (u == thr)
        need = topk - tl.sum(above.to(tl.int32), 0)  # T's scores taken, the lowest first
        above_to, rank = _above_and_rank(above, equal, need * 0)
        take = above | (equal & (rank <= need))
        tl.store(out + above_to + tl.minimum(rank, need) - 1, n, mask=take)
        if COUNT_TIES:
            tl.store(ties_ptr + i, (tl.sum(equal.to(tl.int32), 0) > need).to(tl.int32))
