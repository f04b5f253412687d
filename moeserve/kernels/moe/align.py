"""Expert-sorted, block-padded (token, slot) order for the Triton fused-MoE kernel.

Owns `moe_align_block_size` (vectorised torch, no host sync, stable order),
`moe_align_block_size_triton` (three Triton launches instead of ~25 small torch kernels; order
within an expert not stable) and `moe_align_block_size_ref` (a plain loop, for tests). For T tokens
routed to k experts each there are M = T * k pairs; pair p = t * k + i is token t's i-th expert
`topk_ids[t, i]`. The kernel works on tiles of `block_m` sorted rows that all belong to one
expert, so each expert's run of pairs is padded to a multiple of `block_m` with the sentinel M:

    topk_ids [[2, 0], [2, 1]], E = 3, block_m = 2   (pairs 0..3, sentinel 4)
    sorted_token_ids  [1, 4 | 3, 4 | 0, 2 | 4, 4 ...]   expert 0 | expert 1 | expert 2 | unused
    expert_ids        [0,     1,     2,     -1 ...]      one per block; -1: block not used
    num_tokens_post_padded [6]

An id of -1 (expert parallelism: the pair's expert is on another rank) is counted into no
expert: the pair gets no row of sorted_token_ids (so the kernel never computes it) and pads
nothing; only the sentinel marks unused rows, as before.

The output length P is a static bound, so shapes depend only on (T, k, E, block_m), never on the
routing, which is what CUDA-graph capture needs. At most min(E, M) experts get pairs and each
pads by at most block_m - 1, so P = round_up(M + min(E, M) * (block_m - 1), block_m); the tail
past num_tokens_post_padded holds the sentinel, and its blocks have expert id -1 (pairs of id
-1 only make the used part shorter).

The Triton version is three launches (triton imported lazily, on first call); A and C run one
program per 512 pairs, so the pairs spread over the GPU (one program for all of them took
0.05 ms at 2,048 tokens on the H200, 9% of the MoE layer):
    A: counts[e] += 1 per pair of id e >= 0 (atomics into a zeroed scratch); sentinel fill of
       sorted_token_ids, each program its share of the rows
    B (one program): padded, ends = cumsum(padded), starts and ends -> scratch, the total;
       expert_ids (binary search in ends)
    C: sorted_token_ids[starts[e] + atomic_add(cursor[e], 1)] = pair, for ids e >= 0
Pairs of one expert land in arrival order of the atomics, not pair order; the fused-MoE output
does not depend on that order (every row of the GEMMs is computed on its own).

Up to ONE_LAUNCH_MAX_PAIRS pairs (a decode step of up to 64 tokens at top-8), where A and C
are one program each anyway, the three phases run in one program of `_one_kernel` instead
(its scratch zeroed by itself, a CTA barrier between phases): one launch where there were
four (the scratch's fill and A, B, C), each a node of a decode step's CUDA graph per MoE
layer. Not yet timed on a GPU (moe_quant_once --breakdown lists the op's launches).
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

import torch

_ALIGN_CHUNK = 512  # pairs per program of the count and scatter launches
_ALIGN_BLOCKS_CHUNK = 64  # expert_ids entries per step of the offsets program
# pairs up to which the three phases run in one launch (_one_kernel; capped at _ALIGN_CHUNK,
# its program's width); 0 turns it off
ONE_LAUNCH_MAX_PAIRS = _ALIGN_CHUNK
tl: Any = None  # triton.language, bound by _align_kernel() on first use
_add: Any = None  # the jitted combine function of the scans, bound there too
_offsets_phase: Any = None  # phase B, jitted, shared by the offsets and the one-launch kernels


def moe_align_size(num_pairs: int, num_experts: int, block_m: int) -> int:
    """The static length P of `sorted_token_ids` for M = `num_pairs` (a multiple of block_m)."""
    bound = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return -(-bound // block_m) * block_m


def moe_align_block_size(topk_ids: torch.Tensor, num_experts: int,
                         block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort the (token, slot) pairs by expert and pad each expert's run to a multiple of block_m.

    Runs on topk_ids' device without reading any device value on the host (no .item(),
    .tolist(), nonzero or bincount): counts come from scatter_add_, offsets from cumsum.
    Within an expert, pairs keep their original order (stable sort). Pairs of id -1 sort last
    and are written to a spare slot past P (dropped): no row, no count.

    Args:
        topk_ids: [T, k] integer expert ids in [0, num_experts), or -1: not on this rank
            (counted into no expert, given no row).
        num_experts: E.
        block_m: the kernel's BLOCK_M, >= 1.
    Returns:
        sorted_token_ids: [P] int32, pair indices t * k + i, sentinel T * k in padding.
        expert_ids: [P // block_m] int32, the expert of each block, -1 past the used blocks.
        num_tokens_post_padded: [1] int32, the number of used rows (a multiple of block_m).
    """
    _check_align_args(topk_ids, num_experts, block_m)
    device = topk_ids.device
    num_pairs = topk_ids.numel()
    size = moe_align_size(num_pairs, num_experts, block_m)
    flat = topk_ids.reshape(-1).long()  # [M]
    flat = flat.masked_fill(flat < 0, num_experts)  # -1 (not on this rank) -> E: sorts last
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)  # [E + 1]
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    counts = counts[:num_experts]  # [E], the local experts' pairs only
    padded = (counts + block_m - 1) // block_m * block_m  # [E]
    padded_end = torch.cumsum(padded, dim=0)  # [E], end row of each expert's padded segment
    start_delta = (padded_end - padded) - (torch.cumsum(counts, dim=0) - counts)  # [E]

    sorted_experts, order = torch.sort(flat, stable=True)  # [M] each
    local = sorted_experts < num_experts  # [M]; the -1 pairs come after all local ones
    delta = start_delta[sorted_experts.clamp(max=num_experts - 1)]  # [M]
    # -1 pairs go to a spare slot past the P rows, sliced off below
    dest = torch.where(local, torch.arange(num_pairs, device=device) + delta, size)  # [M]
    sorted_token_ids = torch.full((size + 1,), num_pairs, dtype=torch.int32, device=device)
    sorted_token_ids[dest] = order.to(torch.int32)
    sorted_token_ids = sorted_token_ids[:size]  # [P]

    block_starts = torch.arange(0, size, block_m, device=device)  # [P // block_m]
    expert_ids = torch.searchsorted(padded_end, block_starts, right=True)  # [P // block_m]
    expert_ids = torch.where(expert_ids < num_experts, expert_ids, -1).to(torch.int32)
    num_tokens_post_padded = padded_end[-1:].to(torch.int32)  # [1]
    return sorted_token_ids, expert_ids, num_tokens_post_padded


