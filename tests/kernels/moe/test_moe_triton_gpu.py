"""Triton fused MoE on the GPU (bf16, compiled): the qwen3-30b-a3b expert shape against the
per-expert loop, the launch options, every default tile, the Triton align at scale, no host
sync, a CUDA-graph replay (test_moe_triton.py: the same kernel through the interpreter).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from moeserve.kernels.moe import tile_configs as moe_configs
from moeserve.kernels.moe.align import moe_align_block_size_triton
from moeserve.kernels.moe.fused_triton import moe_triton
from moeserve.kernels.moe.ref import moe_loop_ref
from moeserve.kernels.moe.search import trial_key
from moeserve.kernels.moe.tile_configs import config_file_name, get_moe_config
from moeserve.kernels.moe.tune import tune_moe
from moeserve.kernels.routing.select import select_experts
from tests.cuda_graph import capture
from tests.kernels.moe.test_moe_align import check_align

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

    graph, static_out = capture(step)
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
