"""The FP8 MoE's Gluon grouped GEMM (kernels/moe/quant/fp8_gluon.py): which launches it takes
(CPU), and on an sm90 GPU its output against fused_triton's FP8 kernel and the reference, with
expert-parallel (-1) pairs, the parts, a CUDA graph with new routing, and proof that it ran."""

from __future__ import annotations

import pytest
import torch

from moeserve.kernels.moe.quant import fp8_gluon
from moeserve.kernels.moe.quant.configs import default_quant_config
from moeserve.kernels.moe.quant.fused_triton import moe_quant_triton
from moeserve.kernels.moe.quant.ref import moe_quant_ref
from tests.cuda_graph import capture
from tests.kernels.moe.test_moe_quant_triton import (
    TOP_K,
    _fp8_block_experts,
    rel_err,
    routing,
    tokens,
)

SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def test_unroll_takes_even_step_counts() -> None:
    assert fp8_gluon.unroll(2048, wide=True) == 2  # 16 steps: 192 accumulator registers
    assert fp8_gluon.unroll(2048, wide=False) == 4
    assert fp8_gluon.unroll(768, wide=False) == 2  # 6 steps: not 4
    assert fp8_gluon.unroll(1536, wide=False) == 4  # 12 steps
    assert fp8_gluon.unroll(1408, wide=False) == 0  # 11 steps: odd
    assert fp8_gluon.unroll(1000, wide=True) == 0  # not whole steps


