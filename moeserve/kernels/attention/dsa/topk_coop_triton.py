"""DSA's radix top-k in one launch for few tokens: `radix_topk_coop`, topk_triton.radix_topk's
contract (its "coop" form), the chunks form's passes with the programs of a token meeting at
barriers in global memory instead of at launch boundaries.

Why: at 32 tokens of 8k positions the chunks form's six launches (four histogram levels, the
count, the write) take ~7 us each whatever their work, 0.041 ms of the DSA decode step's 0.13
(benchmarks/results/gpu_b8a5462/call2: a quarter of the positions a program was no faster).
Here one launch over (token, chunk) programs does all six passes:

    program (i, c): positions [c x chunk, (c + 1) x chunk) of token i, BLOCK a step
      level 0..3:  the digit histogram of its positions (level 0: u's top byte; then the next
                   byte among the scores whose higher bytes are the threshold's so far), added
                   into token i's hist[level] by atomics; barrier; every program reads the
                   whole histogram and finds the level's bin (topk_triton._digit)
      count:       its scores above T and equal to T -> counts[c]; barrier
      write:       its selected positions at (selected in chunks < c) + (before it in c)

A barrier is an arrival counter a token (atomic add, then a spin until the count reaches the
token's programs x passes so far); every thread's atomics are done (a CTA barrier) before its
program arrives, and the reads after it bypass L1 (volatile). A program waits on others only of
its own token, so the launch is safe while all its programs are resident at once: at most as
many as the SMs hold of it (`resident_per_sm`, from the compiled kernel's registers and shared
memory: three an SM on sm90, capped at MAX_PROGRAMS_PER_SM; `programs`), one a token where the
tokens alone fill those places, refused past them; on CPU, where Triton's interpreter runs
programs one after another, always one a token (a program then waits on itself only, so the
tests run every pass and barrier of it). A program waiting for a place (another kernel's still
running) only delays its token: the others' waits end once it runs.

Off by default (radix_topk's "auto" takes it up to topk_triton.COOP_MAX_TOKENS tokens, 0)
until the GPU times it: kernels_dsa's topk_coop_graph_ms and dsa_graph_coop_ms.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

import torch

from moeserve.kernels.attention.dsa import topk_triton
from moeserve.kernels.attention.metadata import AttentionMetadata
from moeserve.kernels.triton_common import num_sms

BLOCK = 2048  # positions a step
NUM_WARPS = 8
# programs an SM at most, where more would fit (sm90 offline: 80 registers, 1 KB of shared
# memory: three of 8 warps fit the register file)
MAX_PROGRAMS_PER_SM = 4

tl: Any = None  # triton.language, bound by _kernels() (the kernel reads it as a global)
# topk_triton's jitted helpers, bound by _kernels()
_context_end: Any = None
_digit: Any = None
_ord_of: Any = None
_range_hist: Any = None
_write_range: Any = None
_chunks_before: Any = None
_gather_range: Any = None


def programs(n: int, num_keys: int, block: int, device: torch.device, per_sm: int = 1) -> int:
    """Programs a token for n tokens of num_keys scores: as many as the GPU holds at once
    (`per_sm` an SM, `resident_per_sm`), so all are resident together, none with less than a
    step of positions; 1 on CPU. ValueError where the tokens alone outnumber those places."""
    if device.type != "cuda":
        return 1
    places = num_sms(device) * per_sm
    if n > places:
        raise ValueError(f"radix_topk coop: {n} tokens, at most {places} ({per_sm} a streaming "
                         "multiprocessor): its programs must all be resident at once")
    return max(1, min(-(-num_keys // block), places // n))


def resident_per_sm(n_regs: int, shared: int, props: Any) -> int:
    """How many programs of a compiled kernel (n_regs registers a thread, `shared` bytes) an
    SM of these device properties holds at once, at most MAX_PROGRAMS_PER_SM: registers by
    warps in units of 256, 1 KB of shared memory reserved a program (sm90); at least 1."""
    threads = NUM_WARPS * 32
    per_warp = -(-n_regs * 32 // 256) * 256
    by_regs = getattr(props, "regs_per_multiprocessor", 65536) // (per_warp * NUM_WARPS)
    by_threads = getattr(props, "max_threads_per_multi_processor", 2048) // threads
    by_shared = getattr(props, "shared_memory_per_multiprocessor", 233472) // (shared + 1024)
    return max(1, min(by_regs, by_threads, by_shared, MAX_PROGRAMS_PER_SM))


_resident: dict[tuple, int] = {}  # (device, the kernel's constexprs) -> resident_per_sm


def radix_topk_coop(scores: torch.Tensor, meta: AttentionMetadata, t0: int, topk: int,
                    out: torch.Tensor, chunk: int | None = None,
                    count_boundary_ties: bool = False) -> int:
    """topk_triton.radix_topk's contract in one launch (the module docstring). chunk: positions
    a step (default BLOCK; tests: small, so a program's share spans several steps). Returns
    the boundary ties' count (a host sync) with count_boundary_ties, else 0."""
    n, num_keys = scores.shape
    block = chunk or BLOCK
    if block < 16 or block & (block - 1):
        raise ValueError(f"radix_topk coop: chunk must be a power of two >= 16, got {block}")
    levels, bins = topk_triton._LEVELS, topk_triton._BINS
    consts = dict(COUNT_TIES=count_boundary_ties, GATHER=topk_triton.GATHER, LEVELS=levels,
                  BLOCK=block, BINS=bins, num_warps=NUM_WARPS)

    def args(num_chunks: int, share: int, work: torch.Tensor) -> tuple:
        return (scores, work, out, meta.positions, meta.seq_lens, meta.token_to_req, t0,
                num_keys, topk, num_chunks, share, work.stride(0), out.stride(0))
    per_sm = 1
    if scores.is_cuda:  # from the compiled kernel (shares and counts are not specialised)
        key = (scores.device.index, block, count_boundary_ties, topk_triton.GATHER)
        if key not in _resident:
            compiled = _kernels().coop.warmup(*args(1, block, scores.new_zeros(1, 1)),
                                              grid=(1,), **consts)
            compiled = compiled.result() if hasattr(compiled, "result") else compiled
            compiled.run  # noqa: B018 (loads the binary: its n_regs)
            _resident[key] = resident_per_sm(compiled.n_regs, compiled.metadata.shared,
                                             torch.cuda.get_device_properties(scores.device))
        per_sm = _resident[key]
    per_token = programs(n, num_keys, block, scores.device, per_sm)
    share = -(-max(1, num_keys) // per_token)
    share = -(-share // block) * block  # whole steps a program
    num_chunks = -(-max(1, num_keys) // share)
    # a token's workspace: hist [LEVELS, BINS], its chunks' (above, equal) counts, the
    # arrival counter, the boundary-tie flag, GATHER's slot counter; zeroed (one memset)
    arrivals = levels * bins + 2 * num_chunks
    work = torch.zeros(n, arrivals + 3, dtype=torch.int32, device=scores.device)
    _kernels().coop[(n, num_chunks)](*args(num_chunks, share, work), **consts)
    return int(work[:, arrivals + 1].sum()) if count_boundary_ties else 0


@functools.cache
def _kernels() -> SimpleNamespace:
    """Import triton and jit the kernel once, with topk_triton's helpers it calls by global
    name (step-varying ints unspecialised, as there)."""
    global tl, _context_end, _barrier, _digit, _ord_of, _range_hist, _write_range
    global _chunks_before, _gather_range
    import triton
    import triton.language

    topk_triton._kernels()
    tl = triton.language
    _context_end, _digit, _ord_of = (topk_triton._context_end, topk_triton._digit,
                                     topk_triton._ord_of)
    _range_hist, _write_range = topk_triton._range_hist, topk_triton._write_range
    _chunks_before, _gather_range = topk_triton._chunks_before, topk_triton._gather_range
    _barrier = triton.jit(_barrier)
    varying = ["t0", "num_keys", "topk", "num_chunks", "share", "stride_work", "stride_out"]
    return SimpleNamespace(coop=triton.jit(_radix_coop_kernel, do_not_specialize=varying))


# ---- Triton functions (jitted by _kernels; module globals, as the interpreter resolves
# names) ----

def _barrier(counter_ptr, target):
    """This program arrives at its token's counter, then waits until `target` programs have
    (counts only grow: a later barrier's target is the token's programs x passes so far)."""
    tl.debug_barrier()  # every thread's atomics before the arrival
    tl.atomic_add(counter_ptr, 1)
    while tl.atomic_add(counter_ptr, 0) < target:
        pass
    tl.debug_barrier()


def _radix_coop_kernel(scores_ptr, work_ptr, out_ptr, positions_ptr, seq_lens_ptr,
                       token_to_req_ptr, t0, num_keys, topk, num_chunks, share, stride_work,
                       stride_out, COUNT_TIES: tl.constexpr, GATHER: tl.constexpr,
                       LEVELS: tl.constexpr, BLOCK: tl.constexpr, BINS: tl.constexpr):
    """Program (i, c): token t0 + i's positions [c x share, (c + 1) x share) through every
    pass of the select (the module docstring), BLOCK a step. GATHER (topk_triton's): after
    level 1, where the threshold's 16-bit bin holds at most topk scores, each program places
    its range's into out (slots from a counter), one barrier, then every program sums levels
    2 and 3 over all of them itself (the count's barrier keeps the write from replacing them
    before every program has read them)."""
    i = tl.program_id(0)
    c = tl.program_id(1)
    n0 = c * share
    end = _context_end(positions_ptr, seq_lens_ptr, token_to_req_ptr, t0 + i, num_keys)
    n1 = tl.minimum(n0 + share, end)  # past the context: an empty range, still at barriers
    out = out_ptr + i.to(tl.int64) * stride_out
    row = scores_ptr + i.to(tl.int64) * num_keys
    if end <= topk:  # the whole context at its places (chunk 0: -1 after it)
        if c == 0:
            for j in range(tl.maximum(end, 0), topk, BLOCK):
                place = j + tl.arange(0, BLOCK)
                tl.store(out + place, tl.full([BLOCK], -1, tl.int32), mask=place < topk)
        for b0 in range(n0, n1, BLOCK):
            n = b0 + tl.arange(0, BLOCK)
            tl.store(out + n, n, mask=n < n1)
    else:
        work = work_ptr + i.to(tl.int64) * stride_work
        counts = work + LEVELS * BINS
        arrivals = counts + 2 * num_chunks
        bins = tl.arange(0, BINS)
        need = topk
        prefix = 0  # u's digits found so far
        at = 0
        gathered = end * 0  # 1: the last two levels from the scores gathered into out
        gathered_count = end * 0
        for level in tl.static_range(LEVELS):
            if GATHER and level == 2:
                if at <= topk:  # the same for all the token's programs (its histograms')
                    _gather_range(row, out, n0, n1, prefix, arrivals + 2, BLOCK)
                    _barrier(arrivals, num_chunks * 3)
                    gathered = end * 0 + 1
                    gathered_count = at
            if gathered == 1:  # every program the whole histogram of the few: no barrier
                hist = _range_hist(out, 0, gathered_count, prefix, level, BLOCK, BINS, True)
            else:
                hist = _range_hist(row, n0, n1, prefix, level, BLOCK, BINS, False)
                tl.atomic_add(work + level * BINS + bins, hist, mask=hist > 0)
                _barrier(arrivals, num_chunks * (level + 1))
                hist = tl.load(work + level * BINS + bins, volatile=True)  # the token's
            b, need, at = _digit(hist, need, BINS)
            prefix = (prefix << 8) | b
        thr = _ord_of(prefix)
        above = 0
        equal = 0
        for b0 in range(n0, n1, BLOCK):
            n = b0 + tl.arange(0, BLOCK)
            ok = n < n1
            s = tl.load(row + n, mask=ok, other=0)
            above += tl.sum((ok & (s > thr)).to(tl.int32), 0)
            equal += tl.sum((ok & (s == thr)).to(tl.int32), 0)
        tl.atomic_xchg(counts + 2 * c, above)
        tl.atomic_xchg(counts + 2 * c + 1, equal)
        _barrier(arrivals, num_chunks * (LEVELS + 1 - gathered))  # its barriers so far + 1
        if COUNT_TIES:
            if c == 0:
                tl.store(arrivals + 1, (at > need).to(tl.int32))
        above_before, ties = _chunks_before(counts, c, True)
        _write_range(row, out, n0, n1, thr, need, above_before + tl.minimum(ties, need), ties,
                     BLOCK)
