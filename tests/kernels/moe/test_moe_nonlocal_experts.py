"""Expert parallelism (issue 19): every MoE backend takes topk_ids of -1, "this pair's expert is
on another rank", as a pair that adds exactly zero and that no expert computes.

A rank holding experts [2, 6) of E = 8 is simulated: routing over all 8 experts, ids outside the
rank mapped to -1 and local ones to id - 2, w13/w2 sliced to the rank's experts. Its output must
equal the reference over all 8 experts with the weights of the non-local pairs set to zero. On
CPU the Triton kernels run through the interpreter (tests/conftest.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch

from moeserve.kernels.moe import fused_triton
from moeserve.kernels.moe import measured as moe_measured
from moeserve.kernels.moe.align import (
    moe_align_block_size,
    moe_align_block_size_ref,
    moe_align_block_size_triton,
    moe_align_size,
)
from moeserve.kernels.moe.fused_triton import moe_triton
from moeserve.kernels.moe.grouped_mm import moe_grouped_mm
from moeserve.kernels.moe.ref import moe_dense_ref, moe_loop_ref
from moeserve.kernels.routing.select import select_experts
from tests.cuda_graph import capture

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NUM_EXPERTS, FIRST, LAST = 8, 2, 6  # the rank holds experts [FIRST, LAST) of NUM_EXPERTS
SMALL = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=2, num_warps=4, num_stages=2)
SHAPES = [(1, 32, 16), (7, 32, 16), (19, 40, 24), (33, 64, 48)]  # (T, H, I)


def measured_as(backend: str, config: dict | None = None) -> Callable:
    """moe_measured with its pick forced to `backend` (and Triton tiles `config`)."""

    def run(*args: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(moe_measured, "_PLANS", {})
            mp.setattr(moe_measured, "pick", lambda key, n: (backend, config or SMALL))
            return moe_measured.moe_measured(*args, reduce=reduce)

    return run


BACKENDS: dict[str, Callable] = {
    "torch": moe_loop_ref,
    "grouped_mm": moe_grouped_mm,
    "triton": moe_triton,  # default tiles
    "triton-small": functools.partial(moe_triton, config=SMALL),
    "triton-atomic": functools.partial(moe_triton, config=SMALL, combine="atomic"),
    "triton-torch-align": functools.partial(moe_triton, config=SMALL, align="torch"),
    "triton-persistent": functools.partial(moe_triton, config={**SMALL, "PERSISTENT": 2}),
    "triton-sub-m": functools.partial(moe_triton,
                                      config={**SMALL, "BLOCK_M": 64, "SUB_M": 1, "GROUP_M": 1}),
    "measured-triton": measured_as("triton"),
    "measured-grouped_mm": measured_as("grouped_mm"),
}


def make_case(num_tokens: int, hidden: int, inter: int, top_k: int,
              seed: int = 0) -> tuple[torch.Tensor, ...]:
    """x, w13, w2 over all experts, routing weights and ids over all experts; token 0 (when
    T > 1) routed to non-local experts only."""
    gen = torch.Generator().manual_seed(seed * 1000 + num_tokens * 10 + top_k)
    w13 = torch.randn(NUM_EXPERTS, 2 * inter, hidden, generator=gen) * hidden ** -0.5
    w2 = torch.randn(NUM_EXPERTS, hidden, inter, generator=gen) * inter ** -0.5
    x = torch.randn(num_tokens, hidden, generator=gen)
    logits = torch.randn(num_tokens, NUM_EXPERTS, generator=gen)
    if num_tokens > 1:
        nonlocal_experts = [e for e in range(NUM_EXPERTS) if not FIRST <= e < LAST]
        logits[0, nonlocal_experts] += 10.0  # top_k <= 4 = the non-local experts
    weights, ids = select_experts(logits, top_k, renormalize=True)
    return tuple(t.to(DEVICE) for t in (x, w13, w2, weights, ids))


def on_rank(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(local mask, the rank's ids: id - FIRST for its experts, -1 for the others)."""
    local = (ids >= FIRST) & (ids < LAST)
    return local, torch.where(local, ids - FIRST, -1)