def test_tiles_name_their_warps_and_refuse_other_heights(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    assert fp8_gluon.tiles(64, True) == {"BLOCK_M": 64, "BLOCK_N": 64, "STAGES": 4,
                                         "num_warps": 4, "wide": True}
    assert fp8_gluon.tiles(128, False) == {"BLOCK_M": 128, "BLOCK_N": 128, "STAGES": 4,
                                           "num_warps": 8, "wide": True}
    monkeypatch.setattr(fp8_gluon, "gated_block_n", 32)  # 64 accumulator columns a row
    assert fp8_gluon.tiles(64, True)["wide"] is False
    with pytest.raises(ValueError, match="BLOCK_M 32"):
        fp8_gluon.tiles(32, True)


def test_the_cpu_runs_the_triton_kernel_with_the_switch_on(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    """The switch on, a CPU launch is not the Gluon kernel's (sm90 only): the same bits as
    with it off."""
    if torch.cuda.is_available():
        pytest.skip("the CPU path")
    compact, _ = _fp8_block_experts(2, 256, 128, torch.float32)
    x = tokens(7, 256, seed=3)
    weights, ids = routing(7, 2, seed=3)
    config = {**default_quant_config("fp8", 7, TOP_K, 2, 128), "BLOCK_M": 64}
    off = moe_quant_triton(x, *compact, weights, ids, config=config)
    monkeypatch.setattr(fp8_gluon, "backend", "gluon")
    calls = []
    monkeypatch.setattr(fp8_gluon, "launch", lambda *a, **k: calls.append(a))
    assert torch.equal(moe_quant_triton(x, *compact, weights, ids, config=config), off)
    assert calls == []


# ------------------------------------------------------------------------------------ GPU

E, H, INTER = 16, 1024, 512  # K steps: 8 (gated), 4 (down)


def _configs(num_tokens: int, block_m: int) -> dict:
    return {**default_quant_config("fp8", num_tokens, TOP_K, E, 128), "BLOCK_M": block_m}


def _inputs(num_tokens: int, seed: int, off_rank: bool = False
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x bf16 [T, H], topk_weights, topk_ids) on the GPU."""
    x = tokens(num_tokens, H, seed=seed, dtype=torch.bfloat16)
    return (x, *routing(num_tokens, E, seed=seed, off_rank=off_rank))


@pytest.fixture
def gluon_on(monkeypatch: pytest.MonkeyPatch) -> list:
    """The switch on, each Gluon launch counted (gated, down)."""
    launched = []
    real = fp8_gluon.launch

    def counted(*args, **kwargs):
        launched.append(kwargs["gated"])
        return real(*args, **kwargs)

    monkeypatch.setattr(fp8_gluon, "backend", "gluon")
    monkeypatch.setattr(fp8_gluon, "launch", counted)
    return launched


@pytest.mark.gpu
@pytest.mark.skipif(not SM90, reason="the Gluon kernel runs on sm90")
@pytest.mark.parametrize("one_dot", [False, True])
@pytest.mark.parametrize("block_m", [64, 128])
@pytest.mark.parametrize("num_tokens", [5, 64, 300, 2048])
def test_gpu_gluon_matches_triton_and_ref(num_tokens: int, block_m: int, one_dot: bool,
                                          gluon_on: list, monkeypatch: pytest.MonkeyPatch
                                          ) -> None:
    """Both forms of the gated launch (one_dot: gate and up rows interleaved in one tile)."""
    monkeypatch.setattr(fp8_gluon, "one_dot", one_dot)
    compact, _ = _fp8_block_experts(E, H, INTER, torch.bfloat16)
    x, weights, ids = _inputs(num_tokens, num_tokens, off_rank=True)
    config = _configs(num_tokens, block_m)
    out = moe_quant_triton(x, *compact, weights, ids, config=config)
    assert gluon_on == [True, False]  # both launches its
    parts = moe_quant_triton(x, *compact, weights, ids, config=config, reduce=False)
    assert torch.equal(parts.sum(1), out)
    assert torch.equal(parts[ids == -1], torch.zeros_like(parts[ids == -1]))
    monkeypatch.setattr(fp8_gluon, "backend", "triton")
    triton_out = moe_quant_triton(x, *compact, weights, ids, config=config)
    assert len(gluon_on) == 4  # the Triton run took none
    # the same products and scales, summed in another order (promoted a step late)
    assert rel_err(out, triton_out) < 1e-2
    assert rel_err(out, moe_quant_ref(x, *compact, weights, ids)) < 2e-2


@pytest.mark.gpu
@pytest.mark.skipif(not SM90, reason="the Gluon kernel runs on sm90")
def test_gpu_gluon_replays_in_a_cuda_graph_with_new_routing(gluon_on: list) -> None:
    compact, _ = _fp8_block_experts(E, H, INTER, torch.bfloat16)
    x, weights, ids = _inputs(256, 2)
    static = [x.clone(), weights.clone(), ids.clone()]
    config = _configs(256, 64)

    def step() -> torch.Tensor:
        return moe_quant_triton(static[0], *compact, static[1], static[2], config=config)

    graph, static_out = capture(step)
    x2, weights2, ids2 = _inputs(256, 3, off_rank=True)
    for buf, new in zip(static, (x2, weights2, ids2)):
        buf.copy_(new)
    graph.replay()
    assert torch.equal(static_out, step())  # deterministic: eager's bits
    assert rel_err(static_out, moe_quant_ref(x2, *compact, weights2, ids2)) < 2e-2
    assert True in gluon_on and False in gluon_on  # the captured launches were its


@pytest.mark.gpu
@pytest.mark.skipif(not SM90, reason="the Gluon kernel runs on sm90")
def test_gpu_gluon_leaves_what_it_cannot_run_to_triton(gluon_on: list) -> None:
    """Per-row weight scales (scale_rows 1) and 16-row blocks stay with fused_triton."""
    compact, per_row = _fp8_block_experts(E, H, INTER, torch.bfloat16)
    x, weights, ids = _inputs(64, 4)
    moe_quant_triton(x, *per_row, weights, ids, config=_configs(64, 64))
    moe_quant_triton(x, *compact, weights, ids, config=_configs(64, 16))
    assert gluon_on == []


@pytest.mark.gpu
@pytest.mark.skipif(not SM90, reason="the Gluon kernel runs on sm90")
@pytest.mark.parametrize("block_m", [64, 128])
def test_gpu_gluon_narrow_tiles_match_the_wide(block_m: int, gluon_on: list,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The 64-column accumulators (gated one-dot over 32 gate + 32 up rows, down 64 columns;
    UNROLL 4, not 2) give the same op as the 128-column ones."""
    compact, _ = _fp8_block_experts(E, H, INTER, torch.bfloat16)
    x, weights, ids = _inputs(300, 7, off_rank=True)
    config = _configs(300, block_m)
    monkeypatch.setattr(fp8_gluon, "one_dot", True)
    wide = moe_quant_triton(x, *compact, weights, ids, config=config)
    monkeypatch.setattr(fp8_gluon, "gated_block_n", 32)
    monkeypatch.setattr(fp8_gluon, "down_block_n", 64)
    narrow = moe_quant_triton(x, *compact, weights, ids, config=config)
    assert gluon_on == [True, False, True, False]
    assert rel_err(narrow, wide) < 1e-2
    assert rel_err(narrow, moe_quant_ref(x, *compact, weights, ids)) < 2e-2


@pytest.mark.gpu
@pytest.mark.skipif(not SM90, reason="the Gluon kernel runs on sm90")
@pytest.mark.parametrize("one_dot", [False, True])
@pytest.mark.parametrize("block_m", [64, 128])
def test_gpu_gluon_scales_through_shared_memory_give_the_same_bits(
        block_m: int, one_dot: bool, gluon_on: list, monkeypatch: pytest.MonkeyPatch) -> None:
    """smem_scales: each step's scales copied with its operands into the stage and read from
    there: the same values and arithmetic, so the same bits (padding rows and -1 pairs too)."""
    compact, _ = _fp8_block_experts(E, H, INTER, torch.bfloat16)
    x, weights, ids = _inputs(300, 9, off_rank=True)
    config = _configs(300, block_m)
    monkeypatch.setattr(fp8_gluon, "one_dot", one_dot)
    monkeypatch.setattr(fp8_gluon, "smem_scales", False)
    loaded = moe_quant_triton(x, *compact, weights, ids, config=config, reduce=False)
    monkeypatch.setattr(fp8_gluon, "smem_scales", True)
    copied = moe_quant_triton(x, *compact, weights, ids, config=config, reduce=False)
    assert gluon_on == [True, False, True, False]
    assert torch.equal(copied, loaded)


@pytest.mark.gpu
@pytest.mark.skipif(not SM90, reason="the Gluon kernel runs on sm90")
@pytest.mark.parametrize("num_tokens", [5, 64, 300, 2048])
def test_gpu_warp_specialized_kernel_matches_triton_and_ref(
        num_tokens: int, gluon_on: list, monkeypatch: pytest.MonkeyPatch) -> None:
    """fp8_gluon_ws (backend "gluon-ws": 128-row blocks, loads in a producer partition
    STAGES ahead, mbarriers between): both launches its, the op within 1e-2 of Triton's,
    -1 pairs' parts zero, a CUDA graph's replay eager's bits."""
    from moeserve.kernels.moe.quant import fp8_gluon_ws

    ws_launches = []
    real = fp8_gluon_ws.launch
    monkeypatch.setattr(fp8_gluon_ws, "launch",
                        lambda *a, **k: ws_launches.append(k["gated"]) or real(*a, **k))
    monkeypatch.setattr(fp8_gluon, "backend", "gluon-ws")
    compact, _ = _fp8_block_experts(E, H, INTER, torch.bfloat16)
    x, weights, ids = _inputs(num_tokens, 20 + num_tokens, off_rank=True)
    config = _configs(num_tokens, 64)  # the switch makes the row blocks 128 high
    parts = moe_quant_triton(x, *compact, weights, ids, config=config, reduce=False)
    assert ws_launches == [True, False]
    assert torch.equal(parts[ids == -1], torch.zeros_like(parts[ids == -1]))
    out = parts.sum(1)
    monkeypatch.setattr(fp8_gluon, "backend", "triton")
    assert rel_err(out, moe_quant_triton(x, *compact, weights, ids, config=config)) < 1e-2
    assert rel_err(out, moe_quant_ref(x, *compact, weights, ids)) < 2e-2
    monkeypatch.setattr(fp8_gluon, "backend", "gluon-ws")
    static = [x.clone(), weights.clone(), ids.clone()]

    def step() -> torch.Tensor:
        return moe_quant_triton(static[0], *compact, static[1], static[2], config=config)

    graph, static_out = capture(step)
    x2, weights2, ids2 = _inputs(num_tokens, 40 + num_tokens, off_rank=True)
    for buf, new in zip(static, (x2, weights2, ids2)):
        buf.copy_(new)
    graph.replay()
    assert torch.equal(static_out, step())
    assert rel_err(static_out, moe_quant_ref(x2, *compact, weights2, ids2)) < 2e-2
