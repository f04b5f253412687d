"""DSA's top-k for rows of up to MAX_KEYS positions in one launch of a program a token, the
whole row in registers: `radix_topk_bisect`, topk_triton.radix_topk's contract (its "bisect"
form).

Why: at 32 tokens of 8k positions the other forms take 0.032-0.041 ms of the DSA decode step's
0.12 (H100, benchmarks/results/gpu_6b1031a), about a third of it: the chunks form's six launches
of ~7 us each, the row form's histograms (Triton's costs a thread ~BINS / 32 instructions an
element, ~8 clocks a position). Here a program holds its token's scores as unsigned keys u (the
ord's sign bit flipped) in registers and builds the threshold T bit by bit from the top:

    T = 0; for bit 31 .. 0: if count(u >= T | 2^bit) >= topk: T |= 2^bit

a compare and an add an element and one block reduction a bit, stopping early once a count is
exactly topk (then {u >= T} is the selection: no ties to break). T is then the topk-th largest
key (or such a cut), and a scan a chunk writes the positions above it and T's first (lowest)
positions up to topk, in position order. No workspace, no atomics.

The row sits in up to four register chunks of CHUNK positions (16 warps: 8 keys a thread a
chunk; 8 warps once the tokens outnumber the SMs), and a chunk past the token's context is
neither counted nor scanned (a branch the whole program takes alike): a decode CUDA graph's
scores are as wide as its context bound (GLM-5's 16,384 for contexts of 2,049-16,384), so a
token pays for its own context, not the bound.
First measured whole-row (one [16,384] tensor, every position counted and scanned; H100,
benchmarks/results/gpu_a8d729a/call1): 0.0334 ms at 32 x 8k in a graph against "auto"'s 0.0373
(the step 0.1195 against 0.1215), 0.063 against 0.054 at 256 x 8k; sm90 SASS: ~170
instructions a thread a bit and three barriers, the write's scan ~3,000. By chunks (the same
call's successor, gpu_a8d729a/call2): 0.0248 / 0.045 ms at 32 / 256 x 8k against "auto"'s
0.0378 / 0.0535 then, the step 0.1108 / 0.5287 against 0.1213 / 0.5363: "auto" takes it below
1,024 tokens over the rows it holds since (topk_triton.auto_form).

Rows past MAX_KEYS (a step's or a decode graph's max_seq_len) are refused: the row must fit
the registers (128 a thread at 16,384 positions, sm90 offline, no spill). The kernel has a
variant a chunk count (CHUNKS, 1-4, from the rows' width); on CUDA the first call builds all
four (`_compile_every_width`), so a later step whose rows reach more chunks launches at once
rather than compiling mid-serving (tests/kernels/test_specialization_gpu.py counts them).
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

import torch

from moeserve.kernels.attention.dsa import topk_triton
from moeserve.kernels.attention.metadata import AttentionMetadata
from moeserve.kernels.triton_common import num_sms, pdl_kwargs

MAX_KEYS = 16384
# A row width (positions) that is a multiple of this is read by 16-byte vector loads (the
# kernel's ALIGNED variant), which also gives the write's scans 4 positions a thread: sm90
# 3,832 -> 2,416 instructions at 4 chunks (warp scans 160 -> 48 SHFL.UP). indexer_triton pads
# its scores' rows to it; other widths run the plain variant.
ROW_ALIGN = 16
ALIGN_ROWS = True  # False: every row by the plain variant (an A/B switch: kernels_dsa times both)
CHUNK = 4096  # positions a register chunk: the row is up to MAX_KEYS / CHUNK of them
# Warps a program: 16 (8 keys a thread a chunk) while the tokens are at most the GPU's SMs
# (a program an SM), 8 past them (two programs share an SM). On an H100 in CUDA graphs
# (kernels_dsa, gpu_48511b5 / gpu_6f54c80 / gpu_5c4e2c2 / gpu_2e525ad, four runs): 32 tokens
# x 8k 0.0241-0.0243 ms at 16 against 0.0256-0.0259 at 8 and 0.0271-0.0274 at 32; 256 x 8k
# 0.0448-0.0452 at 16 against 0.0387-0.0389 at 8. WARPS set (an int) forces one count (the
# sweeps). Alternatives measured slower and removed: two threshold bits a round by three
# packed counts (0.0253 against 0.0242 ms at 32 x 8k; git's history at 6f54c80), a 4-bit digit
# a round from 16-bin histograms (0.0288 / 0.0514 against 0.0241 / 0.045 at 32 / 256 x 8k; at
# 2e525ad).
WARPS_FEW, WARPS_MANY = 16, 8
WARPS: int | None = None

tl: Any = None  # triton.language, bound by _kernels() (the kernel reads it as a global)
_context_end: Any = None  # topk_triton's jitted helpers, bound by _kernels()
_select_all: Any = None


def warps(num_tokens: int, device: torch.device) -> int:
    """A program's warps for a launch of num_tokens programs (WARPS' comment)."""
    if WARPS is not None:
        return WARPS
    if device.type != "cuda" or num_tokens <= num_sms(device):
        return WARPS_FEW
    return WARPS_MANY


def num_chunks(num_keys: int) -> int:
    """Register chunks of CHUNK positions holding rows of num_keys (a compiled variant
    each); ValueError past MAX_KEYS."""
    if num_keys > MAX_KEYS:
        raise ValueError(f"radix_topk bisect: rows of {num_keys} positions, at most "
                         f"{MAX_KEYS} (a row is held in registers)")
    return max(1, -(-num_keys // CHUNK))


def radix_topk_bisect(scores: torch.Tensor, meta: AttentionMetadata, t0: int, topk: int,
                      out: torch.Tensor, count_boundary_ties: bool = False) -> int:
    """topk_triton.radix_topk's contract, a program a token (the module docstring). Returns
    the boundary ties' count (a host sync) with count_boundary_ties, else 0."""
    n, num_keys = scores.shape
    chunks = num_chunks(num_keys)
    ties = torch.empty(n if count_boundary_ties else 1, dtype=torch.int32,
                       device=scores.device)
    args = (scores, out, meta.positions, meta.seq_lens, meta.token_to_req, t0, ties, num_keys,
            topk, out.stride(0))
    aligned = ALIGN_ROWS and num_keys % ROW_ALIGN == 0
    if scores.is_cuda:
        _compile_every_width(args, count_boundary_ties, aligned)
    _kernels().bisect[(n,)](*args, COUNT_TIES=count_boundary_ties, CHUNKS=chunks, CHUNK=CHUNK,
                            ALIGNED=aligned, num_warps=warps(n, scores.device),
                            **pdl_kwargs(scores.device))
    return int(ties.sum()) if count_boundary_ties else 0