@pytest.mark.parametrize("reduce", [True, False])
@pytest.mark.parametrize("top_k", [2, 4])
@pytest.mark.parametrize(("num_tokens", "hidden", "inter"), SHAPES)
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_nonlocal_pairs_add_nothing(backend: str, num_tokens: int, hidden: int, inter: int,
                                    top_k: int, reduce: bool) -> None:
    x, w13, w2, weights, ids = make_case(num_tokens, hidden, inter, top_k)
    local, rank_ids = on_rank(ids)
    assert num_tokens == 1 or ((~local).any() and local.any())
    expected = moe_loop_ref(x, w13, w2, torch.where(local, weights, 0.0), ids)
    out = BACKENDS[backend](x, w13[FIRST:LAST], w2[FIRST:LAST], weights, rank_ids,
                            reduce=reduce)
    if not reduce:
        assert out.dim() == 3 and out.shape[1] in (1, top_k)
        if out.shape[1] == top_k:  # one row per pair: a non-local pair's row is exactly 0
            assert torch.equal(out[~local], torch.zeros_like(out[~local]))
        out = out.sum(dim=1)
    assert out.shape == x.shape and out.dtype == x.dtype
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    if num_tokens > 1:  # token 0 has no local pair: exactly 0; the others' experts ran
        assert not local[0].any() and torch.equal(out[0], torch.zeros_like(out[0]))
    has_local = local.any(dim=1)
    assert (out[has_local].abs().amax(dim=1) > 0).all()


@pytest.mark.parametrize("top_k", [1, 2, 4])
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_one_token_with_no_local_pair_is_zero(backend: str, top_k: int) -> None:
    """T = 1 and every pair -1: no expert has a row, the output row (and every part) is 0."""
    x, w13, w2, weights, _ = make_case(1, 32, 16, top_k)
    rank_ids = torch.full((1, top_k), -1, dtype=torch.int64, device=DEVICE)
    fn = BACKENDS[backend]
    out = fn(x, w13[FIRST:LAST], w2[FIRST:LAST], weights, rank_ids)
    assert torch.equal(out, torch.zeros_like(x))
    parts = fn(x, w13[FIRST:LAST], w2[FIRST:LAST], weights, rank_ids, reduce=False)
    assert torch.equal(parts, torch.zeros_like(parts))


def test_int32_ids_and_a_rank_of_one_expert() -> None:
    """int32 ids, and a rank holding one expert (E_local = 1): the same contract."""
    x, w13, w2, weights, ids = make_case(21, 32, 16, 2)
    local = ids == 3
    rank_ids = torch.where(local, 0, -1).int()
    expected = moe_loop_ref(x, w13, w2, torch.where(local, weights, 0.0), ids)
    for name, fn in BACKENDS.items():
        out = fn(x, w13[3:4], w2[3:4], weights, rank_ids)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5, msg=name)


def test_dense_ref_skips_nonlocal_pairs() -> None:
    x, w13, w2, weights, ids = make_case(9, 32, 16, 4)
    local, rank_ids = on_rank(ids)
    expected = moe_loop_ref(x, w13, w2, torch.where(local, weights, 0.0), ids)
    out = moe_dense_ref(x, w13[FIRST:LAST], w2[FIRST:LAST], weights, rank_ids)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- garbage cannot leak

