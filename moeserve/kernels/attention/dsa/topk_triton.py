"""DSA's top-k on Triton: each query token's `topk` highest-scoring context positions, by radix
select over the indexer's scores (dsa/indexer_triton.py writes them), instead of torch.topk.

Input: scores [n, S] int32, the fp32 score of (token t0 + i, position s) as an int32 of the
same order ("ord": its bits, the magnitude bits flipped for negatives, -0.0 made +0.0), valid
where s < end(t) = min(position(t) + 1, seq_len(row of t), S) (the rest is never read). Output:
the positions of the selection, in ascending position order, -1 after them:

    a token whose end <= topk selects every position < end (no score is read);
    else the topk largest scores, ties at the boundary to the LOWEST positions
    (the reference's stable sort): exactly `topk` positions.

Radix select: u = ord with its sign bit flipped orders as an unsigned int, read as four 8-bit
digits from the top. Four forms (`radix_topk`'s form, default FORM):

"row": one launch, a program a token (`_radix_row_kernel`): four passes over the token's
scores, CHUNK a step, each summing one digit's histogram in registers among the scores whose
higher digits are the threshold's so far, then one pass writing the selection in position
order with running offsets. No workspace, no atomics, no memset. A token's select is one
SM's work, and each step's cross-warp reductions (the histogram, the scans) wait on barriers:
on the H200 about 8 clocks a position (gpu_039305d/call4, call5: 0.26 ms for one token of 64k
positions, against 0.075 for the chunks form over 32 programs; pipelining its loads with
tl.range changed nothing). With 256 tokens and more it is level or faster (256 x 8k: 0.063 ms
in a graph against 0.079; W3's prefill chunks 4.87 against 5.76 ms; 256 x 64k at 2,048 a step:
0.435 against 0.403; at ROW_CHUNK 4,096 0.382). "auto" took it from 256 tokens over rows of at
most 16,384 positions until the bisect form measured faster there (FORM's comment).

"chunks" (topk_chunks_triton.py): six launches over (token, chunk of CHUNK positions) programs,
each reading its chunk's scores once, so few tokens with long contexts still spread over the
GPU. "coop" (topk_coop_triton.py): the chunks form's passes in one launch. "bisect"
(topk_bisect_triton.py): a program a token, its row of at most 16,384 positions in registers,
the threshold built bit by bit by block counts: "auto"'s form below 1,024 tokens over such
rows.

GATHER ("auto" turns it on with the chunks form, FORM's comment has the timings): the
threshold's 16-bit bin (levels 0 and 1) holds few
scores, and levels 2 and 3 need only them, yet each of those passes runs a histogram over every
score (Triton's histogram costs a 2,048-position program ~1,300 sm90 instructions whatever its
mask). So the bin's scores, where at most topk, are placed in `out` first (an atomic slot
each, in any order: the write pass replaces them last), and levels 2 and 3 histogram those:
in the row form inside its program, in the coop form after one barrier by each program
itself, in the chunks form by a gather and a last_levels launch (into a buffer of up to a
quarter of the row). A fuller bin is read from the row as before. Offline (sm90 SASS, a
2,048-position program): gather 624 instructions against a histogram pass's ~1,300-1,450;
the chunks form ~8,650 instructions a chunk at 3f5092c's parent, ~6,600 after its last
arrivers (topk_chunks_triton.py), ~4,700 with GATHER (plus last_levels' 2,712 a token).

Why: torch.topk over int64 sort keys (score << 32 | position) was 20-28% of DSA's decode step on
the H200 at GLM-5's shape (benchmarks/results/gpu_bc677c8: 0.08 ms at 32 tokens and 8k
positions, 0.56 ms at 256 and 64k), with the score kernel writing 8 bytes a position. First
measured (gpu_bc677c8/call5, a version with three launches more): faster where the GPU work
dominates (the indexer 0.594 -> 0.414 ms at 32 tokens and 64k, the top-k 0.558 -> 0.413 ms at
256 and 64k), slower eager at 8k where the launches' host time does (0.183 -> 0.233 ms); a
served decode step replays it in a CUDA graph, which kernels_dsa times too.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

import torch

from moeserve import envs
from moeserve.kernels.attention.metadata import AttentionMetadata
from moeserve.kernels.triton_common import num_sms

CHUNK = 2048  # positions a program (tests set a smaller chunk so that rows span several)
# 8-bit digits, four levels: Triton's histogram costs a thread about BINS / 32 instructions an
# element (a ballot per bin bit, a popcount per bin a lane owns), so 256 bins over four passes
# cost less than 2,048 over three (sm90 SASS: 3,904 instructions a 2,048-position program)
_BINS = 256
_LEVELS = 4
FORMS = ("auto", "row", "chunks", "coop", "bisect")  # coop: topk_coop_triton.py's one launch;
# bisect: topk_bisect_triton.py's program a token, the row in registers (rows <= 16,384)
# radix_topk's default form; "auto" (auto_form): the bisect form below CHUNKS_GATHER_MIN_TOKENS
# tokens over rows of at most BISECT_MAX_KEYS positions, else the chunks form with GATHER. The
# rows' width is the scores' (meta.max_seq_len): in a decode CUDA graph the graph's context
# bound (runner/cuda_graphs.py: GLM-5's 16,384 for contexts of 2,049-16,384, then 131,072), so
# the bisect form takes the 16,384 graph's steps.
# On an H100 in CUDA graphs (gpu_a8d729a/call2, kernels_dsa's decode cases at 8k positions):
# the bisect form 0.0248 / 0.045 ms at 32 / 256 tokens against "auto"'s chunks with GATHER /
# row form before it, 0.0378 / 0.0535 (the DSA step 0.1108 / 0.5287 against 0.1213 / 0.5363;
# with the scores as wide as the served graph's bound, 0.114 / 0.532 against 0.125 / 0.538).
# Earlier (gpu_77293e0/call4): chunks with GATHER 0.0595 / 0.0858 ms at 32 x 64k / 128 x 32k
# against 0.068 / 0.102 without, level at 32 x 8k; at 256 tokens the row form 0.053 ms over 8k
# positions against chunks with GATHER's 0.061, but 0.410 over 64k against 0.258. W3's prefill
# chunks (gpu_948136d/call3, call11): chunks with GATHER 3.58-3.60 / 0.716-0.721 / 0.499-0.501
# ms against the row form's 4.36-4.39 / 0.844-0.851 / 0.627-0.629 (8,192 after 24,576 / after
# 0, 1,024 after 31,744). Many tokens over short rows (a prefill of up to 16k context) stay
# with chunks and GATHER until the bisect form is timed there. Not yet timed on the H200.
FORM = envs.dsa_topk_form("auto")  # MOESERVE_DSA_TOPK_FORM sets it for a served A/B
BISECT_MAX_KEYS = 16384  # topk_bisect_triton.MAX_KEYS: the rows its registers hold
CHUNKS_GATHER_MIN_TOKENS = 1024
# ... and "coop" (topk_coop_triton.py) up to this many tokens: 0, none. On the H100
# (gpu_77293e0/call4) the DSA step with it 3.0% faster at 32 x 8k (0.1177 against 0.1214 ms;
# 0.1199 with GATHER), 3.0 / 2.7 / 4.3% slower at 32 x 64k, 128 x 32k, 256 x 8k: kept off.
# Never past the GPU's SMs, where it is never refused.
COOP_MAX_TOKENS = 0
# The threshold's last two digits from its 16-bit bin's scores gathered first (at most topk of
# them, into `out`, which the write pass fills last; else from every score as before): in
# every form two of the four histogram passes over every score become one light gather pass
# and two histograms of the gathered few (the coop form: two barriers fewer). "auto" turns it
# on with the chunks form (FORM's comment); True turns it on in every form. The chunks form's
# gathered scores take max(topk, S / GATHER_SHARE) a token, never more than the scores' own
# bytes, which the indexer bounds (indexer_triton._CHUNK_KEYS: 128 MiB of scores a launch).
GATHER = False
# ... the chunks form's gathered scores: up to a GATHER_SHARE-th of a row (at least topk) in a
# buffer of their own, so that a bin of concentrated scores (a few thousand of 64k within its
# 1/128 of a value) still gathers; only a bin of more is read from the row, by one program a
# token. The row and coop forms gather into `out` (topk places) and read a fuller bin from
# the row as before, across their programs.
GATHER_SHARE = 4
ROW_CHUNK = 4096  # the row form's positions a step, and its warps (gpu_039305d/call6: in a
ROW_WARPS = 8  # graph 0.058 / 0.382 ms at 256 x 8k / 64k against 0.063 / 0.436 at 2,048)
# Smaller chunks where a launch has few programs (32 tokens of 8k positions: 128 programs of 4
# warps at 2,048) measured no faster on the H100 (gpu_b8a5462/call2, the chunks form in a CUDA
# graph at 256 / 512 / 1,024 / 2,048 positions a program: 0.041 / 0.037 / 0.039 / 0.041 ms,
# the DSA step 0.134 against 0.131 ms with 256; slower at every other case): the six
# launches' latency, about 7 us each, not the histograms' work, sets the top-k's time there.

tl: Any = None  # triton.language, bound by _kernels() (the kernels read it as a global)


def radix_topk(scores: torch.Tensor, meta: AttentionMetadata, t0: int, topk: int,
               out: torch.Tensor, chunk: int | None = None,
               count_boundary_ties: bool = False, form: str | None = None) -> int:
    """Write tokens t0 .. t0 + n's selections into out [n, topk] int32, every place (-1 after
    a short context's; the module docstring has the contract). meta's positions, seq_lens and
    token_to_req give each token's context end, on the device. form: "row" (one program a
    token, ROW_CHUNK positions a step), "chunks" (six launches over (token, chunk of positions)
    programs, CHUNK positions a chunk, topk_chunks_triton.py), "coop" (the chunks form's
    passes in one launch, topk_coop_triton.py; at most a token an SM), "bisect" (a program a
    token, its row of at most 16,384 positions in registers, topk_bisect_triton.py; chunk
    unused) or "auto" (auto_form: bisect for fewer than CHUNKS_GATHER_MIN_TOKENS tokens over
    rows it holds, else chunks with GATHER); default the module's FORM. chunk overrides the
    form's positions a program or step (tests: small, so rows span several).
    Returns the number of tokens whose topk-th and (topk + 1)-th scores are equal (a host
    sync) with count_boundary_ties, else 0."""
    n, num_keys = scores.shape
    if n == 0:
        return 0
    form = form or FORM
    if form not in FORMS:
        raise ValueError(f"radix_topk: form {form!r} not in {FORMS}")
    gather = GATHER
    if form == "auto":
        form, auto_gather = auto_form(n, num_keys, scores.device)
        gather = gather or auto_gather
    if form == "bisect":  # a program a token, its row in registers (imported here: it imports us)
        if chunk is not None and (chunk < 16 or chunk & (chunk - 1)):  # unused, still checked
            raise ValueError(f"radix_topk: chunk must be a power of two >= 16, got {chunk}")
        from moeserve.kernels.attention.dsa.topk_bisect_triton import radix_topk_bisect

        return radix_topk_bisect(scores, meta, t0, topk, out, count_boundary_ties)
    if form == "coop":  # the chunks form's passes in one launch (imported here: it imports us)
        from moeserve.kernels.attention.dsa.topk_coop_triton import radix_topk_coop

        return radix_topk_coop(scores, meta, t0, topk, out, chunk, count_boundary_ties)
    chunk = chunk or (ROW_CHUNK if form == "row" else CHUNK)
    if chunk < 16 or chunk & (chunk - 1):
        raise ValueError(f"radix_topk: chunk must be a power of two >= 16, got {chunk}")
    if form == "chunks":  # topk_chunks_triton.py (imported here: it imports us)
        from moeserve.kernels.attention.dsa.topk_chunks_triton import radix_topk_chunks

        return radix_topk_chunks(scores, meta, t0, topk, out, chunk, count_boundary_ties,
                                 gather)
    # the tie flags, and with GATHER first each token's gather counter (zeroed)
    ties = (torch.zeros if gather else torch.empty)(
        n if count_boundary_ties or gather else 1, dtype=torch.int32, device=scores.device)
    _kernels().row[(n,)](scores, out, meta.positions, meta.seq_lens, meta.token_to_req, t0,
                         ties, num_keys, topk, out.stride(0), COUNT_TIES=count_boundary_ties,
                         GATHER=gather, BLOCK=chunk, BINS=_BINS, num_warps=ROW_WARPS)
    return int(ties.sum()) if count_boundary_ties else 0


def auto_form(n: int, num_keys: int, device: torch.device) -> tuple[str, bool]:
    """"auto"'s (form, GATHER) for n tokens' rows of num_keys positions: ("bisect", False)
    below CHUNKS_GATHER_MIN_TOKENS tokens over rows of at most BISECT_MAX_KEYS; else
    ("coop", False) up to COOP_MAX_TOKENS tokens but never past a token an SM of a CUDA device
    (where it always fits); else ("chunks", True)."""
    if n < CHUNKS_GATHER_MIN_TOKENS and num_keys <= BISECT_MAX_KEYS:
        return "bisect", False
    sms = num_sms(device) if device.type == "cuda" else n
    if n <= min(COOP_MAX_TOKENS, sms):
        return "coop", False
    return "chunks", True


@functools.cache
def _kernels() -> SimpleNamespace:
    """Import triton and jit the kernels, once (interpreted if TRITON_INTERPRET=1 now). The
    kernels call the helpers and read `tl` by global name, so those are bound here. NOTE:
    step-varying ints are exempt from specialisation (a new batch shape must not compile a new
    variant mid-serving)."""
    global tl, _context_end, _top_bits
    global _digit, _ord_of, _range_hist, _write_range, _chunks_before, _gather_range
    global _above_and_rank, _select_all
    import triton
    import triton.language

    tl = triton.language
    _context_end, _top_bits = triton.jit(_context_end), triton.jit(_top_bits)
    _digit, _ord_of, _range_hist, _write_range, _chunks_before, _gather_range = (
        triton.jit(f) for f in (_digit, _ord_of, _range_hist, _write_range, _chunks_before,
                                _gather_range))
    _above_and_rank, _select_all = triton.jit(_above_and_rank), triton.jit(_select_all)
    varying = ["t0", "num_keys", "topk", "stride_out"]
    return SimpleNamespace(row=triton.jit(_radix_row_kernel, do_not_specialize=varying))


# ---- Triton helpers and kernels (jitted by _kernels; module globals, as the interpreter
# resolves names) ----

def _context_end(positions_ptr, seq_lens_ptr, token_to_req_ptr, tok, num_keys):
    """Positions token `tok` sees: min(its position + 1, its row's seq_len) (the score
    kernel's bound), and never past the scores' row (num_keys: a step's max_seq_len, or a
    CUDA graph's context bound, which every replayed context stays within)."""
    req = tl.load(token_to_req_ptr + tok)
    end = tl.minimum(tl.load(positions_ptr + tok) + 1, tl.load(seq_lens_ptr + req))
    return tl.minimum(end, num_keys).to(tl.int32)


def _digit(hist, need, BINS: tl.constexpr):
    """The bin b of a histogram [BINS] (registers) with fewer than `need` counts above it and
    at least `need` from it; returns (b, need minus the counts above b, hist[b])."""
    bins = tl.arange(0, BINS)
    from_bin = tl.cumsum(hist, 0, reverse=True)  # [BINS]: counts in bins >= b
    b = tl.sum((from_bin >= need).to(tl.int32), 0) - 1
    above = tl.sum(tl.where(bins == b, from_bin - hist, 0), 0)
    at = tl.sum(tl.where(bins == b, hist, 0), 0)
    return b, need - above, at


def _ord_of(u):
    """The threshold's ord from u's bits: the sign bit flipped back (the shift wraps into
    it)."""
    return ((((u >> 24) & 0xFF) ^ 0x80) << 24) | (u & 0xFFFFFF)


def _range_hist(row, n0, n1, prefix, LEVEL: tl.constexpr, BLOCK: tl.constexpr,
                BINS: tl.constexpr, VOLATILE: tl.constexpr):
    """Level LEVEL's digit histogram [BINS] of the ord scores row[n0:n1], BLOCK a step: u's
    top byte at level 0, then the next byte among the scores whose higher digits are
    `prefix` (the threshold's so far). VOLATILE: read past L1 (other programs wrote them)."""
    hist = tl.zeros([BINS], tl.int32)
    for b0 in range(n0, n1, BLOCK):
        n = b0 + tl.arange(0, BLOCK)
        ok = n < n1
        s = tl.load(row + n, mask=ok, other=0, volatile=VOLATILE)  # ord
        if LEVEL == 0:
            hist += tl.histogram(((s >> 24) & 0xFF) ^ 0x80, BINS, mask=ok)
        else:  # only the scores whose higher digits are the threshold's so far
            ok = ok & (_top_bits(s, LEVEL) == prefix)
            if tl.sum(ok.to(tl.int32), 0) > 0:
                hist += tl.histogram((s >> (24 - 8 * LEVEL)) & 0xFF, BINS, mask=ok)
    return hist


def _write_range(row, out, n0, n1, thr, need, taken, ties, BLOCK: tl.constexpr):
    """The selected positions of row[n0:n1] (scores above thr, and those equal to it while
    their rank among thr's, `ties` of them before n0, is at most need) written at out[taken:]
    in position order, BLOCK a step; returns (taken, ties) after them."""
    for b0 in range(n0, n1, BLOCK):
        n = b0 + tl.arange(0, BLOCK)
        ok = n < n1
        s = tl.load(row + n, mask=ok, other=0)
        above = ok & (s > thr)
        equal = ok & (s == thr)
        above_to, rank = _above_and_rank(above, equal, ties)
        take = above | (equal & (rank <= need))
        # taken up to here: the scores above, and T's while their rank is at most need
        place = taken + above_to + tl.minimum(rank, need) - tl.minimum(ties, need) - 1
        tl.store(out + place, n, mask=take)
        equals = tl.sum(equal.to(tl.int32), 0)
        taken += (tl.sum(above.to(tl.int32), 0) + tl.minimum(ties + equals, need)
                  - tl.minimum(ties, need))
        ties += equals
    return taken, ties


def _above_and_rank(above, equal, ties):
    """Both running counts of a block in one scan (above in the low 16 bits, equal in the high:
    a block holds fewer than 2^16 positions): the scores above T up to each position, and
    each position's 1-based rank among T's scores, `ties` of them before the block."""
    both = tl.cumsum(above.to(tl.int32) | (equal.to(tl.int32) << 16), 0)
    return both & 0xFFFF, ties + (both >> 16)


def _gather_range(row, out, n0, n1, prefix, counter, BLOCK: tl.constexpr):
    """The ord scores of row[n0:n1] whose u's top 16 bits are `prefix` (the threshold's first
    two digits) written into out at the slots the int32 at `counter` hands out (an atomic add
    a score: they are few, and only their histograms are taken, not their order), BLOCK a
    step."""
    for b0 in range(n0, n1, BLOCK):
        n = b0 + tl.arange(0, BLOCK)
        s = tl.load(row + n, mask=n < n1, other=0)
        take = (n < n1) & (_top_bits(s, 2) == prefix)
        if tl.sum(take.to(tl.int32), 0) > 0:
            slot = tl.atomic_add(counter + n * 0, 1, mask=take, sem="relaxed")
            tl.store(out + slot, s, mask=take)


def _chunks_before(counts, c, VOLATILE: tl.constexpr):
    """The (above, equal) counts [chunks, 2] of a token's chunks before chunk c, summed
    (VOLATILE: read past L1, as other programs of this launch wrote them)."""
    above = tl.zeros([128], tl.int32)
    equal = tl.zeros([128], tl.int32)
    for c0 in range(0, c, 128):
        cc = c0 + tl.arange(0, 128)
        m = cc < c
        above += tl.load(counts + cc * 2, mask=m, other=0, volatile=VOLATILE)
        equal += tl.load(counts + cc * 2 + 1, mask=m, other=0, volatile=VOLATILE)
    return tl.sum(above, 0), tl.sum(equal, 0)


def _select_all(out, ties, end, topk, COUNT_TIES: tl.constexpr, BLOCK: tl.constexpr):
    """A context of at most topk: its positions 0 .. end - 1, then -1 to topk, BLOCK a step;
    no tie (COUNT_TIES: *ties = 0). Also the bisect form's."""
    for j in range(0, topk, BLOCK):
        place = j + tl.arange(0, BLOCK)
        tl.store(out + place, tl.where(place < end, place, -1), mask=place < topk)
    if COUNT_TIES:
        tl.store(ties, 0)


def _top_bits(s, LEVELS: tl.constexpr):
    """u's top 8 x LEVELS bits (1 <= LEVELS <= 3) of ord scores s: their bits with the sign
    bit flipped."""
    return ((s >> (32 - 8 * LEVELS)) & ((1 << (8 * LEVELS)) - 1)) ^ (0x80 << (8 * LEVELS - 8))


def _radix_row_kernel(scores_ptr, out_ptr, positions_ptr, seq_lens_ptr, token_to_req_ptr, t0,
                      ties_ptr, num_keys, topk, stride_out, COUNT_TIES: tl.constexpr,
                      GATHER: tl.constexpr, BLOCK: tl.constexpr, BINS: tl.constexpr):
    """Program i: token t0 + i's whole select in one program, BLOCK positions a step: four
    passes of digit histograms summed in registers (no atomics, no workspace), the threshold
    T from each, then one pass writing the selection in position order with running offsets
    (no count pass: the steps run in order). GATHER: the last two levels over the scores of
    the threshold's 16-bit bin, gathered into out[i] first where at most topk, ties_ptr[i]
    (zeroed) their slot counter. COUNT_TIES: ties_ptr[i] = 1 where T's scores outnumber those
    taken (after the gather's count, where both run)."""
    i = tl.program_id(0)
    end = _context_end(positions_ptr, seq_lens_ptr, token_to_req_ptr, t0 + i, num_keys)
    out = out_ptr + i.to(tl.int64) * stride_out
    row = scores_ptr + i.to(tl.int64) * num_keys
    if end <= topk:
        _select_all(out, ties_ptr + i, end, topk, COUNT_TIES, BLOCK)
    else:
        need = topk
        prefix = 0  # u's digits found so far
        at = 0
        src = row  # where the last two levels read: the row, or its gathered scores
        n_src = end
        for level in tl.static_range(4):
            if GATHER and level == 2:
                if at <= topk:  # the threshold's 16-bit bin: at scores, into out
                    _gather_range(row, out, 0, end, prefix, ties_ptr + i, BLOCK)
                    tl.debug_barrier()  # placed by every thread before any reads them
                    src = out
                    n_src = at
            # GATHER: levels 2 and 3 read past L1 (a line of the gathered scores another
            # program on this SM read before they were placed would be stale there)
            hist = _range_hist(src, 0, n_src, prefix, level, BLOCK, BINS,
                               GATHER and level >= 2)
            b, need, at = _digit(hist, need, BINS)
            prefix = (prefix << 8) | b
        if GATHER:
            tl.debug_barrier()  # the gathered scores read before the write replaces them
        _write_range(row, out, 0, end, _ord_of(prefix), need, need * 0, need * 0, BLOCK)
        if COUNT_TIES:
            tl.store(ties_ptr + i, (at > need).to(tl.int32))