_compiled: set[tuple] = set()  # (device, COUNT_TIES, WARPS, ALIGNED, PDL): variants built


def _compile_every_width(args: tuple, count_ties: bool, aligned: bool) -> None:
    """Every variant (a row width's chunk count, at each warp count `warps` may pick)
    compiled at the first call of a device and form, so that a later step whose rows reach
    another chunk count (a prefill's max_seq_len, a decode graph's bound) or whose tokens pass
    the SM count launches at once instead of compiling mid-serving."""
    key = (args[0].device, count_ties, WARPS, aligned, pdl_kwargs(args[0].device)["PDL"])
    if key in _compiled:
        return
    for num_warps in ((WARPS,) if WARPS is not None else (WARPS_FEW, WARPS_MANY)):
        for chunks in range(1, MAX_KEYS // CHUNK + 1):
            _kernels().bisect.warmup(*args, grid=(1,), COUNT_TIES=count_ties, CHUNKS=chunks,
                                     CHUNK=CHUNK, ALIGNED=aligned, num_warps=num_warps,
                                     **pdl_kwargs(args[0].device))
    _compiled.add(key)


@functools.cache
def _kernels() -> SimpleNamespace:
    """Import triton and jit the kernel, once (interpreted if TRITON_INTERPRET=1 now); the
    helpers it calls bound as globals. Step-varying ints are not specialised."""
    global tl, _context_end, _select_all, _load_keys, _hits, _write_chunk
    import triton
    import triton.language

    tl = triton.language
    topk_triton._kernels()  # binds topk_triton's jitted helpers
    _context_end = topk_triton._context_end
    _select_all = topk_triton._select_all
    _load_keys, _hits, _write_chunk = (triton.jit(f) for f in (_load_keys, _hits,
                                                               _write_chunk))
    varying = ["t0", "num_keys", "topk", "stride_out"]
    return SimpleNamespace(bisect=triton.jit(_bisect_kernel, do_not_specialize=varying))


def _load_keys(row, first, end, CHUNK: tl.constexpr, ALIGNED: tl.constexpr):
    """Positions first .. first + CHUNK of a row as unsigned keys (ord's sign bit flipped: the
    scores' order) and their mask (< end); past end the key is 0 (below every candidate
    threshold, which has a bit set, so the counts need no mask). ALIGNED (the row's width a
    multiple of ROW_ALIGN, 16): read up to end rounded up to 16, still inside the row, so the
    mask is constant over 16 positions and the loads are 16-byte vectors."""
    pos = first + tl.arange(0, CHUNK)
    ok = pos < end
    if ALIGNED:
        end_up = tl.multiple_of((end + 15) // 16 * 16, 16)
        s = tl.load(row + pos, mask=pos < end_up, other=-2147483648)
        s = tl.where(ok, s, -2147483648)
    else:
        s = tl.load(row + pos, mask=ok, other=-2147483648)
    return (s ^ -2147483648).to(tl.uint32, bitcast=True), ok


def _hits(u, cand, weight):
    """Keys at or above a candidate threshold (cand > 0: an unread position's 0 never is),
    each counted as `weight` (topk: a count of c sums to c * topk < 2^28). Not as 0 / 1: LLVM
    narrows a sum of 0/1 ints that fit a byte to packed i8 lanes, which ptxas packs and
    unpacks with PRMTs; a runtime weight's sum it cannot bound (sm90, the 4-chunk loop: 211
    instructions, 56 of them PRMT, as 0 / 1; 140 as fp32 ones, whose warp sums take five
    dependent shuffles; 127 weighted, one REDUX a warp)."""
    return tl.where(u >= cand, weight, 0)


def _write_chunk(out, u, ok, first, thr, need, taken, ties, CHUNK: tl.constexpr):
    """A chunk's selected positions (keys above thr, and those equal to it while their rank
    among thr's, `ties` of them before the chunk, is at most need) written at out[taken:] in
    position order; returns (taken, ties) after them (topk_triton._write_range on registers)."""
    above = ok & (u > thr)
    equal = ok & (u == thr)
    # both running counts in one scan (topk_triton._above_and_rank's packing), and both
    # totals from its last value, its largest (the packed counts only grow): one reduction
    both = tl.cumsum(above.to(tl.int32) | (equal.to(tl.int32) << 16), 0)
    above_to, rank = both & 0xFFFF, ties + (both >> 16)
    take = above | (equal & (rank <= need))
    place = taken + above_to + tl.minimum(rank, need) - tl.minimum(ties, need) - 1
    tl.store(out + place, first + tl.arange(0, CHUNK), mask=take)
    last = tl.max(both, 0)
    equals = last >> 16
    taken += (last & 0xFFFF) + tl.minimum(ties + equals, need) - tl.minimum(ties, need)
    return taken, ties + equals


def _bisect_kernel(scores_ptr, out_ptr, positions_ptr, seq_lens_ptr, token_to_req_ptr, t0,
                   ties_ptr, num_keys, topk, stride_out, COUNT_TIES: tl.constexpr,
                   CHUNKS: tl.constexpr, CHUNK: tl.constexpr, ALIGNED: tl.constexpr,
                   PDL: tl.constexpr):
    """Program i: token t0 + i's select, its row of ord scores in up to four register chunks
    of CHUNK positions, each counted and written only where the token's context reaches it
    (a decode graph's rows are as wide as its context bound; the module docstring).
    COUNT_TIES: ties_ptr[i] = 1 where T's scores outnumber those taken. PDL (a level,
    triton_common.pdl): launched early, it first waits for the previous kernel (2: then lets
    its successor launch; 3: both once it has read its token's metadata)."""
    if PDL == 1 or PDL == 2:  # at the top; 3: once the step's metadata below is read
        tl.extra.cuda.gdc_wait()
    if PDL == 2:
        tl.extra.cuda.gdc_launch_dependents()
    i = tl.program_id(0)
    end = _context_end(positions_ptr, seq_lens_ptr, token_to_req_ptr, t0 + i, num_keys)
    if PDL == 3:  # the metadata read: now the previous kernel's outputs (triton_common.pdl)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    out = out_ptr + i.to(tl.int64) * stride_out
    if end <= topk:
        _select_all(out, ties_ptr + i, end, topk, COUNT_TIES, CHUNK)
    else:
        row_start = i.to(tl.int64) * num_keys
        if ALIGNED:
            row_start = tl.multiple_of(row_start, 16)  # ROW_ALIGN
        row = scores_ptr + row_start
        u0, ok0 = _load_keys(row, 0, end, CHUNK, ALIGNED)
        u1, ok1 = _load_keys(row, CHUNK, end, CHUNK, ALIGNED)  # all masked where end is below
        u2, ok2 = _load_keys(row, 2 * CHUNK, end, CHUNK, ALIGNED)  # (CHUNKS bounds the variants)
        u3, ok3 = _load_keys(row, 3 * CHUNK, end, CHUNK, ALIGNED)
        thr = (end * 0).to(tl.uint32)
        bit = end * 0 + 31
        exact = end * 0
        while (bit >= 0) & (exact == 0):
            cand = thr | ((end * 0 + 1).to(tl.uint32) << bit.to(tl.uint32))
            hits = _hits(u0, cand, topk)
            if CHUNKS > 1:
                if end > CHUNK:
                    hits += _hits(u1, cand, topk)
            if CHUNKS > 2:
                if end > 2 * CHUNK:
                    hits += _hits(u2, cand, topk)
            if CHUNKS > 3:
                if end > 3 * CHUNK:
                    hits += _hits(u3, cand, topk)
            count = tl.sum(hits, 0)  # the keys at or above cand, times topk
            thr = tl.where(count >= topk * topk, cand, thr)
            exact = (count == topk * topk).to(tl.int32)
            bit -= 1
        above = (ok0 & (u0 > thr)).to(tl.int32)
        if CHUNKS > 1:
            above += (ok1 & (u1 > thr)).to(tl.int32)
        if CHUNKS > 2:
            above += (ok2 & (u2 > thr)).to(tl.int32)
        if CHUNKS > 3:
            above += (ok3 & (u3 > thr)).to(tl.int32)
        need = topk - tl.sum(above, 0)  # T's scores taken, the lowest first
        taken, ties = _write_chunk(out, u0, ok0, 0, thr, need, need * 0, need * 0, CHUNK)
        if CHUNKS > 1:
            if end > CHUNK:
                taken, ties = _write_chunk(out, u1, ok1, CHUNK, thr, need, taken, ties, CHUNK)
        if CHUNKS > 2:
            if end > 2 * CHUNK:
                taken, ties = _write_chunk(out, u2, ok2, 2 * CHUNK, thr, need, taken, ties,
                                           CHUNK)
        if CHUNKS > 3:
            if end > 3 * CHUNK:
                taken, ties = _write_chunk(out, u3, ok3, 3 * CHUNK, thr, need, taken, ties,
                                           CHUNK)
        if COUNT_TIES:
            tl.store(ties_ptr + i, (ties > need).to(tl.int32))
