"""The fused MoE's alignment (kernels/moe/align.py): the torch and Triton aligns against the
reference, the invariants the kernel relies on, the one-launch form up to its limit, no device
value read on the host, bad arguments refused. Without a GPU the Triton align runs through
Triton's interpreter (test_moe_triton.py's module docstring)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from moeserve.kernels.moe.align import (
    moe_align_block_size,
    moe_align_block_size_ref,
    moe_align_block_size_triton,
    moe_align_size,
)
from moeserve.kernels.routing.select import select_experts

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def canonical(sorted_ids: torch.Tensor, expert_ids: torch.Tensor,
              block_m: int) -> torch.Tensor:
    """sorted_ids with each expert's segment sorted (pairs ascending, then the sentinels)."""
    out = sorted_ids.clone()
    owner = expert_ids.repeat_interleave(block_m)
    for e in owner.unique().tolist():
        seg = (owner == e).nonzero().flatten()
        out[seg] = sorted_ids[seg].sort().values
    return out


def check_align(align: Callable, ids: torch.Tensor, num_experts: int, block_m: int) -> None:
    """align's outputs equal the ref's (up to order within an expert, unless align is the torch
    one, which is stable) and satisfy the invariants the kernel relies on."""
    sorted_ids, expert_ids, post = align(ids.to(DEVICE), num_experts, block_m)
    sorted_ids, expert_ids, post = sorted_ids.cpu(), expert_ids.cpu(), post.cpu()
    ref_ids, ref_experts, ref_post = moe_align_block_size_ref(ids, num_experts, block_m)
    assert torch.equal(expert_ids, ref_experts) and torch.equal(post, ref_post)
    stable = align is moe_align_block_size
    assert torch.equal(sorted_ids if stable else canonical(sorted_ids, expert_ids, block_m),
                       ref_ids)

    num_pairs = ids.numel()
    size = moe_align_size(num_pairs, num_experts, block_m)
    assert sorted_ids.shape == (size,) and expert_ids.shape == (size // block_m,)
    assert sorted_ids.dtype == expert_ids.dtype == post.dtype == torch.int32
    counts = torch.bincount(ids.flatten(), minlength=num_experts)
    used = int((-(-counts // block_m) * block_m).sum())
    assert post.tolist() == [used]
    real = sorted_ids[sorted_ids < num_pairs]
    assert sorted(real.tolist()) == list(range(num_pairs))  # every (token, slot) exactly once
    assert int((sorted_ids == num_pairs).sum()) == size - num_pairs  # the rest is sentinel
    flat = ids.flatten()
    for b, e in enumerate(expert_ids.tolist()):
        rows = sorted_ids[b * block_m:(b + 1) * block_m]
        pairs = rows[rows < num_pairs]
        if e < 0:
            assert b * block_m >= used and pairs.numel() == 0
        else:
            assert b * block_m < used and (flat[pairs.long()] == e).all()
            assert pairs.numel() > 0  # a block exists only for pairs, so segments are padded
    assert expert_ids[:used // block_m].tolist() == sorted(expert_ids[:used // block_m].tolist())


ALIGNS = [moe_align_block_size, moe_align_block_size_triton]


@pytest.mark.parametrize("align", ALIGNS, ids=["torch", "triton"])
@pytest.mark.parametrize("block_m", [1, 4, 16, 64])
@pytest.mark.parametrize(("num_experts", "top_k"), [(1, 1), (8, 2), (16, 1), (64, 8)])
@pytest.mark.parametrize("num_tokens", [0, 1, 7, 33])
def test_align_matches_ref(num_tokens: int, num_experts: int, top_k: int, block_m: int,
                           align: Callable) -> None:
    gen = torch.Generator().manual_seed(num_tokens * 7 + top_k)
    _, ids = select_experts(torch.randn(num_tokens, num_experts, generator=gen), top_k, False)
    check_align(align, ids, num_experts, block_m)


@pytest.mark.parametrize("align", ALIGNS, ids=["torch", "triton"])
def test_align_skewed_large_and_int32_ids(align: Callable) -> None:
    ids = torch.tensor([[5, 0]] * 20 + [[5, 3]], dtype=torch.int32)
    check_align(align, ids, 8, 16)
    _, expert_ids, post = align(ids.to(DEVICE), 8, 16)
    assert expert_ids.tolist()[:5] == [0, 0, 3, 5, 5] and post.item() == 80
    # more pairs than one program of the Triton launches (512): several programs; 128 experts
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 100, (300, 8), generator=gen)
    check_align(align, ids, 128, 64)


class _LaunchSpy:
    """A jitted kernel whose launches (kernel[grid](...)) are recorded by name, then run."""

    def __init__(self, kernel: object, name: str, log: list[str]) -> None:
        self.kernel, self.name, self.log = kernel, name, log

    def __getitem__(self, grid: tuple[int, ...]) -> Callable:
        self.log.append(self.name)
        return self.kernel[grid]


@pytest.mark.parametrize("limit", ["default", 0])
@pytest.mark.parametrize("num_tokens", [1, 64, 65])
def test_align_runs_one_launch_up_to_its_limit(monkeypatch: pytest.MonkeyPatch, num_tokens: int,
                                               limit: str | int) -> None:
    """Up to ONE_LAUNCH_MAX_PAIRS pairs (64 tokens at top-8) the Triton align's three phases
    run in one launch, above it (or with the limit 0) in three; the same experts, total and
    rows as the reference either way, pairs of other ranks (-1) included."""
    from moeserve.kernels.moe import align as align_module

    kernels = align_module._align_kernels()
    launched: list[str] = []
    for name in ("one", "count", "offsets", "scatter"):
        monkeypatch.setattr(kernels, name, _LaunchSpy(getattr(kernels, name), name, launched))
    if limit != "default":
        monkeypatch.setattr(align_module, "ONE_LAUNCH_MAX_PAIRS", limit)
    gen = torch.Generator().manual_seed(num_tokens)
    ids = torch.randint(0, 96, (num_tokens, 8), generator=gen)
    ids[::3, 5] = -1  # not on this rank
    sorted_ids, expert_ids, post = (t.cpu() for t in moe_align_block_size_triton(
        ids.to(DEVICE), 96, 16))
    one = ids.numel() <= align_module.ONE_LAUNCH_MAX_PAIRS
    assert launched == (["one"] if one else ["count", "offsets", "scatter"])
    assert one == (limit == "default" and num_tokens <= 64)
    ref_ids, ref_experts, ref_post = moe_align_block_size_ref(ids, 96, 16)
    assert torch.equal(expert_ids, ref_experts) and torch.equal(post, ref_post)
    assert torch.equal(canonical(sorted_ids, expert_ids, 16), ref_ids)


def test_align_reads_no_device_value() -> None:
    # meta tensors hold no data: .item(), nonzero, bincount... would raise
    ids = torch.empty(9, 2, dtype=torch.int64, device="meta")
    sorted_ids, expert_ids, post = moe_align_block_size(ids, 128, 16)
    assert sorted_ids.shape == (moe_align_size(18, 128, 16),) == (288,)
    assert expert_ids.shape == (18,) and post.shape == (1,)


def test_align_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="topk_ids must be"):
        moe_align_block_size(torch.zeros(4, dtype=torch.int64), 8, 16)
    with pytest.raises(TypeError, match="integer"):
        moe_align_block_size(torch.zeros(4, 2), 8, 16)
    with pytest.raises(ValueError, match="block_m"):
        moe_align_block_size(torch.zeros(4, 2, dtype=torch.int64), 8, 0)