def moe_align_block_size_triton(topk_ids: torch.Tensor, num_experts: int,
                                block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`moe_align_block_size` in three Triton launches (plus one fill of their scratch); no
    host sync.

    Same outputs (ids -1 counted into no expert), except that the pairs of one expert may come
    in any order within its segment.
    topk_ids must be on a device Triton runs on (CUDA, or CPU under TRITON_INTERPRET=1).
    """
    _check_align_args(topk_ids, num_experts, block_m)
    device = topk_ids.device
    num_pairs = topk_ids.numel()
    size = moe_align_size(num_pairs, num_experts, block_m)
    sorted_token_ids = torch.empty(size, dtype=torch.int32, device=device)
    expert_ids = torch.empty(size // block_m, dtype=torch.int32, device=device)
    if num_pairs == 0:
        return sorted_token_ids, expert_ids, torch.zeros(1, dtype=torch.int32, device=device)
    # B writes the total: no fill launch for it (one of a decode step's per-layer launches)
    num_tokens_post_padded = torch.empty(1, dtype=torch.int32, device=device)
    log2_experts = (num_experts - 1).bit_length()
    e_pow2 = 1 << log2_experts
    kern = _align_kernels()
    # A, B and C in one program (module docstring), never past its width
    if num_pairs <= min(ONE_LAUNCH_MAX_PAIRS, _ALIGN_CHUNK):
        scratch = torch.empty(4, e_pow2, dtype=torch.int32, device=device)
        kern.one[(1,)](topk_ids.reshape(-1), scratch, sorted_token_ids, expert_ids,
                       num_tokens_post_padded, num_pairs, num_experts, size, e_pow2,
                       BLOCK_M=block_m, E_POW2=e_pow2, LOG2_E=log2_experts,
                       CHUNK=_ALIGN_CHUNK, FILL_CHUNK=_ALIGN_CHUNK,
                       BLOCKS_CHUNK=_ALIGN_BLOCKS_CHUNK, num_warps=4)
        return sorted_token_ids, expert_ids, num_tokens_post_padded
    # rows: counts, cursors, segment starts, segment ends (the kernels zero nothing themselves)
    scratch = torch.zeros(4, e_pow2, dtype=torch.int32, device=device)
    counts, cursors, starts, ends = scratch.unbind(0)
    ids = topk_ids.reshape(-1)
    programs = -(-num_pairs // _ALIGN_CHUNK)
    fill = -(-size // programs)
    kern.count[(programs,)](ids, counts, sorted_token_ids, num_pairs, size, fill,
                            CHUNK=_ALIGN_CHUNK, num_warps=4)
    kern.offsets[(1,)](counts, starts, ends, expert_ids, num_tokens_post_padded, num_experts,
                       size, BLOCK_M=block_m, E_POW2=e_pow2, LOG2_E=log2_experts,
                       BLOCKS_CHUNK=_ALIGN_BLOCKS_CHUNK, num_warps=4)
    kern.scatter[(programs,)](ids, starts, cursors, sorted_token_ids, num_pairs,
                              CHUNK=_ALIGN_CHUNK, num_warps=4)
    return sorted_token_ids, expert_ids, num_tokens_post_padded


def moe_align_block_size_ref(topk_ids: torch.Tensor, num_experts: int,
                             block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The same outputs as `moe_align_block_size`, by a loop over experts on the host (a pair
    of id -1 matches none of them: no row, no count)."""
    _check_align_args(topk_ids, num_experts, block_m)
    flat = topk_ids.reshape(-1).tolist()
    num_pairs = len(flat)
    rows: list[int] = []
    blocks: list[int] = []
    for e in range(num_experts):
        pairs = [p for p, expert in enumerate(flat) if expert == e]
        num_blocks = -(-len(pairs) // block_m)
        rows += pairs + [num_pairs] * (num_blocks * block_m - len(pairs))
        blocks += [e] * num_blocks
    size = moe_align_size(num_pairs, num_experts, block_m)
    used = len(rows)
    rows += [num_pairs] * (size - used)
    blocks += [-1] * (size // block_m - len(blocks))

    def as_tensor(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=topk_ids.device)

    return as_tensor(rows), as_tensor(blocks), as_tensor([used])


def _check_align_args(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> None:
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be [T, k], got shape {tuple(topk_ids.shape)}")
    if topk_ids.dtype.is_floating_point or topk_ids.dtype == torch.bool:
        raise TypeError(f"topk_ids must be an integer tensor, got {topk_ids.dtype}")
    if num_experts < 1 or block_m < 1:
        raise ValueError(f"num_experts ({num_experts}) and block_m ({block_m}) must be >= 1")


@functools.cache
def _align_kernels() -> Any:
    """Build the align kernels (the three phases, and the three in one) on first use (see the
    module docstring for their phases).

    Only triton.language builtins are called (no tl.sum/tl.cumsum, which are @jit helpers bound
    when triton is imported): so they also run when TRITON_INTERPRET=1 was set after that
    import. What the kernels name (tl, _add) is bound as a module global: Triton's interpreter
    resolves names in the function's module, not in its closure. Step-varying sizes are exempt
    from value specialization (see moe_triton.py).
    """
    global tl, _add, _offsets_phase
    import triton
    import triton.language as tl

    @triton.jit
    def _add(a, b):
        return a + b

    @triton.jit(do_not_specialize=["num_pairs", "size", "fill_per_program"])
    def _count_kernel(ids_ptr, counts_ptr, sorted_ids_ptr, num_pairs, size, fill_per_program,
                      CHUNK: tl.constexpr):
        # A: counts[e] += 1 for this program's CHUNK pairs; sentinel-fill its share of rows
        pid = tl.program_id(0)
        lanes = tl.arange(0, CHUNK)
        offs = pid * CHUNK + lanes
        ok = offs < num_pairs
        ids = tl.load(ids_ptr + offs, mask=ok, other=-1)
        tl.atomic_add(counts_ptr + ids, 1, mask=ids >= 0, sem="relaxed")  # -1: not on this rank
        sentinel = tl.full((CHUNK,), 0, tl.int32) + num_pairs
        first = pid * fill_per_program
        for c in range(0, fill_per_program, CHUNK):
            rows = first + c + lanes
            tl.store(sorted_ids_ptr + rows, sentinel,
                     mask=(rows < size) & (c + lanes < fill_per_program))

    @triton.jit
    def _offsets_phase(counts, start_ptr, ends_ptr, expert_ids_ptr, post_ptr, size,
                       BLOCK_M: tl.constexpr, E_POW2: tl.constexpr, LOG2_E: tl.constexpr,
                       BLOCKS_CHUNK: tl.constexpr):
        # B, from the experts' counts [E_POW2]: segment starts and ends, the total, the
        # expert of every block (ends read back from L2, .cg: never a stale L1 line)
        experts = tl.arange(0, E_POW2)
        padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        ends = tl.associative_scan(padded, 0, _add)  # inclusive cumsum
        tl.store(start_ptr + experts, ends - padded)
        tl.store(ends_ptr + experts, ends)
        total = tl.reduce(padded, 0, _add)
        tl.store(post_ptr, total)
        tl.debug_barrier()
        blocks = tl.arange(0, BLOCKS_CHUNK)
        num_blocks = size // BLOCK_M
        for b in range(0, num_blocks, BLOCKS_CHUNK):
            rows = (b + blocks) * BLOCK_M
            owner = tl.full((BLOCKS_CHUNK,), 0, tl.int32)  # binary search: #experts ending <= row
            for i in tl.static_range(LOG2_E + 1):  # steps E_POW2, E_POW2 / 2, ..., 1
                probe = owner + (E_POW2 >> i)
                end = tl.load(ends_ptr + probe - 1, mask=probe <= E_POW2, other=size + 1,
                              cache_modifier=".cg")
                owner = tl.where(end <= rows, probe, owner)
            tl.store(expert_ids_ptr + b + blocks, tl.where(rows < total, owner, -1),
                     mask=b + blocks < num_blocks)

    @triton.jit(do_not_specialize=["size"])
    def _offsets_kernel(counts_ptr, start_ptr, ends_ptr, expert_ids_ptr, post_ptr, num_experts,
                        size, BLOCK_M: tl.constexpr, E_POW2: tl.constexpr,
                        LOG2_E: tl.constexpr, BLOCKS_CHUNK: tl.constexpr):
        # B (one program)
        experts = tl.arange(0, E_POW2)
        counts = tl.load(counts_ptr + experts, mask=experts < num_experts, other=0)
        _offsets_phase(counts, start_ptr, ends_ptr, expert_ids_ptr, post_ptr, size, BLOCK_M,
                       E_POW2, LOG2_E, BLOCKS_CHUNK)

    @triton.jit(do_not_specialize=["num_pairs"])
    def _scatter_kernel(ids_ptr, start_ptr, cursor_ptr, sorted_ids_ptr, num_pairs,
                        CHUNK: tl.constexpr):
        # C: each of this program's pairs into its expert's segment
        offs = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
        ok = offs < num_pairs
        ids = tl.load(ids_ptr + offs, mask=ok, other=-1)
        ok = ids >= 0  # -1: not on this rank, no row
        start = tl.load(start_ptr + ids, mask=ok, other=0)
        rank = tl.atomic_add(cursor_ptr + ids, 1, mask=ok, sem="relaxed")
        tl.store(sorted_ids_ptr + start + rank, offs, mask=ok)

    @triton.jit(do_not_specialize=["num_pairs", "size"])
    def _one_kernel(ids_ptr, scratch_ptr, sorted_ids_ptr, expert_ids_ptr, post_ptr, num_pairs,
                    num_experts, size, stride_scratch, BLOCK_M: tl.constexpr,
                    E_POW2: tl.constexpr, LOG2_E: tl.constexpr, CHUNK: tl.constexpr,
                    FILL_CHUNK: tl.constexpr, BLOCKS_CHUNK: tl.constexpr):
        # A, B and C in one program, a barrier between phases (num_pairs <= CHUNK); scratch
        # rows: counts, cursors, segment starts, segment ends (the first two zeroed here: no
        # fill launch)
        counts_ptr = scratch_ptr
        cursor_ptr = scratch_ptr + stride_scratch
        start_ptr = scratch_ptr + 2 * stride_scratch
        ends_ptr = scratch_ptr + 3 * stride_scratch
        experts = tl.arange(0, E_POW2)
        tl.store(counts_ptr + experts, tl.full((E_POW2,), 0, tl.int32))
        tl.store(cursor_ptr + experts, tl.full((E_POW2,), 0, tl.int32))
        fill = tl.arange(0, FILL_CHUNK)
        sentinel = tl.full((FILL_CHUNK,), 0, tl.int32) + num_pairs
        for c in range(0, size, FILL_CHUNK):
            tl.store(sorted_ids_ptr + c + fill, sentinel, mask=c + fill < size)
        tl.debug_barrier()
        offs = tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1)
        ok = ids >= 0  # -1: not on this rank
        tl.atomic_add(counts_ptr + ids, 1, mask=ok, sem="relaxed")
        tl.debug_barrier()
        # B: the atomics' counts read back from L2 (.cg: never a stale L1 line)
        counts = tl.load(counts_ptr + experts, mask=experts < num_experts, other=0,
                         cache_modifier=".cg")
        _offsets_phase(counts, start_ptr, ends_ptr, expert_ids_ptr, post_ptr, size, BLOCK_M,
                       E_POW2, LOG2_E, BLOCKS_CHUNK)
        tl.debug_barrier()
        # C
        start = tl.load(start_ptr + ids, mask=ok, other=0, cache_modifier=".cg")
        rank = tl.atomic_add(cursor_ptr + ids, 1, mask=ok, sem="relaxed")
        tl.store(sorted_ids_ptr + start + rank, offs, mask=ok)

    return SimpleNamespace(count=_count_kernel, offsets=_offsets_kernel, scatter=_scatter_kernel,
                           one=_one_kernel)
