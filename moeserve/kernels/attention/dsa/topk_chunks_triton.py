"""DSA's radix top-k, its "chunks" form: `radix_topk_chunks`, topk_triton.radix_topk's contract
(the module docstring there) for few tokens with long contexts.

Six launches over (token, chunk of CHUNK positions) programs, each program reading its chunk's
4-byte scores once, so few tokens with long contexts still spread over the GPU:

    hist level 0     histogram of u's top byte over the token's valid scores
    hist level 1-3   of the next byte, among the scores whose higher bytes are the
                     threshold's so far (the bins the levels before found) -> the threshold T
    count            per chunk: scores above T, scores equal to T
    write            each selected position at (selected before its chunk) + (before it in it)

Every histogram is summed into the token's hist[level, 256] (in one zeroed workspace a token,
beside the chunks' counts) by atomic adds of its nonzero bins; then each program arrives at its
token's counter for the level, and the last to arrive finds the level's bin from the whole
histogram (the bin b with fewer than `need` scores above it and at least `need` from it; `need`
starts at topk and loses each level's scores above its bin) and stores it with the prefix so
far for the later launches (three ints to load, where each program found every level's bin
again before: ~450 of a level-3 program's 1,584 sm90 instructions, ~600 of the count's 808).
No launch waits on a host value and the whole op has static shapes given n and S: it can be
captured in a CUDA graph. The selection is T's scores above, plus the first (topk - above)
scores equal to T in position order. The write is deterministic:
offsets come from the count's per-chunk totals, not from atomics.

With topk_triton.GATHER the levels 2 and 3 launches are a gather launch (each chunk's scores of
the threshold's 16-bit bin placed in a buffer of up to a GATHER_SHARE-th of the row, at least
topk, slots from an atomic counter) and a last_levels launch (a program a token: both levels
over the placed scores, or over its whole row where they were more, and the threshold stored
as the last level would have).
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

import torch

from moeserve.kernels.attention.dsa import topk_triton
from moeserve.kernels.attention.metadata import AttentionMetadata

tl: Any = None  # triton.language, bound by _kernels() (the kernels read it as a global)
# topk_triton's jitted helpers, bound by _kernels()
_context_end: Any = None
_top_bits: Any = None
_digit: Any = None
_ord_of: Any = None
_range_hist: Any = None
_chunks_before: Any = None
_gather_range: Any = None
_above_and_rank: Any = None


def radix_topk_chunks(scores: torch.Tensor, meta: AttentionMetadata, t0: int, topk: int,
                      out: torch.Tensor, chunk: int, count_boundary_ties: bool = False,
                      gather: bool | None = None) -> int:
    """topk_triton.radix_topk's contract in six launches, chunk positions a program (a power
    of two, checked by radix_topk); gather: levels 2 and 3 from the gathered scores (default
    topk_triton.GATHER). Returns the boundary ties' count (a host sync) with
    count_boundary_ties, else 0."""
    n, num_keys = scores.shape
    levels, bins = topk_triton._LEVELS, topk_triton._BINS
    gather = topk_triton.GATHER if gather is None else gather
    kern = _kernels()
    rows = (meta.positions, meta.seq_lens, meta.token_to_req, t0)
    num_chunks = -(-num_keys // chunk)
    grid = (n, num_chunks)
    consts = dict(LEVELS=levels, CHUNK=chunk, BINS=bins, num_warps=4)
    tie_flag = levels * bins + 2 * num_chunks
    if num_keys > topk:
        # one zeroed workspace a token (one memset): its histograms [LEVELS, BINS], its chunks'
        # (above, equal) counts [num_chunks, 2], then (_tail) its boundary-tie flag, the
        # gather's count of the scores it has placed, an arrival counter a level and what each
        # level's last program found (prefix, need, at)
        work = torch.zeros(n, tie_flag + 2 + 4 * levels, dtype=torch.int32,
                           device=scores.device)
        for level in range(2 if gather else levels):
            kern.hist[grid](scores, work, *rows, num_keys, topk, work.stride(0), LEVEL=level,
                            **consts)
        if gather:  # the last two levels from the gathered scores (topk_triton.GATHER's comment)
            # the scores a token's bin may place
            room = max(topk, -(-num_keys // topk_triton.GATHER_SHARE))
            bin_scores = torch.empty(n, room, dtype=torch.int32, device=scores.device)
            kern.gather[grid](scores, work, bin_scores, *rows, num_keys, topk, room,
                              num_chunks, work.stride(0), bin_scores.stride(0), **consts)
            kern.last_levels[(n,)](scores, work, bin_scores, *rows, num_keys, topk, room,
                                   num_chunks, work.stride(0), bin_scores.stride(0), **consts)
        kern.count[grid](scores, work, *rows, num_keys, topk, num_chunks, work.stride(0),
                         COUNT_TIES=count_boundary_ties, **consts)
    else:  # every token selects its whole context: the write alone (work unread)
        work = scores
    kern.write[grid](scores, work, out, *rows, num_keys, topk, num_chunks, work.stride(0),
                     out.stride(0), **consts)
    return int(work[:, tie_flag].sum()) if count_boundary_ties and num_keys > topk else 0


@functools.cache
def _kernels() -> SimpleNamespace:
    """Import triton and jit the kernels once, with topk_triton's helpers they call by global
    name. NOTE: step-varying ints are exempt from specialisation (a new batch shape must not
    compile a new variant mid-serving)."""
    global tl, _context_end, _top_bits, _digit, _ord_of, _range_hist, _chunks_before
    global _gather_range, _above_and_rank, _chunk_program, _tail, _found, _store_found, _arrive
    import triton
    import triton.language

    topk_triton._kernels()
    tl = triton.language
    _context_end, _top_bits, _digit, _ord_of = (topk_triton._context_end, topk_triton._top_bits,
                                                topk_triton._digit, topk_triton._ord_of)
    _range_hist, _chunks_before = topk_triton._range_hist, topk_triton._chunks_before
    _gather_range, _above_and_rank = topk_triton._gather_range, topk_triton._above_and_rank
    _chunk_program, _tail, _found, _store_found, _arrive = (triton.jit(f) for f in (
        _chunk_program, _tail, _found, _store_found, _arrive))
    varying = ["t0", "num_keys", "topk", "room", "num_chunks", "stride_work", "stride_out",
               "stride_bin"]
    jit = functools.partial(triton.jit, do_not_specialize=varying)
    return SimpleNamespace(hist=jit(_radix_hist_kernel), count=jit(_radix_count_kernel),
                           write=jit(_radix_write_kernel), gather=jit(_radix_gather_kernel),
                           last_levels=jit(_radix_last_levels_kernel))


# ---- Triton functions (jitted by _kernels; module globals, as the interpreter resolves
# names) ----

def _chunk_program(positions_ptr, seq_lens_ptr, token_to_req_ptr, t0, num_keys,
                   CHUNK: tl.constexpr):
    """Program (i, c) of a (token, chunk) launch: i, c, the chunk's first position and token
    t0 + i's context end."""
    i = tl.program_id(0)
    c = tl.program_id(1)
    end = _context_end(positions_ptr, seq_lens_ptr, token_to_req_ptr, t0 + i, num_keys)
    return i, c, c * CHUNK, end


