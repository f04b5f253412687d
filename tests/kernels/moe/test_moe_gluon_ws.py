"""The bf16 MoE's warp-specialized Gluon grouped GEMM (kernels/moe/gluon_ws.py): its tile and
stage rules and that a CPU launch never takes it (CPU); on an sm90 GPU both launches through it
against Triton's kernel and the per-expert loop, with expert-parallel (-1) pairs, the parts,
fp16, a CUDA graph with new routing, and proof that it ran."""

from __future__ import annotations

import pytest
import torch

from moeserve import envs
from moeserve.kernels.moe import gluon_ws
from moeserve.kernels.moe.fused_triton import moe_triton
from moeserve.kernels.moe.ref import moe_loop_ref
from moeserve.kernels.routing.select import select_experts
from tests.cuda_graph import capture
from tests.fresh_import import attribute_at_import

SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def test_block_n_takes_the_widest_tile_that_divides() -> None:
    assert gluon_ws.block_n(768, gated=True) == 128  # gate and up 128 each: 256 columns
    assert gluon_ws.block_n(1408, gated=True) == 128
    assert gluon_ws.block_n(2048, gated=False) == 256
    assert gluon_ws.block_n(1408, gated=False) == 128  # 5.5 tiles of 256
    assert gluon_ws.block_n(64 * 7, gated=False) == 64
    assert gluon_ws.block_n(100, gated=True) == 0


def test_stages_fill_shared_memory_beside_the_epilogue() -> None:
    assert gluon_ws.stages(256, 2) == 4  # 48 KB a stage
    assert gluon_ws.stages(128, 2) == 6  # 32 KB a stage: capped
    assert gluon_ws.stages(256, 2) * (128 + 256) * 64 * 2 + 16 * 1024 <= gluon_ws.SMEM_BYTES


def test_auto_wants_a_full_block_an_expert_on_average(monkeypatch: pytest.MonkeyPatch
                                                      ) -> None:
    """"auto" hands over a launch only from 128 pairs an expert (here the switch's rule alone:
    `supports` is stubbed true); "off" never, "on" always, an unknown mode refused."""
    monkeypatch.setattr(gluon_ws, "supports", lambda *args: True)
    a = c = torch.empty(0)
    w = torch.empty(16, 0, 0)  # 16 experts: 2,048 pairs a full block each

    def takes(num_pairs: int, block_m: int = 128) -> bool:
        return gluon_ws.takes(a, w, c, block_m, True, False, 1, num_pairs)

    assert not takes(2048)  # "off", the default
    monkeypatch.setattr(gluon_ws, "mode", "auto")
    assert takes(2048) and not takes(2047)
    assert not takes(4096, block_m=64)  # the align's blocks must be 128 high
    assert not gluon_ws.takes(a, w, c, 128, True, True, 1, 4096)  # atomic combine
    monkeypatch.setattr(gluon_ws, "mode", "on")
    assert takes(1)
    monkeypatch.setattr(gluon_ws, "mode", "yes")
    with pytest.raises(ValueError, match="'yes' is not one of"):
        takes(1)


def test_the_environment_sets_the_mode_for_a_served_ab() -> None:
    """MOESERVE_MOE_GLUON_WS is the mode at import (a server's processes take it from
    there); unset, "off". In a fresh interpreter: reloading the module here would unbind the
    jitted helpers fp8_gluon_ws holds."""
    for value, want in ((None, "off"), ("auto", "auto")):
        assert attribute_at_import("moeserve.kernels.moe.gluon_ws", "mode", envs.MOE_GLUON_WS,
                                   value) == want


def test_a_cpu_launch_never_takes_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """The switch on, a CPU op runs Triton's kernel (the interpreter): the same bits as off."""
    if torch.cuda.is_available():
        pytest.skip("the CPU path")
    gen = torch.Generator().manual_seed(0)
    w13 = torch.randn(4, 2 * 64, 64, generator=gen) * 0.1
    w2 = torch.randn(4, 64, 64, generator=gen) * 0.1
    x = torch.randn(5, 64, generator=gen)
    weights, ids = select_experts(torch.randn(5, 4, generator=gen), 2, renormalize=True)
    config = {"BLOCK_M": 128, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 1, "num_warps": 4,
              "num_stages": 2}
    off = moe_triton(x, w13, w2, weights, ids, config=config)
    monkeypatch.setattr(gluon_ws, "mode", "on")
    calls = []
    monkeypatch.setattr(gluon_ws, "launch", lambda *a, **k: calls.append(k))
    assert torch.equal(moe_triton(x, w13, w2, weights, ids, config=config), off)
    assert calls == []


