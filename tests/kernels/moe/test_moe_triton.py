"""Triton fused MoE: alignment, kernel vs the per-expert loop, tile configs and the tuner.

Without a GPU the kernel runs through Triton's interpreter (TRITON_INTERPRET=1, set before triton
is first imported), in fp32 and fp16 on tiny shapes; with one, the same tests run compiled, and
the @pytest.mark.gpu tests add bf16 at the qwen3-30b-a3b shape and a CUDA-graph replay.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from moeserve.kernels.moe import search as moe_search
from moeserve.kernels.moe import tile_configs as moe_configs
from moeserve.kernels.moe import timer as moe_timer
from moeserve.kernels.moe.align import (
    moe_align_block_size,
    moe_align_block_size_ref,
    moe_align_block_size_triton,
    moe_align_size,
)
from moeserve.kernels.moe.fused_triton import moe_triton
from moeserve.kernels.moe.ref import moe_loop_ref
from moeserve.kernels.moe.search import candidate_key, trial_key
from moeserve.kernels.moe.tile_configs import config_file_name, get_moe_config
from moeserve.kernels.moe.tune import tune_moe
from moeserve.kernels.routing.select import select_experts

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HIDDEN, INTER = 32, 16
SMALL = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=2, num_warps=4, num_stages=2)


def test_kernel_is_interpreted_without_a_gpu() -> None:
    from moeserve.kernels.moe.fused_triton import _kernel

    # triton.language binds its jit helpers at import: TRITON_INTERPRET must be set before
    interpreted = type(_kernel()).__name__ == "InterpretedFunction"
    assert interpreted == (DEVICE == "cpu")


# ---------------------------------------------------------------- alignment

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


# ---------------------------------------------------------------- the kernel

def make_experts(num_experts: int, dtype: torch.dtype, hidden: int = HIDDEN,
                 inter: int = INTER, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen) * hidden ** -0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=gen) * inter ** -0.5
    return w13.to(DEVICE, dtype), w2.to(DEVICE, dtype)


def make_routing(num_tokens: int, num_experts: int, top_k: int, dtype: torch.dtype,
                 hidden: int = HIDDEN, seed: int = 1) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen)
    weights, ids = select_experts(torch.randn(num_tokens, num_experts, generator=gen), top_k,
                                  renormalize=True)
    return x.to(DEVICE, dtype), weights.to(DEVICE), ids.to(DEVICE)


def assert_matches_ref(out: torch.Tensor, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                       weights: torch.Tensor, ids: torch.Tensor) -> None:
    assert out.shape == x.shape and out.dtype == x.dtype
    if x.dtype == torch.float32:
        torch.testing.assert_close(out, moe_loop_ref(x, w13, w2, weights, ids),
                                   atol=1e-5, rtol=1e-5)
    else:  # fp16 kernel (fp32 accumulation) vs the fp32 loop on the same fp16 values
        expected = moe_loop_ref(x.float(), w13.float(), w2.float(), weights, ids)
        torch.testing.assert_close(out.float(), expected, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("num_tokens", [0, 1, 7, 33])
@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("num_experts", [8, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_matches_loop_ref(dtype: torch.dtype, num_experts: int, top_k: int,
                          num_tokens: int) -> None:
    w13, w2 = make_experts(num_experts, dtype)
    x, weights, ids = make_routing(num_tokens, num_experts, top_k, dtype)
    out = moe_triton(x, w13, w2, weights, ids)  # default tile config
    assert_matches_ref(out, x, w13, w2, weights, ids)
    if num_tokens:
        assert out.abs().max() > 0.05


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_idle_experts_and_several_tiles_per_expert(dtype: torch.dtype) -> None:
    # BLOCK 16 over H 64 / I 48: several N- and K-tiles; 21 pairs of expert 3 span 2 blocks
    w13, w2 = make_experts(8, dtype, hidden=64, inter=48)
    x, _, _ = make_routing(21, 8, 2, dtype, hidden=64)
    ids = torch.tensor([[0, 3], [3, 0]] * 10 + [[6, 3]], device=DEVICE)  # 1,2,4,5,7 idle
    weights = torch.rand(21, 2, device=DEVICE)  # need not sum to 1
    out = moe_triton(x, w13, w2, weights, ids, config=SMALL)
    assert_matches_ref(out, x, w13, w2, weights, ids)


def test_all_tokens_to_one_expert_and_ragged_widths() -> None:
    # H 40, I 24: K and N tails masked (40 % 16, 24 % 16); all 33 tokens on expert 5
    w13, w2 = make_experts(16, torch.float32, hidden=40, inter=24)
    x, weights, _ = make_routing(33, 16, 1, torch.float32, hidden=40)
    ids = torch.full((33, 1), 5, device=DEVICE)
    out = moe_triton(x, w13, w2, weights, ids, config=SMALL)
    gate_up = x @ w13[5].T
    expected = (torch.nn.functional.silu(gate_up[:, :24]) * gate_up[:, 24:]) @ w2[5].T
    torch.testing.assert_close(out, expected * weights, atol=1e-5, rtol=1e-5)


def test_strided_rows_and_weights_are_read_in_place() -> None:
    # x rows and w13/w2 rows padded by 16 columns: only the last dim is contiguous
    w13_big, w2_big = make_experts(8, torch.float32, hidden=HIDDEN + 16, inter=INTER + 16)
    w13, w2 = w13_big[:, :2 * INTER, :HIDDEN], w2_big[:, :HIDDEN, :INTER]
    x_big, weights, ids = make_routing(9, 8, 2, torch.float32, hidden=HIDDEN + 16)
    x = x_big[:, :HIDDEN]
    assert not (x.is_contiguous() or w13.is_contiguous() or w2.is_contiguous())
    out = moe_triton(x, w13, w2, weights, ids, config=SMALL)
    assert_matches_ref(out, x.contiguous(), w13.contiguous(), w2.contiguous(), weights, ids)


def test_atomic_combine_and_torch_align_match_the_default() -> None:
    w13, w2 = make_experts(8, torch.float32)
    x, weights, ids = make_routing(33, 8, 2, torch.float32)
    summed = moe_triton(x, w13, w2, weights, ids, config=SMALL)
    atomic = moe_triton(x, w13, w2, weights, ids, config=SMALL, combine="atomic")
    torch.testing.assert_close(atomic, summed, atol=1e-6, rtol=1e-6)
    assert_matches_ref(atomic, x, w13, w2, weights, ids)
    # rows are computed independently: the order within an expert changes no bit
    torch_align = moe_triton(x, w13, w2, weights, ids, config=SMALL, align="torch")
    assert torch.equal(torch_align, summed)


@pytest.mark.parametrize("persistent", [1, 3])
@pytest.mark.parametrize("num_tokens", [1, 5, 40])
def test_persistent_launch_matches_one_program_per_tile(num_tokens: int,
                                                        persistent: int) -> None:
    """PERSISTENT n: n programs per SM (4 "SMs" off CUDA) walking the used tiles give the same
    bits as one program per tile, set on the gated launch, on the down launch alone (its "down"
    entry) or on both, fp32 and fp16, K not a multiple of BLOCK_K; a bad value is refused."""
    down = dict(BLOCK_N=32, BLOCK_K=16, GROUP_M=1, num_warps=4, num_stages=2)
    for dtype in (torch.float32, torch.float16):
        w13, w2 = make_experts(8, dtype, hidden=40)
        x, weights, ids = make_routing(num_tokens, 8, 2, dtype, hidden=40)
        once = moe_triton(x, w13, w2, weights, ids, config=SMALL)
        split_once = moe_triton(x, w13, w2, weights, ids, config={**SMALL, "down": down})
        for config, expected in (
                ({**SMALL, "PERSISTENT": persistent}, once),  # both launches (no "down")
                ({**SMALL, "PERSISTENT": persistent, "down": down}, split_once),  # gated only
                ({**SMALL, "down": {**down, "PERSISTENT": persistent}}, split_once)):
            assert torch.equal(moe_triton(x, w13, w2, weights, ids, config=config), expected)
    for bad in (-1, 9, True, 1.0):
        with pytest.raises(ValueError, match="PERSISTENT"):
            moe_triton(x, w13, w2, weights, ids, config={**SMALL, "PERSISTENT": bad})


def test_one_dot_gate_up_gives_the_same_output() -> None:
    """ONE_DOT: the gated launch reads gate and up columns side by side (w13 in its own layout)
    and does one dot of twice the width: the same output as two dots (fp32 ieee dots over the
    same K order), for N not a multiple of BLOCK_N (I = 24 with BLOCK_N 16) and K not a
    multiple of BLOCK_K, persistent too; the down launch refuses the option."""
    w13, w2 = make_experts(8, torch.float32, hidden=40, inter=24)
    x, weights, ids = make_routing(19, 8, 2, torch.float32, hidden=40)
    plain = moe_triton(x, w13, w2, weights, ids, config=SMALL)
    for extra in ({}, {"PERSISTENT": 2}):
        out = moe_triton(x, w13, w2, weights, ids, config={**SMALL, "ONE_DOT": 1, **extra})
        torch.testing.assert_close(out, plain, atol=1e-6, rtol=1e-6)
    assert_matches_ref(plain, x, w13, w2, weights, ids)
    down = {k: SMALL[k] for k in moe_configs.DOWN_KEYS}
    with pytest.raises(ValueError, match="unknown keys \\['ONE_DOT'\\]"):
        moe_triton(x, w13, w2, weights, ids, config={**SMALL, "down": {**down, "ONE_DOT": 1}})
    with pytest.raises(ValueError, match="ONE_DOT must be an int in \\[0, 1\\]"):
        moe_triton(x, w13, w2, weights, ids, config={**SMALL, "ONE_DOT": 2})


def sub_m_routing(dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """top-1 routing over 5 experts whose loads hit each SUB_M case at BLOCK_M 64 (quarter 16,
    half 32): 10 rows (a quarter tile), 20 (a half), 16 and 32 (the edges), 40 (the whole
    block) and 70 (one full block, then a block of 6: a quarter tile)."""
    loads = [10, 20, 16, 32, 40, 70]
    ids = torch.cat([torch.full((n,), e) for e, n in enumerate(loads)])
    ids = ids[torch.randperm(ids.numel(), generator=torch.Generator().manual_seed(3))]
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(ids.numel(), 40, generator=gen).to(DEVICE, dtype)
    weights = torch.rand(ids.numel(), 1, generator=gen).to(DEVICE)
    return x, weights, ids[:, None].to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_sub_m_tiles_compute_only_the_real_rows(dtype: torch.dtype) -> None:
    """SUB_M: blocks whose real rows fit a quarter or half of BLOCK_M take a tile of that
    height (both launches, or the down launch alone through its "down" entry, with ONE_DOT
    too): the same output as whole blocks; SUB_M with PERSISTENT is refused."""
    w13, w2 = make_experts(6, dtype, hidden=40)
    x, weights, ids = sub_m_routing(dtype)
    config = dict(SMALL, BLOCK_M=64, GROUP_M=1)
    whole = moe_triton(x, w13, w2, weights, ids, config=config)
    assert_matches_ref(whole, x, w13, w2, weights, ids)
    down = {k: config[k] for k in moe_configs.DOWN_KEYS}
    for sub in ({**config, "SUB_M": 1}, {**config, "SUB_M": 1, "ONE_DOT": 1},
                {**config, "down": {**down, "SUB_M": 1}}, dict(config, BLOCK_M=32, SUB_M=1)):
        out = moe_triton(x, w13, w2, weights, ids, config=sub)
        torch.testing.assert_close(out, whole, atol=1e-6 if dtype == torch.float32 else 1e-3,
                                   rtol=1e-6 if dtype == torch.float32 else 1e-3)
    with pytest.raises(ValueError, match="SUB_M and PERSISTENT"):
        moe_triton(x, w13, w2, weights, ids, config={**config, "SUB_M": 1, "PERSISTENT": 1})


@pytest.mark.parametrize("top_k", [1, 3])
def test_unreduced_output_is_the_k_weighted_rows(top_k: int) -> None:
    """reduce=False hands on [T, k, H] (the next norm sums them): their sum is the default
    output bit for bit, and each row is one expert's weighted output; "atomic" gives [T, 1, H];
    the reference backends follow the same contract."""
    from moeserve.kernels.registry import MOE_BACKENDS

    w13, w2 = make_experts(8, torch.float32)
    x, weights, ids = make_routing(21, 8, top_k, torch.float32)
    summed = moe_triton(x, w13, w2, weights, ids, config=SMALL)
    parts = moe_triton(x, w13, w2, weights, ids, config=SMALL, reduce=False)
    assert parts.shape == (21, top_k, x.shape[1])
    assert torch.equal(parts.sum(1) if top_k > 1 else parts[:, 0], summed)
    for slot in range(top_k):  # slot i of token t: expert ids[t, i] alone, weighted
        alone = moe_triton(x, w13, w2, weights[:, slot:slot + 1].contiguous(),
                           ids[:, slot:slot + 1].contiguous(), config=SMALL)
        torch.testing.assert_close(parts[:, slot], alone, atol=1e-6, rtol=1e-6)
    atomic = moe_triton(x, w13, w2, weights, ids, config=SMALL, combine="atomic", reduce=False)
    assert atomic.shape == (21, 1, x.shape[1])
    torch.testing.assert_close(atomic[:, 0], summed, atol=1e-6, rtol=1e-6)
    assert moe_triton(x[:0], w13, w2, weights[:0], ids[:0], reduce=False).shape == (0, 1, 32)
    ref = MOE_BACKENDS["torch"](x, w13, w2, weights, ids, reduce=False)
    assert ref.shape == (21, 1, x.shape[1])
    torch.testing.assert_close(ref[:, 0], summed, atol=1e-5, rtol=1e-5)


def test_launcher_rejects_bad_inputs() -> None:
    w13, w2 = make_experts(8, torch.float32)
    x, weights, ids = make_routing(4, 8, 2, torch.float32)
    with pytest.raises(TypeError, match="share one of"):
        moe_triton(x.half(), w13, w2, weights, ids)
    with pytest.raises(ValueError, match="shapes disagree"):
        moe_triton(x, w13, w2[:, :, :8], weights, ids)
    with pytest.raises(ValueError, match="w13 needs a contiguous last dim"):
        moe_triton(x, w13.transpose(1, 2).contiguous().transpose(1, 2), w2, weights, ids)
    with pytest.raises(ValueError, match="topk_weights must be float32"):
        moe_triton(x, w13, w2, weights.half(), ids)
    with pytest.raises(TypeError, match="topk_ids must be integer"):
        moe_triton(x, w13, w2, weights, ids.float())
    with pytest.raises(ValueError, match="power of two"):
        moe_triton(x, w13, w2, weights, ids, config={**SMALL, "BLOCK_K": 8})
    with pytest.raises(ValueError, match="combine must be"):
        moe_triton(x, w13, w2, weights, ids, combine="mean")
    with pytest.raises(ValueError, match="align must be"):
        moe_triton(x, w13, w2, weights, ids, align="numpy")


SPLIT = {**dict(SMALL, BLOCK_K=32, GROUP_M=1),
         "down": dict(BLOCK_N=32, BLOCK_K=16, GROUP_M=2, num_warps=2, num_stages=3)}


@pytest.mark.parametrize("combine", ["sum", "atomic"])
def test_split_config_matches_loop_ref_and_each_launch_gets_its_tiles(
        combine: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import moeserve.kernels.moe.fused_triton as mt

    # H 64, I 48: the gated launch (N = I) and the down one (N = H) each span several N- and
    # K-tiles of their own sizes; expert 3 gets two row blocks, some experts none
    w13, w2 = make_experts(8, torch.float32, hidden=64, inter=48)
    x, _, _ = make_routing(21, 8, 2, torch.float32, hidden=64)
    ids = torch.tensor([[0, 3], [3, 0]] * 10 + [[6, 3]], device=DEVICE)
    weights = torch.rand(21, 2, device=DEVICE)
    launches: list[tuple[bool, dict]] = []
    real = mt._launch

    def spy(*args: object, **kwargs: object) -> None:
        config = args[8]  # _launch reads the top-level tiles only
        launches.append((kwargs["gated"], {k: config[k] for k in moe_configs.CONFIG_KEYS}))
        real(*args, **kwargs)

    monkeypatch.setattr(mt, "_launch", spy)
    out = moe_triton(x, w13, w2, weights, ids, config=SPLIT, combine=combine)
    assert_matches_ref(out, x, w13, w2, weights, ids)
    top = {k: SPLIT[k] for k in moe_configs.CONFIG_KEYS}
    assert launches == [(True, top), (False, {"BLOCK_M": 16, **SPLIT["down"]})]
    # the same down tiles written out in full give the same bits as the top-level ones
    same = moe_triton(x, w13, w2, weights, ids, combine=combine,
                      config={**top, "down": {k: top[k] for k in moe_configs.DOWN_KEYS}})
    unsplit = moe_triton(x, w13, w2, weights, ids, config=top, combine=combine)
    if combine == "sum":
        assert torch.equal(same, unsplit)
    torch.testing.assert_close(out, unsplit, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("down", "message"), [
    (dict(SPLIT["down"], BLOCK_N=48),
     r"MoE tile config 'down' BLOCK_N must be a power of two >= 16 \(tl.dot\), got 48"),
    (dict(SPLIT["down"], BLOCK_K=8), r"'down' BLOCK_K must be a power of two >= 16.*got 8"),
    (dict(SPLIT["down"], BLOCK_M=32), r"'down' must not set BLOCK_M \(got 32\)"),
    ({k: v for k, v in SPLIT["down"].items() if k != "num_stages"},
     r"'down' lacks \['num_stages'\]"),
    (dict(SPLIT["down"], num_warps=3), r"'down' num_warps must be a power of two >= 1, got 3"),
    (dict(SPLIT["down"], num_stages=0), r"'down' num_stages must be >= 1, got 0"),
    (dict(SPLIT["down"], GROUP_M="8"), r"'down' GROUP_M must be an int, got '8'"),
    (dict(SPLIT["down"], BLOCK_SIZE=64), r"'down' holds unknown keys \['BLOCK_SIZE'\]"),
    ([32, 16, 2, 2, 3], r"'down' must be a dict of \['BLOCK_N', .*got list"),
])
def test_a_bad_down_entry_is_refused(down: object, message: str) -> None:
    w13, w2 = make_experts(8, torch.float32)
    x, weights, ids = make_routing(4, 8, 2, torch.float32)
    with pytest.raises(ValueError, match=message):
        moe_triton(x, w13, w2, weights, ids, config={**SMALL, "down": down})


def test_a_tuned_file_with_a_bad_down_entry_fails_naming_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    name = config_file_name(8, 64, 32, torch.float16, "Fake GPU")
    entry = {**SMALL, "down": dict(SPLIT["down"], BLOCK_N=24), "ms": 1.0}
    (tmp_path / name).write_text(json.dumps({"meta": {}, "configs": {"64": entry}}))
    monkeypatch.setenv(moe_configs.CONFIG_DIR_ENV, str(tmp_path))
    moe_configs.clear_caches()
    try:
        with pytest.raises(ValueError, match=r"the entry for 64 tokens: tuned MoE entry 'down' "
                                             r"BLOCK_N must be a power of two >= 16.*got 24"):
            get_moe_config(8, 64, 32, 2, torch.float16, 64, "Fake GPU")
        entry["down"] = dict(SPLIT["down"], BLOCK_K=64.0)  # JSON floats of integers are fine
        (tmp_path / name).write_text(json.dumps({"meta": {}, "configs": {"64": entry}}))
        moe_configs.clear_caches()
        choice = get_moe_config(8, 64, 32, 2, torch.float16, 64, "Fake GPU")
        assert choice.config == {**SMALL, "down": dict(SPLIT["down"], BLOCK_K=64)}
        entry["down"] = dict(SPLIT["down"], BLOCK_K=64.5)
        (tmp_path / name).write_text(json.dumps({"meta": {}, "configs": {"64": entry}}))
        moe_configs.clear_caches()
        with pytest.raises(ValueError, match=r"'down' BLOCK_K must be an integer, got 64.5"):
            get_moe_config(8, 64, 32, 2, torch.float16, 64, "Fake GPU")
    finally:
        moe_configs.clear_caches()


def test_fit_shared_memory_fits_each_launch_by_its_own_need() -> None:
    budget = moe_configs.SHARED_MEMORY_BUDGET
    config = {**moe_configs.tile_config(128, 128, 128, 8, 8, 4),
              "down": dict(BLOCK_N=64, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=3)}
    fitted = moe_configs.fit_shared_memory(config, 4)  # fp32
    # gated: (128 + 2 * 128) * 128 * 4 * 4 = 768 KiB -> 2 stages, then BLOCK_K 64 (192 KiB);
    # down: (128 + 64) * 128 * 4 * 3 = 288 KiB -> 2 stages (192 KiB) is enough, BLOCK_K kept
    assert {k: fitted[k] for k in ("BLOCK_M", "BLOCK_K", "num_stages")} == dict(
        BLOCK_M=128, BLOCK_K=64, num_stages=2)
    assert fitted["down"] == dict(config["down"], num_stages=2)
    gated_bytes, down_bytes = moe_configs.shared_memory_bytes(fitted, 4)
    assert gated_bytes == (128 + 256) * 64 * 4 * 2 <= budget
    assert down_bytes == (128 + 64) * 128 * 4 * 2 <= budget
    assert "down" not in moe_configs.fit_shared_memory(moe_configs.tile_config(
        64, 64, 64, 8, 4, 4), 4)
    assert config["down"]["num_stages"] == 3  # the input is not changed


def test_split_config_and_its_key() -> None:
    gated = dict(SMALL, BLOCK_M=64, BLOCK_N=64, GROUP_M=8)
    down = dict(gated, BLOCK_N=128, num_warps=8)
    assert moe_configs.split_config(gated, gated) == gated
    split = moe_configs.split_config(gated, down)
    assert split == {**gated, "down": {k: down[k] for k in moe_configs.DOWN_KEYS}}
    assert moe_configs.down_tiles(split) == down and moe_configs.down_tiles(gated) == gated
    assert moe_configs.config_key(gated) == "M64_N64_K16_G8_w4_s2"
    assert moe_configs.config_key(split) == "M64_N64_K16_G8_w4_s2+down_N128_K16_G8_w8_s2"
    assert candidate_key(split) == "M64_N64_K16_G8_w4_s2"
    with pytest.raises(ValueError, match="share BLOCK_M"):
        moe_configs.split_config(gated, dict(down, BLOCK_M=32))


def test_importing_without_triton_works() -> None:
    code = ("import sys; sys.modules['triton'] = None; "  # `import triton` now fails
            "import moeserve.kernels.moe.fused_triton, moeserve.kernels.moe.tile_configs, "
            "moeserve.kernels.moe.tune, "
            "moeserve.kernels.moe.align; print('ok')")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.stdout.strip() == "ok", result.stderr


# ---------------------------------------------------------------- configs and the tuner

def test_default_config_grows_with_tokens_per_expert() -> None:
    small = get_moe_config(128, 2048, 768, 8, torch.bfloat16, 64, "cpu")
    large = get_moe_config(128, 2048, 768, 8, torch.bfloat16, 4096, "cpu")
    assert not small.tuned and small.source == "default"
    assert small.config["BLOCK_M"] == 16 and large.config["BLOCK_M"] >= 64
    assert set(small.config) == set(moe_configs.CONFIG_KEYS)


def test_tuned_file_is_found_and_nearest_token_count_wins(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    name = config_file_name(8, 64, 32, torch.float16, "Fake GPU")
    assert name.startswith("E=8,H=64,I=32,device_name=Fake_GPU,dtype=float16,triton=")
    cfg16 = dict(SMALL, BLOCK_M=16)
    cfg64 = dict(SMALL, BLOCK_M=64)
    doc = {"meta": {}, "configs": {"16": {**cfg16, "ms": 1.0}, "512": {**cfg64, "ms": 2.0}}}
    (tmp_path / name).write_text(json.dumps(doc))
    monkeypatch.setenv(moe_configs.CONFIG_DIR_ENV, str(tmp_path))
    near16 = get_moe_config(8, 64, 32, 2, torch.float16, 100, "Fake GPU")
    assert near16.tuned and near16.config == cfg16 and near16.source == str(tmp_path / name)
    assert get_moe_config(8, 64, 32, 2, torch.float16, 400, "Fake GPU").config == cfg64
    assert not get_moe_config(8, 64, 32, 2, torch.bfloat16, 100, "Fake GPU").tuned


class Killed(BaseException):
    """Stands for the process being killed mid-tune (not an Exception: not skipped)."""


def test_tune_records_failures_resumes_and_feeds_the_lookup(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    grid = [dict(SMALL, BLOCK_N=n, num_stages=s) for n in (16, 32, 64) for s in (2, 3)]
    calls: list[tuple[str, int]] = []

    def timer(part: str, config: dict, num_tokens: int) -> float:
        calls.append((trial_key(part, config), num_tokens))
        if len(calls) == 16 and not resumed:  # T=16's 14 timings, then T=256's align
            raise Killed
        if part == "moe":
            return 1.5 + num_tokens / 1000
        if part == "align":
            return 0.01
        if config["BLOCK_N"] == 64:
            raise RuntimeError("out of resource: shared memory")
        if part == "gated":  # best: BLOCK_N 16, 2 stages, in one dot
            return (config["BLOCK_N"] / 16 + config["num_stages"] / 100 + num_tokens / 1000
                    - config.get("ONE_DOT", 0) / 200)
        # down, best: BLOCK_N 32, 3 stages
        return (abs(config["BLOCK_N"] - 32) / 16 + (5 - config["num_stages"]) / 100
                + num_tokens / 1000)

    path = tmp_path / config_file_name(8, 64, 32, torch.float16, "Fake GPU")
    args = (8, 64, 32, 2, torch.float16, [16, 256], path)
    resumed = False
    with pytest.raises(Killed):
        tune_moe(*args, candidates=lambda n: grid, timer=timer, device_name="Fake GPU",
                 log=lambda s: None)
    doc = json.loads(path.read_text())
    # align, 6 gated and 6 down tiles, the whole op (4 pairs per expert: no launch options)
    assert len(doc["trials"]["16"]) == 1 + 2 * 6 + 1 and len(doc["trials"]["256"]) == 1
    assert "16" in doc["configs"] and "256" not in doc["configs"]
    assert sum(isinstance(v, str) for v in doc["trials"]["16"].values()) == 4  # BLOCK_N 64

    resumed, calls[:] = True, []
    best = tune_moe(*args, candidates=lambda n: grid, timer=timer, device_name="Fake GPU",
                    log=lambda s: None)
    down = dict(grid[3], BLOCK_N=32, num_stages=3)
    split = moe_configs.split_config({**grid[0], "ONE_DOT": 1}, down)
    # 64 pairs per expert: each gated tile also in one dot (search_options)
    assert calls == ([(trial_key("gated", c), 256) for c in grid]  # only the rest: no align
                     + [(trial_key("gated", {**c, "ONE_DOT": 1}), 256) for c in grid]
                     + [(trial_key("down", c), 256) for c in grid]
                     + [(trial_key("moe", split), 256)])
    assert best[256]["BLOCK_N"] == 16 and best[256]["num_stages"] == 2
    assert best[256]["ONE_DOT"] == 1 and trial_key("moe", split).endswith(
        "_s2_1dot+down_N32_K16_G2_w4_s3")
    assert best[256]["down"] == {k: down[k] for k in moe_configs.DOWN_KEYS}
    assert best[256]["ms"] == pytest.approx(1.5 + 0.256)  # the whole op's time
    doc = json.loads(path.read_text())
    assert doc["meta"]["device_name"] == "Fake GPU" and doc["meta"]["top_k"] == 2
    assert doc["meta"]["triton"] == moe_configs.triton_version()
    monkeypatch.setenv(moe_configs.CONFIG_DIR_ENV, str(tmp_path))
    choice = get_moe_config(8, 64, 32, 2, torch.float16, 300, "Fake GPU")
    assert choice.tuned and choice.config == split == moe_configs.entry_config(best[256])

    with pytest.raises(ValueError, match="holds a tune of"):
        tune_moe(8, 64, 32, 4, torch.float16, [16], path, timer=timer, device_name="Fake GPU")


def test_tune_fails_clearly_when_every_candidate_fails(tmp_path: Path) -> None:
    def timer(part: str, config: dict, num_tokens: int) -> float:
        if part == "align":
            return 0.01
        raise RuntimeError("no kernel")

    with pytest.raises(RuntimeError, match="every candidate failed at 16 tokens"):
        tune_moe(8, 64, 32, 2, torch.float16, [16], tmp_path / "t.json",
                 candidates=lambda n: [SMALL], timer=timer, log=lambda s: None)


def test_tune_times_the_launches_apart_and_combines_their_best_tiles(tmp_path: Path) -> None:
    """Per BLOCK_M: one align, each tile for the gated launch and for the down launch; the best
    of each combine, the least total BLOCK_M wins, and only that pick is timed whole."""
    tiles = [dict(SMALL, BLOCK_M=m, BLOCK_N=n) for m in (16, 32) for n in (16, 32, 64)]
    align_ms = {16: 0.02, 32: 0.01}
    # (part, BLOCK_M) -> {BLOCK_N: ms}: at T=8 the gated launch likes N16 at M16 and N64 at
    # M32 (its best tile of all), the down launch N32 at both; N64 fails the gated launch at
    # M16 but runs the down one. At T=64 both launches like N16 at M16: no "down" entry.
    ms = {8: {("gated", 16): {16: 0.08, 32: 0.09},
              ("gated", 32): {16: 0.12, 32: 0.11, 64: 0.07},
              ("down", 16): {16: 0.12, 32: 0.10, 64: 0.30},
              ("down", 32): {16: 0.25, 32: 0.20, 64: 0.40}},
          64: {("gated", 16): {16: 0.1, 32: 0.2},
               ("gated", 32): {16: 0.3, 32: 0.3, 64: 0.3},
               ("down", 16): {16: 0.1, 32: 0.2, 64: 0.2},
               ("down", 32): {16: 0.3, 32: 0.3, 64: 0.3}}}
    calls: list[tuple[str, dict, int]] = []

    def timer(part: str, config: dict, num_tokens: int) -> float:
        calls.append((part, config, num_tokens))
        if part == "align":
            return align_ms[config["BLOCK_M"]]
        if part == "moe":
            return 0.5
        table = ms[num_tokens][part, config["BLOCK_M"]]
        if config["BLOCK_N"] not in table:
            raise RuntimeError("out of resource: shared memory")
        return table[config["BLOCK_N"]]

    path = tmp_path / "t.json"
    best = tune_moe(8, 64, 32, 2, torch.float32, [8, 64], path, candidates=lambda n: tiles,
                    timer=timer, device_name="cpu", log=lambda s: None)
    at8 = [(part, c) for part, c, n in calls if n == 8]
    assert [c["BLOCK_M"] for part, c in at8 if part == "align"] == [16, 32]  # once per BLOCK_M
    for part in ("gated", "down"):  # each tile once per launch, then (above BLOCK_M 16) the
        timed = [c for p, c in at8 if p == part]  # best with the other GROUP_M and with SUB_M
        first = tiles[5 if part == "gated" else 4]  # the first round's best at M32
        assert timed == [*tiles, dict(first, GROUP_M=1), dict(first, SUB_M=1)]
    assert len(at8) == 2 + 2 * len(tiles) + 4 + 1  # not one timing per (gated, down) pair
    # M16: 0.02 + 0.08 (gated N16) + 0.10 (down N32) = 0.20 beats M32: 0.01 + 0.07 + 0.20
    down = {k: SMALL[k] for k in moe_configs.DOWN_KEYS} | {"BLOCK_N": 32}
    split = {**dict(SMALL, BLOCK_N=16), "down": down}
    assert [(p, c) for p, c in at8 if p == "moe"] == [("moe", split)]
    assert best[8] == {**split, "ms": 0.5, "backend": "triton"}
    assert best[64] == {**dict(SMALL, BLOCK_N=16), "ms": 0.5, "backend": "triton"}
    doc = json.loads(path.read_text())
    assert doc["configs"]["8"]["down"] == down and "down" not in doc["configs"]["64"]
    trials = doc["trials"]["8"]
    assert trials["gated:M16_N64_K16_G2_w4_s2"].startswith("error: RuntimeError")
    assert trials["down:M16_N64_K16_G2_w4_s2"] == 0.30
    assert trials["align:M32"] == 0.01 and trials[trial_key("moe", split)] == 0.5
    assert moe_search.best_split(moe_search.tiles_by_block_m(tiles), trials) == (
        split, pytest.approx(0.20))


def test_tune_tries_launch_options_by_pairs_per_expert(tmp_path: Path) -> None:
    """ONE_DOT from 32 pairs per expert, the PERSISTENT round from 128 on the first round's best
    tile of each launch; the entry keeps an option only where it was faster, and the lookup
    hands it to moe_triton (config_key names it)."""
    tiles = [dict(SMALL, BLOCK_N=n) for n in (16, 32)]
    calls: list[tuple[str, int]] = []

    def timer(part: str, config: dict, num_tokens: int) -> float:
        calls.append((trial_key(part, config), num_tokens))
        if part in ("align", "moe"):
            return 0.01
        ms = 1.0 + config["BLOCK_N"] / 100 - config.get("ONE_DOT", 0) / 10
        # one program per SM: faster for the down launch, slower for the gated one
        return ms + config.get("PERSISTENT", 0) * (0.05 if part == "gated" else -0.02)

    assert moe_search.search_options(8, 2, 64) == (False, False)  # 16 per expert
    assert moe_search.search_options(8, 2, 128) == (True, False)  # 32
    assert moe_search.search_options(8, 2, 512) == (True, True)  # 128
    best = tune_moe(8, 64, 32, 2, torch.float32, [64, 512], tmp_path / "t.json",
                    candidates=lambda n: tiles, timer=timer, log=lambda s: None)
    at64 = [k for k, n in calls if n == 64]
    assert not [k for k in at64 if "_1dot" in k or "_p" in k]
    assert best[64] == {**tiles[0], "ms": 0.01, "backend": "triton"}
    at512 = [k for k, n in calls if n == 512]
    one_dot = {**tiles[0], "ONE_DOT": 1}
    down = {k: tiles[0][k] for k in moe_configs.DOWN_KEYS}
    assert at512 == ["align:M16", *[trial_key("gated", c) for c in tiles],
                     *[trial_key("gated", {**c, "ONE_DOT": 1}) for c in tiles],
                     trial_key("gated", {**one_dot, "PERSISTENT": 1}),
                     trial_key("gated", {**one_dot, "PERSISTENT": 2}),
                     *[trial_key("down", c) for c in tiles],
                     trial_key("down", {**tiles[0], "PERSISTENT": 1}),
                     trial_key("down", {**tiles[0], "PERSISTENT": 2}),
                     trial_key("moe", moe_configs.split_config(
                         one_dot, {**tiles[0], "PERSISTENT": 2}))]
    assert best[512] == {**one_dot, "down": {**down, "PERSISTENT": 2}, "ms": 0.01,
                         "backend": "triton"}
    assert moe_configs.config_key(moe_configs.entry_config(best[512])) == (
        "M16_N16_K16_G2_w4_s2_1dot+down_N16_K16_G2_w4_s2_p2")
    assert moe_configs.down_tiles(best[512]) == {**tiles[0], "PERSISTENT": 2}


def test_launch_options_in_configs_split_and_parse() -> None:
    """split_config keeps a launch's options (a "down" entry appears when only PERSISTENT
    differs), parse_entry reads them from JSON, and a bad one is named."""
    gated = {**SMALL, "ONE_DOT": 1, "PERSISTENT": 1}
    same = moe_configs.split_config(gated, {**SMALL, "PERSISTENT": 1})
    assert same == gated and moe_configs.down_tiles(same) == {**SMALL, "PERSISTENT": 1}
    apart = moe_configs.split_config(gated, SMALL)  # the down launch: one program per tile
    assert apart["down"] == {k: SMALL[k] for k in moe_configs.DOWN_KEYS}
    assert moe_configs.down_tiles(apart) == SMALL
    assert moe_configs.split_config({**SMALL, "ONE_DOT": 0}, SMALL) == SMALL  # 0: absent
    raw = {**{k: str(v) for k, v in gated.items()}, "backend": "triton"}
    assert moe_configs.entry_config(moe_configs.parse_entry(raw)) == gated
    with pytest.raises(ValueError, match="PERSISTENT must be an int in \\[0, 8\\]"):
        moe_configs.check_config({**SMALL, "down": {**apart["down"], "PERSISTENT": 9}})


def test_a_failing_align_skips_its_block_m(tmp_path: Path) -> None:
    tiles = [dict(SMALL, BLOCK_M=m) for m in (16, 32)]
    calls: list[str] = []

    def timer(part: str, config: dict, num_tokens: int) -> float:
        calls.append(trial_key(part, config))
        if part == "align" and config["BLOCK_M"] == 16:
            raise RuntimeError("align failed")
        return 0.1

    best = tune_moe(8, 64, 32, 2, torch.float32, [8], tmp_path / "t.json",
                    candidates=lambda n: tiles, timer=timer, log=lambda s: None)
    assert best[8]["BLOCK_M"] == 32 and "down" not in best[8]
    assert calls == ["align:M16", "align:M32"] + [
        trial_key(part, c) for part in ("gated", "down")
        for c in (tiles[1], dict(tiles[1], GROUP_M=1), dict(tiles[1], SUB_M=1))] + [
        trial_key("moe", tiles[1])]


def test_an_older_tune_still_loads_and_is_retimed_by_parts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the committed files: every entry loads, its tiles and at most a "down" of its own
    for path in sorted(moe_configs.PACKAGE_CONFIG_DIR.glob("*.json")):
        table = moe_configs._load_tuned(str(path))
        assert table
        for entry in table.values():
            config = moe_configs.entry_config(entry)
            assert set(moe_configs.CONFIG_KEYS) <= set(config) <= {
                *moe_configs.CONFIG_KEYS, *moe_configs.OPTION_KEYS, "down"}
            down = moe_configs.down_tiles(config)
            assert set(moe_configs.CONFIG_KEYS) <= set(down) <= {
                *moe_configs.CONFIG_KEYS, *moe_configs.DOWN_OPTION_KEYS}
            assert down["BLOCK_M"] == config["BLOCK_M"]
            # a "down" entry only where the down launch's tiles differ from those it would
            # take from the top level (an option set there, e.g. PERSISTENT, counts)
            inherited = moe_configs.down_tiles({k: v for k, v in config.items() if k != "down"})
            assert ("down" in config) == (down != inherited)
    # an older tuner's file: plain candidate keys in its ledger, whole-op times
    old = dict(SMALL, BLOCK_N=32)
    doc = {"meta": {"device_name": "Fake GPU", "dtype": "float16", "E": 8, "H": 64, "I": 32,
                    "top_k": 2, "triton": moe_configs.triton_version()},
           "configs": {"16": {**old, "ms": 0.3, "backend": "triton"},
                       "256": {**old, "ms": 0.9}},
           "trials": {"16": {candidate_key(old): 0.3}, "256": {candidate_key(old): 0.9}},
           "grouped_mm": {"16": 0.5}}
    path = tmp_path / config_file_name(8, 64, 32, torch.float16, "Fake GPU")
    path.write_text(json.dumps(doc))
    monkeypatch.setenv(moe_configs.CONFIG_DIR_ENV, str(tmp_path))
    moe_configs.clear_caches()
    choice = get_moe_config(8, 64, 32, 2, torch.float16, 200, "Fake GPU")
    assert choice.tuned and choice.config == old and choice.tuned_tokens == 256
    # resuming it at 16 tokens times the parts, keeps the old ledger entries and the 256 entry
    calls: list[str] = []

    def timer(part: str, config: dict, num_tokens: int) -> float:
        calls.append(trial_key(part, config))
        return 0.1

    best = tune_moe(8, 64, 32, 2, torch.float16, [16], path, candidates=lambda n: [SMALL],
                    timer=timer, device_name="Fake GPU", log=lambda s: None)
    assert calls == ["align:M16", trial_key("gated", SMALL), trial_key("down", SMALL),
                     trial_key("moe", SMALL)]
    assert best[16] == {**SMALL, "ms": 0.1, "backend": "triton", "grouped_mm_ms": 0.5}
    assert best[256] == {**old, "ms": 0.9, "backend": "triton"}
    assert json.loads(path.read_text())["trials"]["16"][candidate_key(old)] == 0.3


def test_tune_grid_is_modest_and_fits_tokens_per_expert() -> None:
    for num_tokens in (64, 256, 1024, 2048):
        grid = moe_search.moe_tune_candidates(128, 8, num_tokens)
        assert 20 <= len(grid) <= 150
        assert len({candidate_key(c) for c in grid}) == len(grid)
    assert {c["BLOCK_M"] for c in moe_search.moe_tune_candidates(128, 8, 64)} == {16}


def test_the_cuda_timer_runs_each_part_as_moe_triton_does(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The default timer's parts, run once each (time_in_graph replaced; on CPU through the
    interpreter): the gated part writes silu(gate) * up for every pair, the down part the
    weighted rows, and the whole op is moe_triton with the (split) config."""
    ran: list[object] = []

    def run_once(fn: Callable[[], object], calls: int, replays: int) -> float:
        ran.append(fn())
        return 1.0

    monkeypatch.setattr(moe_timer, "time_in_graph", run_once)
    w13, w2 = make_experts(8, torch.float32)
    timer = moe_timer.CudaPartTimer(8, HIDDEN, INTER, 2, torch.float32, (w13, w2))
    x, weights, ids, act, out = timer.inputs(5)
    assert timer("align", {"BLOCK_M": 16}, 5) == 1.0
    assert torch.equal(ran[-1][0], moe_align_block_size_triton(ids, 8, 16)[0])
    timer("gated", SMALL, 5)
    gate_up = torch.einsum("th,tkih->tki", x, w13[ids])  # [T, k, 2I]
    expected_act = torch.nn.functional.silu(gate_up[..., :INTER]) * gate_up[..., INTER:]
    torch.testing.assert_close(act, expected_act.reshape(10, INTER), atol=1e-5, rtol=1e-5)
    timer("down", dict(SMALL, BLOCK_N=32, BLOCK_K=16), 5)
    expected = torch.einsum("pi,phi->ph", act, w2[ids.flatten()]) * weights.reshape(10, 1)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    timer("moe", SPLIT, 5)
    assert_matches_ref(ran[-1], x, w13, w2, weights, ids)
    with pytest.raises(ValueError, match="part must be one of"):
        timer("combine", SMALL, 5)