def _tail(work, num_chunks, LEVELS: tl.constexpr, BINS: tl.constexpr):
    """A token's work row past its histograms and chunk counts (radix_topk's layout): the tie
    flag, the gather's counter, an arrival counter a level, then (prefix, need, at) a level."""
    return work + LEVELS * BINS + 2 * num_chunks


def _found(tail, LEVEL: tl.constexpr, LEVELS: tl.constexpr):
    """(prefix, need, at) after level LEVEL, as the level's last program stored them: u's top
    8 x (LEVEL + 1) bits of the threshold, the scores equal to it still to take, and the
    level's count at its bin."""
    d = tail + 2 + LEVELS + 3 * LEVEL
    return tl.load(d), tl.load(d + 1), tl.load(d + 2)


def _store_found(tail, prefix, need, at, LEVEL: tl.constexpr, LEVELS: tl.constexpr):
    d = tail + 2 + LEVELS + 3 * LEVEL
    tl.store(d, prefix)
    tl.store(d + 1, need)
    tl.store(d + 2, at)


def _arrive(work, tail, end, prefix, need, LEVEL: tl.constexpr, LEVELS: tl.constexpr,
            CHUNK: tl.constexpr, BINS: tl.constexpr):
    """This program's arrival once its histogram of level LEVEL is added; the token's last
    (of its cdiv(end, CHUNK) programs) finds the level's digit from the whole histogram and
    stores what it finds (`_found`), so later launches load three ints instead of finding
    every level's digit again."""
    tl.debug_barrier()  # every thread's histogram atomics before the arrival
    ticket = tl.atomic_add(tail + 2 + LEVEL, 1)
    if ticket == tl.cdiv(end, CHUNK) - 1:  # the others' counts are all in
        hist = tl.load(work + LEVEL * BINS + tl.arange(0, BINS), volatile=True)
        b, need, at = _digit(hist, need, BINS)
        _store_found(tail, (prefix << 8) | b, need, at, LEVEL, LEVELS)