# ------------------------------------------------------------------------------------ GPU

E, H, INTER, TOP_K = 16, 1024, 384, 4  # gated: 3 N tiles, 16 K steps; down: 4 N tiles, 6
CONFIG = {"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 1, "num_warps": 4,
          "num_stages": 3}


@pytest.fixture(scope="module")
def experts() -> dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13 = torch.randn(E, 2 * INTER, H, device="cuda", generator=gen) * H ** -0.5
    w2 = torch.randn(E, H, INTER, device="cuda", generator=gen) * INTER ** -0.5
    return {dtype: (w13.to(dtype), w2.to(dtype)) for dtype in (torch.bfloat16, torch.float16)}


def _inputs(num_tokens: int, seed: int, dtype: torch.dtype, off_rank: bool = False
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x [T, H], topk_weights, topk_ids); off_rank: a quarter of the pairs' ids -1."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(num_tokens, H, device="cuda", generator=gen).to(dtype)
    weights, ids = select_experts(torch.randn(num_tokens, E, device="cuda", generator=gen),
                                  TOP_K, renormalize=True)
    if off_rank:
        ids = torch.where(torch.rand(ids.shape, device="cuda", generator=gen) < 0.25, -1, ids)
    return x, weights, ids


def _spy(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """gluon_ws's mode "on", its launches' `gated` recorded."""
    launches: list[bool] = []
    real = gluon_ws.launch
    monkeypatch.setattr(gluon_ws, "mode", "on")
    monkeypatch.setattr(gluon_ws, "launch",
                        lambda *a, **k: launches.append(k["gated"]) or real(*a, **k))
    return launches


@pytest.mark.gpu
@pytest.mark.skipif(not SM90, reason="needs an sm90 GPU")
@pytest.mark.parametrize("thread_arrive", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_tokens", [1, 300, 2048])
def test_gpu_both_launches_match_triton_and_the_loop(experts: dict, num_tokens: int,
                                                     dtype: torch.dtype, thread_arrive: bool,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Both launches its (one block of mostly padding, several blocks an expert), the stages
    released either way (`arrive_per_thread`); the output within bf16's error of Triton's
    kernel and of the fp32 per-expert loop."""
    monkeypatch.setattr(gluon_ws, "arrive_per_thread", thread_arrive)
    w13, w2 = experts[dtype]
    x, weights, ids = _inputs(num_tokens, seed=num_tokens, dtype=dtype)
    triton_out = moe_triton(x, w13, w2, weights, ids, config=CONFIG).float()
    launches = _spy(monkeypatch)
    out = moe_triton(x, w13, w2, weights, ids, config=CONFIG)
    assert launches == [True, False]
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out.float(), triton_out, atol=2e-2, rtol=2e-2)
    expected = moe_loop_ref(x.float(), w13.float(), w2.float(), weights, ids)
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not SM90, reason="needs an sm90 GPU")
def test_gpu_off_rank_pairs_get_zero_parts(experts: dict,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """-1 pairs (expert parallelism): no launch computes them, their part rows exactly 0; the
    others' parts as Triton's."""
    w13, w2 = experts[torch.bfloat16]
    x, weights, ids = _inputs(700, seed=5, dtype=torch.bfloat16, off_rank=True)
    triton_parts = moe_triton(x, w13, w2, weights, ids, config=CONFIG, reduce=False)
    launches = _spy(monkeypatch)
    parts = moe_triton(x, w13, w2, weights, ids, config=CONFIG, reduce=False)
    assert launches == [True, False]
    assert torch.equal(parts[ids == -1], torch.zeros_like(parts[ids == -1]))
    torch.testing.assert_close(parts.float(), triton_parts.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not SM90, reason="needs an sm90 GPU")
def test_gpu_graph_replay_with_new_routing_equals_eager(experts: dict,
                                                        monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    """Captured in a CUDA graph (no host read of a device value), replayed over new tokens and
    routing: eager's bits."""
    w13, w2 = experts[torch.bfloat16]
    _spy(monkeypatch)
    static = list(_inputs(512, seed=1, dtype=torch.bfloat16))

    def step() -> torch.Tensor:
        return moe_triton(static[0], w13, w2, static[1], static[2], config=CONFIG)

    graph, static_out = capture(step)
    for buf, new in zip(static, _inputs(512, seed=2, dtype=torch.bfloat16)):
        buf.copy_(new)
    graph.replay()
    assert torch.equal(static_out, step())