# ---------------------------------------------------------------- GPU (bf16, compiled)

QWEN_E, QWEN_H, QWEN_I, QWEN_K = 128, 2048, 768, 8  # qwen3-30b-a3b experts
BF16_TOL = dict(atol=2e-2, rtol=2e-2)  # bf16 kernel vs the fp32 loop on the same bf16 values


@pytest.fixture(scope="module")
def qwen_experts() -> tuple[torch.Tensor, ...]:
    """bf16 expert weights at the qwen3-30b-a3b shape, and their fp32 copies for the ref."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13 = (torch.randn(QWEN_E, 2 * QWEN_I, QWEN_H, device="cuda", generator=gen)
           * QWEN_H ** -0.5).bfloat16()
    w2 = (torch.randn(QWEN_E, QWEN_H, QWEN_I, device="cuda", generator=gen)
          * QWEN_I ** -0.5).bfloat16()
    return w13, w2, w13.float(), w2.float()


def qwen_tokens(num_tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(num_tokens, QWEN_H, device="cuda", generator=gen).bfloat16()
    return x, torch.randn(num_tokens, QWEN_E, device="cuda", generator=gen)


@pytest.mark.gpu
@pytest.mark.parametrize("combine", ["sum", "atomic"])
@pytest.mark.parametrize("num_tokens", [1, 64, 256, 1024])
def test_gpu_qwen3_shape_bf16_matches_loop_ref(qwen_experts: tuple, num_tokens: int,
                                               combine: str) -> None:
    w13, w2, w13_f, w2_f = qwen_experts
    x, logits = qwen_tokens(num_tokens, seed=num_tokens)
    weights, ids = select_experts(logits, QWEN_K, renormalize=True)
    out = moe_triton(x, w13, w2, weights, ids, combine=combine)  # default or tuned config
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    expected = moe_loop_ref(x.float(), w13_f, w2_f, weights, ids)
    torch.testing.assert_close(out.float(), expected, **BF16_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 64, 1024, 2048, 8192])
def test_gpu_launch_options_match(qwen_experts: tuple, num_tokens: int) -> None:
    """The looked-up tiles of each size with their launch options off, then PERSISTENT 1 and 2
    on both launches (the same tiles and sums: the same bits), then ONE_DOT (one MMA of twice
    the width) and SUB_M (smaller tiles for blocks of few rows): within bf16 rounding of the
    plain launch (and ONE_DOT of the fp32 loop)."""
    from benchmarks.kernels.kernels_moe import looked_up_config, with_options

    w13, w2, w13_f, w2_f = qwen_experts
    x, logits = qwen_tokens(num_tokens, seed=num_tokens + 1)
    weights, ids = select_experts(logits, QWEN_K, renormalize=True)
    config = looked_up_config(x, w13, w2, ids)
    plain = moe_triton(x, w13, w2, weights, ids, config=with_options(config, "plain"))
    for n in (1, 2):
        gated = {k: config[k] for k in moe_configs.CONFIG_KEYS} | {"PERSISTENT": n}
        down = {k: v for k, v in moe_configs.down_tiles(config).items()
                if k in moe_configs.CONFIG_KEYS} | {"PERSISTENT": n}
        walked = moe_triton(x, w13, w2, weights, ids,
                            config=moe_configs.split_config(gated, down))
        assert torch.equal(walked, plain)
    one_dot = moe_triton(x, w13, w2, weights, ids, config=with_options(config, "one_dot"))
    torch.testing.assert_close(one_dot, plain, **BF16_TOL)
    sub_m = moe_triton(x, w13, w2, weights, ids, config=with_options(config, "sub_m"))
    torch.testing.assert_close(sub_m, plain, **BF16_TOL)  # other MMA shapes: bf16 rounding
    if num_tokens <= 1024:  # the fp32 loop is slow at the large sizes
        expected = moe_loop_ref(x.float(), w13_f, w2_f, weights, ids)
        torch.testing.assert_close(one_dot.float(), expected, **BF16_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [64, 256, 1024, 4096])
def test_gpu_every_default_tile_config_compiles_and_is_right(qwen_experts: tuple,
                                                            num_tokens: int) -> None:
    w13, w2, w13_f, w2_f = qwen_experts
    x, logits = qwen_tokens(300, seed=num_tokens)
    weights, ids = select_experts(logits, QWEN_K, renormalize=True)
    config = moe_configs.default_moe_config(QWEN_E, QWEN_K, num_tokens)
    out = moe_triton(x, w13, w2, weights, ids, config=config)
    expected = moe_loop_ref(x.float(), w13_f, w2_f, weights, ids)
    torch.testing.assert_close(out.float(), expected, **BF16_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 256])
def test_gpu_default_tiles_backend_runs_the_defaults(qwen_experts: tuple,
                                                    num_tokens: int) -> None:
    """The triton backend as an engine with moe_tiles=default builds it: the default tiles even
    where a tuned file exists (the committed H200 one, on an H200), and right."""
    from moeserve.kernels.registry import get_moe_backend

    w13, w2, w13_f, w2_f = qwen_experts
    x, logits = qwen_tokens(num_tokens, seed=num_tokens + 7)
    weights, ids = select_experts(logits, QWEN_K, renormalize=True)
    out = get_moe_backend("triton", tiles="default")(x, w13, w2, weights, ids)
    config = moe_configs.fit_shared_memory(
        moe_configs.default_moe_config(QWEN_E, QWEN_K, num_tokens), 2)
    assert torch.equal(out, moe_triton(x, w13, w2, weights, ids, config=config))  # "sum"
    expected = moe_loop_ref(x.float(), w13_f, w2_f, weights, ids)
    torch.testing.assert_close(out.float(), expected, **BF16_TOL)


@pytest.mark.gpu
def test_gpu_triton_align_at_scale() -> None:
    gen = torch.Generator(device="cuda").manual_seed(5)
    _, ids = select_experts(torch.randn(2048, QWEN_E, device="cuda", generator=gen), QWEN_K,
                            renormalize=False)
    check_align(moe_align_block_size_triton, ids.cpu(), QWEN_E, 64)
    check_align(moe_align_block_size_triton, ids[:64].cpu(), QWEN_E, 16)


@pytest.mark.gpu
def test_gpu_no_host_sync(qwen_experts: tuple) -> None:
    w13, w2, _, _ = qwen_experts
    x, logits = qwen_tokens(64, seed=1)
    moe_triton(x, w13, w2, *select_experts(logits, QWEN_K, renormalize=True))  # compile
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = moe_triton(x, w13, w2, *select_experts(logits, QWEN_K, renormalize=True))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.shape == x.shape


@pytest.mark.gpu
def test_gpu_cuda_graph_replays_with_new_routing(qwen_experts: tuple) -> None:
    w13, w2, w13_f, w2_f = qwen_experts
    x, logits = qwen_tokens(96, seed=2)
    static_x, static_logits = x.clone(), logits.clone()

    def step() -> torch.Tensor:
        return moe_triton(static_x, w13, w2,
                          *select_experts(static_logits, QWEN_K, renormalize=True))

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile and warm up outside the graph
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step()
    x2, logits2 = qwen_tokens(96, seed=3)  # new tokens, new routing
    static_x.copy_(x2)
    static_logits.copy_(logits2)
    graph.replay()
    torch.testing.assert_close(static_out, step(), atol=0, rtol=0)  # "sum" is deterministic
    expected = moe_loop_ref(x2.float(), w13_f, w2_f,
                            *select_experts(logits2, QWEN_K, renormalize=True))
    torch.testing.assert_close(static_out.float(), expected, **BF16_TOL)


@pytest.mark.gpu
def test_gpu_tune_skips_a_failing_candidate_and_feeds_the_lookup(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    good = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=3)
    too_big = dict(good, BLOCK_K=512, num_stages=8)  # > 1 MB of shared memory: cannot launch
    device = torch.cuda.get_device_name()
    path = tmp_path / config_file_name(QWEN_E, QWEN_H, QWEN_I, torch.bfloat16, device)
    best = tune_moe(QWEN_E, QWEN_H, QWEN_I, QWEN_K, torch.bfloat16, [64], path,
                    candidates=lambda n: [too_big, good])
    doc = json.loads(path.read_text())
    for part in ("gated", "down"):  # each launch is timed apart, and each fails to launch
        assert doc["trials"]["64"][trial_key(part, too_big)].startswith("error")
    assert best[64]["BLOCK_K"] == 128 and best[64]["ms"] > 0
    # the entry's time is the whole op's own timing in the ledger (not a bound on the GPU's speed)
    assert best[64]["ms"] in [v for k, v in doc["trials"]["64"].items() if k.startswith("moe:")]
    monkeypatch.setenv(moe_configs.CONFIG_DIR_ENV, str(tmp_path))
    choice = get_moe_config(QWEN_E, QWEN_H, QWEN_I, QWEN_K, torch.bfloat16, 64, device)
    assert choice.tuned and choice.config == good