def _radix_hist_kernel(scores_ptr, work_ptr, positions_ptr, seq_lens_ptr, token_to_req_ptr,
                       t0, num_keys, topk, stride_work, LEVEL: tl.constexpr,
                       LEVELS: tl.constexpr,
                       CHUNK: tl.constexpr, BINS: tl.constexpr):
    """Program (i, chunk c): level LEVEL's digit histogram of token t0 + i's valid scores in
    chunk c whose higher digits are the threshold's so far, added into token i's histogram
    LEVEL (work row i); the token's last program to arrive finds the level's digit."""
    i, _, n0, end = _chunk_program(positions_ptr, seq_lens_ptr, token_to_req_ptr, t0,
                                   num_keys, CHUNK)
    if (end > topk) & (n0 < end):
        work = work_ptr + i.to(tl.int64) * stride_work
        tail = _tail(work, tl.num_programs(1), LEVELS, BINS)
        n = n0 + tl.arange(0, CHUNK)
        ok = n < end
        s = tl.load(scores_ptr + i.to(tl.int64) * num_keys + n, mask=ok, other=0)  # ord
        if LEVEL == 0:
            prefix = end * 0
            need = topk + end * 0
            digit = ((s >> 24) & 0xFF) ^ 0x80  # u's top byte
        else:
            prefix, need, _ = _found(tail, LEVEL - 1, LEVELS)
            ok = ok & (_top_bits(s, LEVEL) == prefix)
            digit = (s >> (24 - 8 * LEVEL)) & 0xFF
        # from level 1 most chunks hold no score of the threshold's bins: no histogram there
        if (LEVEL == 0) or (tl.sum(ok.to(tl.int32), 0) > 0):
            counts = tl.histogram(digit, BINS, mask=ok)
            tl.atomic_add(work + LEVEL * BINS + tl.arange(0, BINS), counts, mask=counts > 0)
        _arrive(work, tail, end, prefix, need, LEVEL, LEVELS, CHUNK, BINS)


def _radix_gather_kernel(scores_ptr, work_ptr, bin_ptr, positions_ptr, seq_lens_ptr,
                         token_to_req_ptr, t0, num_keys, topk, room, num_chunks, stride_work,
                         stride_bin, LEVELS: tl.constexpr, CHUNK: tl.constexpr,
                         BINS: tl.constexpr):
    """Program (i, c) (GATHER): token t0 + i's scores in chunk c whose u's top 16 bits are the
    threshold's (levels 0 and 1 found), placed in bin_ptr's row i at slots a counter in its
    work row hands out, when they number at most `room` in all (else nothing: last_levels
    reads the row)."""
    i, c, n0, end = _chunk_program(positions_ptr, seq_lens_ptr, token_to_req_ptr, t0,
                                   num_keys, CHUNK)
    if (end > topk) & (n0 < end):
        tail = _tail(work_ptr + i.to(tl.int64) * stride_work, num_chunks, LEVELS, BINS)
        prefix, _, at = _found(tail, 1, LEVELS)
        if at <= room:
            _gather_range(scores_ptr + i.to(tl.int64) * num_keys, bin_ptr + i.to(tl.int64) *
                          stride_bin, n0, tl.minimum(n0 + CHUNK, end), prefix, tail + 1, CHUNK)