def test_grouped_mm_rows_past_the_last_group_cannot_leak(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch._grouped_mm leaves the rows past offs[-1] undefined: made NaN here, the -1 pairs'
    rows there still come out exactly 0 (masked, not multiplied by a zero weight)."""
    real = torch._grouped_mm
    seen: list[int] = []

    def nan_tail(a: torch.Tensor, b: torch.Tensor, *, offs: torch.Tensor) -> torch.Tensor:
        out = real(a, b, offs=offs)
        end = int(offs[-1])  # host read: fine in a test
        seen.append(out.shape[0] - end)
        out[end:] = float("nan")
        return out

    monkeypatch.setattr(torch, "_grouped_mm", nan_tail)
    x, w13, w2, weights, ids = make_case(13, 32, 16, 4)
    local, rank_ids = on_rank(ids)
    expected = moe_loop_ref(x, w13, w2, torch.where(local, weights, 0.0), ids)
    parts = moe_grouped_mm(x, w13[FIRST:LAST], w2[FIRST:LAST], weights, rank_ids, reduce=False)
    assert seen == [int((~local).sum())] * 2  # both GEMMs stop at the last local row
    assert torch.equal(parts[~local], torch.zeros_like(parts[~local]))
    torch.testing.assert_close(parts.sum(1), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("top_k", [1, 4])
def test_triton_rows_it_never_computes_cannot_leak(top_k: int,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The act rows of -1 pairs are never written nor read, and their out rows are zeroed by
    `_zero_rows_kernel`: with both buffers NaN before the launches the result is exact."""
    real_launch, real_zero = fused_triton._launch, fused_triton._zero_nonlocal_rows

    def launch(a: torch.Tensor, w: torch.Tensor, c: torch.Tensor, *args, **kwargs) -> None:
        if kwargs["gated"]:
            c.fill_(float("nan"))  # act [M, I]
        real_launch(a, w, c, *args, **kwargs)

    def zero(out: torch.Tensor, topk_ids: torch.Tensor) -> None:
        out.fill_(float("nan"))  # out [M, H], before the down launch writes the local rows
        real_zero(out, topk_ids)

    monkeypatch.setattr(fused_triton, "_launch", launch)
    monkeypatch.setattr(fused_triton, "_zero_nonlocal_rows", zero)
    x, w13, w2, weights, ids = make_case(13, 32, 16, top_k)
    local, rank_ids = on_rank(ids)
    expected = moe_loop_ref(x, w13, w2, torch.where(local, weights, 0.0), ids)
    parts = moe_triton(x, w13[FIRST:LAST], w2[FIRST:LAST], weights, rank_ids, config=SMALL,
                       reduce=False)
    assert torch.equal(parts[~local], torch.zeros_like(parts[~local]))
    torch.testing.assert_close(parts.sum(1), expected, atol=1e-5, rtol=1e-5)
    out = moe_triton(x, w13[FIRST:LAST], w2[FIRST:LAST], weights, rank_ids, config=SMALL)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_zero_rows_kernel_touches_only_the_nonlocal_rows() -> None:
    """Rows of ids >= 0 keep their bits; rows of -1 become 0 over all H (a tail past the
    kernel's column tile and several row tiles); without -1 ids nothing changes."""
    num_pairs, hidden = 3 * fused_triton._ZERO_ROWS + 5, fused_triton._ZERO_COLS + 24
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(-1, 4, (num_pairs, 1), generator=gen).to(DEVICE)
    before = torch.randn(num_pairs, hidden, generator=gen).to(DEVICE)
    out = before.clone()
    fused_triton._zero_nonlocal_rows(out, ids)
    off = ids[:, 0] < 0
    assert off.any() and (~off).any()
    assert torch.equal(out[~off], before[~off]) and torch.equal(out[off], torch.zeros_like(
        out[off]))
    out = before.clone()
    fused_triton._zero_nonlocal_rows(out, ids.clamp(min=0))
    assert torch.equal(out, before)


# ---------------------------------------------------------------- alignment

ALIGNS = {"ref": moe_align_block_size_ref, "torch": moe_align_block_size,
          "triton": moe_align_block_size_triton}


@pytest.mark.parametrize("block_m", [1, 4, 16])
@pytest.mark.parametrize(("num_tokens", "top_k"), [(1, 2), (7, 2), (33, 4)])
@pytest.mark.parametrize("align", list(ALIGNS))
def test_align_counts_no_nonlocal_pair(align: str, num_tokens: int, top_k: int,
                                       block_m: int) -> None:
    """The Triton path's align (each of the three) gives -1 pairs no row and no count: the
    rows are exactly the local pairs, the used length is the local pairs' padded counts, and
    the result equals the reference's (up to order within an expert for the Triton one)."""
    *_, ids = make_case(num_tokens, 32, 16, top_k)
    local, rank_ids = on_rank(ids)
    num_local, num_pairs = LAST - FIRST, ids.numel()
    sorted_ids, expert_ids, post = (t.cpu() for t in ALIGNS[align](rank_ids, num_local,
                                                                    block_m))
    local, rank_ids = local.cpu().flatten(), rank_ids.cpu().flatten()

    size = moe_align_size(num_pairs, num_local, block_m)
    assert sorted_ids.shape == (size,) and expert_ids.shape == (size // block_m,)
    counts = torch.bincount(rank_ids[local], minlength=num_local)  # local pairs per expert
    used = int((-(-counts // block_m) * block_m).sum())
    assert post.tolist() == [used]
    real = sorted_ids[sorted_ids < num_pairs]
    assert sorted(real.tolist()) == local.nonzero().flatten().tolist()  # no -1 pair, each once
    assert int((sorted_ids == num_pairs).sum()) == size - int(local.sum())
    for b, e in enumerate(expert_ids.tolist()):
        rows = sorted_ids[b * block_m:(b + 1) * block_m]
        pairs = rows[rows < num_pairs].long()
        assert (e >= 0) == (b * block_m < used)
        assert (rank_ids[pairs] == e).all() and (e < 0 or pairs.numel() > 0)

    ref_ids, ref_experts, ref_post = moe_align_block_size_ref(rank_ids.view(ids.shape),
                                                              num_local, block_m)
    assert torch.equal(expert_ids, ref_experts) and torch.equal(post, ref_post)
    if align != "triton":  # stable: the same rows in the same order
        assert torch.equal(sorted_ids, ref_ids)


@pytest.mark.parametrize("align", list(ALIGNS))
def test_align_of_only_nonlocal_pairs_is_empty(align: str) -> None:
    ids = torch.full((5, 2), -1, dtype=torch.int32, device=DEVICE)
    sorted_ids, expert_ids, post = (t.cpu() for t in ALIGNS[align](ids, 4, 16))
    assert post.tolist() == [0] and (expert_ids == -1).all() and (sorted_ids == 10).all()


# ---------------------------------------------------------------- CUDA graphs

@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["grouped_mm", "triton", "triton-atomic"])
def test_gpu_cuda_graph_replays_with_new_nonlocal_pairs(backend: str) -> None:
    """bf16 (grouped_mm's CUTLASS path on sm90): captured with one routing, replayed with
    another and with every pair -1, the graph gives eager's bits (no host read of the ids)."""
    fn = BACKENDS[backend]
    x, w13, w2, weights, ids = make_case(64, 256, 128, 4)
    x, w13, w2 = x.bfloat16(), w13[FIRST:LAST].bfloat16(), w2[FIRST:LAST].bfloat16()
    static_weights, static_ids = weights.clone(), on_rank(ids)[1]
    graph, static_out = capture(lambda: fn(x, w13, w2, static_weights, static_ids))
    *_, weights2, ids2 = make_case(64, 256, 128, 4, seed=1)
    for new_ids in (on_rank(ids2)[1], torch.full_like(ids2, -1)):
        static_weights.copy_(weights2)
        static_ids.copy_(new_ids)
        graph.replay()
        eager = fn(x, w13, w2, static_weights, static_ids)
        if backend == "triton-atomic":  # the order of the fp32 atomics varies
            torch.testing.assert_close(static_out, eager, atol=1e-2, rtol=1e-2)
        else:
            assert torch.equal(static_out, eager)
    assert torch.equal(static_out, torch.zeros_like(static_out))