def _radix_last_levels_kernel(scores_ptr, work_ptr, bin_ptr, positions_ptr, seq_lens_ptr,
                              token_to_req_ptr, t0, num_keys, topk, room, num_chunks,
                              stride_work, stride_bin, LEVELS: tl.constexpr,
                              CHUNK: tl.constexpr, BINS: tl.constexpr):
    """Program i (GATHER): token t0 + i's digits of levels 2 and 3 from the scores the gather
    placed in bin_ptr's row i (CHUNK a step), or from its whole row where they were more than
    `room`; the threshold stored as the hist launches' last level would (`_found`)."""
    i = tl.program_id(0)
    end = _context_end(positions_ptr, seq_lens_ptr, token_to_req_ptr, t0 + i, num_keys)
    if end > topk:
        tail = _tail(work_ptr + i.to(tl.int64) * stride_work, num_chunks, LEVELS, BINS)
        prefix, need, at = _found(tail, 1, LEVELS)
        src = scores_ptr + i.to(tl.int64) * num_keys
        n_src = end
        if at <= room:
            src = bin_ptr + i.to(tl.int64) * stride_bin
            n_src = at
        for level in tl.static_range(2, LEVELS):
            hist = _range_hist(src, 0, n_src, prefix, level, CHUNK, BINS, False)
            b, need, at = _digit(hist, need, BINS)
            prefix = (prefix << 8) | b
        _store_found(tail, prefix, need, at, LEVELS - 1, LEVELS)


def _radix_count_kernel(scores_ptr, work_ptr, positions_ptr, seq_lens_ptr, token_to_req_ptr,
                        t0, num_keys, topk, num_chunks, stride_work, COUNT_TIES: tl.constexpr,
                        LEVELS: tl.constexpr, CHUNK: tl.constexpr, BINS: tl.constexpr):
    """Program (i, c): token i's chunk counts [c] = (scores above T, scores equal to T) in
    chunk c; with COUNT_TIES, chunk 0 also sets the token's tie flag where T's scores
    outnumber those taken."""
    i, c, n0, end = _chunk_program(positions_ptr, seq_lens_ptr, token_to_req_ptr, t0,
                                   num_keys, CHUNK)
    if (end > topk) & (n0 < end):
        work = work_ptr + i.to(tl.int64) * stride_work
        tail = _tail(work, num_chunks, LEVELS, BINS)
        u, need, at = _found(tail, LEVELS - 1, LEVELS)
        thr = _ord_of(u)
        n = n0 + tl.arange(0, CHUNK)
        ok = n < end
        s = tl.load(scores_ptr + i.to(tl.int64) * num_keys + n, mask=ok, other=0)
        counts = work + LEVELS * BINS + c * 2
        tl.store(counts, tl.sum((ok & (s > thr)).to(tl.int32), 0))
        tl.store(counts + 1, tl.sum((ok & (s == thr)).to(tl.int32), 0))
        if COUNT_TIES:
            if c == 0:
                tl.store(tail, (at > need).to(tl.int32))


def _radix_write_kernel(scores_ptr, work_ptr, out_ptr, positions_ptr, seq_lens_ptr,
                        token_to_req_ptr, t0, num_keys, topk, num_chunks, stride_work,
                        stride_out, LEVELS: tl.constexpr, CHUNK: tl.constexpr,
                        BINS: tl.constexpr):
    """Program (i, c): token t0 + i's selected positions of chunk c, in position order, at
    their places in out[i] (after those of chunks < c); chunk 0 also writes -1 at the places
    a context shorter than topk leaves."""
    i, c, n0, end = _chunk_program(positions_ptr, seq_lens_ptr, token_to_req_ptr, t0,
                                   num_keys, CHUNK)
    n = n0 + tl.arange(0, CHUNK)
    ok = n < end
    out = out_ptr + i.to(tl.int64) * stride_out
    if c == 0:
        for j in range(tl.maximum(end, 0), topk, CHUNK):  # the places past a short context
            place = j + tl.arange(0, CHUNK)
            tl.store(out + place, tl.full([CHUNK], -1, tl.int32), mask=place < topk)
    if n0 < end:
        if end <= topk:  # the whole context: position s at place s
            tl.store(out + n, n, mask=ok)
        else:
            work = work_ptr + i.to(tl.int64) * stride_work
            u, need, _ = _found(_tail(work, num_chunks, LEVELS, BINS), LEVELS - 1, LEVELS)
            thr = _ord_of(u)
            above_before, equal_before = _chunks_before(work + LEVELS * BINS, c, False)
            s = tl.load(scores_ptr + i.to(tl.int64) * num_keys + n, mask=ok, other=0)
            above = ok & (s > thr)
            equal = ok & (s == thr)
            above_to, rank = _above_and_rank(above, equal, equal_before)
            take = above | (equal & (rank <= need))
            # after the chunks before's (above_before + min(equal_before, need) places), this
            # chunk's above and taken equal scores up to each position
            tl.store(out + above_before + above_to + tl.minimum(rank, need) - 1, n, mask=take)
