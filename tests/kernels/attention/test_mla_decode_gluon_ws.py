"""The warp-specialized Gluon MLA decode (kernels/attention/mla/decode_gluon_ws.py: one
warpgroup a tile's scores and softmax, the other half of P V) against the dense expectation of
`make_mla_case`: on the GPU (sm90) only, as Gluon has no interpreter; on CPU, that it refuses
the call by name and that the switch leaves calls alone while it is off."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moeserve import envs
from moeserve.kernels.attention.mla import decode_gluon, decode_gluon_ws
from moeserve.kernels.attention.mla.decode_gluon_ws import decode_ws
from tests.kernels.attention.test_mla import DECODE, make_mla_case
from tests.kernels.attention.test_mla_decode_gluon import (
    check_routing,
    check_rows_fp16_and_graph,
    gpu_sparse_inputs,
)
from tests.kernels.attention.test_mla_triton import TOL, gpu_case


def run(case, rows: torch.Tensor | None = None, **kwargs: object) -> torch.Tensor:
    """decode_ws over a decode-only case (all its rows, or `rows`)."""
    out = torch.zeros_like(case.q_lat[..., :case.L])
    num_rows = case.meta.num_reqs if rows is None else rows.shape[0]
    decode_ws(case.q_lat, case.latent_cache, case.meta, case.scale, case.L, out, rows,
              num_rows, case.meta.max_seq_len, **kwargs)
    return out


def test_refuses_what_it_cannot_take_by_name() -> None:
    case = make_mla_case(*DECODE, block_size=4, num_heads=5)
    assert not decode_gluon_ws.takes(case.q_lat, case.latent_cache, case.L)
    with pytest.raises(ValueError, match="decode_ws needs an sm90 GPU"):
        run(case)


def test_the_switch_is_on_by_default_and_names_its_context_bound(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """On unless MOESERVE_MLA_DECODE_WS=0; `kernel_bounds` names WS_SHORT_CONTEXT for a cache
    it takes (a CPU cache: the sm90 check stubbed) at 64 heads and more on an H200, 128 on an
    H100 or another device, not at 20 heads, not at another latent shape, not with the switch
    off."""
    assert decode_gluon.ws is True and decode_gluon.WS_SHORT_CONTEXT == 1024
    monkeypatch.setenv("MOESERVE_MLA_DECODE_WS", "0")
    assert envs.mla_decode_ws() is False
    monkeypatch.delenv("MOESERVE_MLA_DECODE_WS")
    assert envs.mla_decode_ws() is True
    cache = torch.zeros(2, 4, 576, dtype=torch.bfloat16)
    assert decode_gluon.kernel_bounds(64, cache, 512) == {}  # on CPU: no Gluon decode at all
    monkeypatch.setattr(decode_gluon, "supports_cache", lambda c, L: True)
    monkeypatch.setattr(decode_gluon_ws, "_device_name", lambda index: "NVIDIA H200")
    assert list(decode_gluon.kernel_bounds(64, cache, 512)) == [1024]
    assert list(decode_gluon.kernel_bounds(128, cache, 512)) == [1024]
    for name in ("NVIDIA H100 80GB HBM3", "NVIDIA H800", "a device not named"):
        monkeypatch.setattr(decode_gluon_ws, "_device_name", lambda index, name=name: name)
        assert decode_gluon.kernel_bounds(64, cache, 512) == {}, name
        assert list(decode_gluon.kernel_bounds(128, cache, 512)) == [1024], name
    monkeypatch.setattr(decode_gluon_ws, "_device_name", lambda index: "NVIDIA H200")
    assert decode_gluon.kernel_bounds(20, cache, 512) == {}  # the swapped kernel's heads
    assert decode_gluon.kernel_bounds(64, torch.zeros(2, 4, 320), 256) == {}  # L 256, R 64
    monkeypatch.setattr(decode_gluon, "ws", False)
    assert decode_gluon.kernel_bounds(64, cache, 512) == {}


@pytest.fixture(params=["one_pv", "two_pv"])
def ws_form(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both forms: one P V warpgroup beside the scores warpgroup's half of P V, and two P V
    warpgroups (O's halves) beside a scores warpgroup doing none."""
    monkeypatch.setattr(decode_gluon_ws, "two_pv", request.param == "two_pv")
    return request.param


@pytest.mark.gpu
@pytest.mark.parametrize("num_heads", [64, 128, 40])
@pytest.mark.parametrize(("batch", "max_context"), [(4, 4096), (64, 2048), (300, 256)])
def test_gpu_decode_matches(num_heads: int, batch: int, max_context: int,
                            ws_form: str) -> None:
    """Rows of 1 key to many tiles (an odd and an even count of tiles: the stages' phases),
    with the default split count (one wave) and forced ones (1: unsplit; 3: partitions of
    unequal tiles; 40: partitions past a short row's end, which compute nothing)."""
    rng = np.random.default_rng(batch)
    computed = rng.integers(0, max_context, batch).tolist()
    computed[0] = max_context - 1
    case = gpu_case(computed, [1] * batch, num_heads, seed=batch)
    tol = TOL[torch.bfloat16]
    for splits in (None, 1, 3, 40):
        out = run(case, num_splits=splits)
        assert not out.isnan().any(), splits
        torch.testing.assert_close(out.float(), case.expected_latent, atol=tol, rtol=tol,
                                   msg=f"splits {splits}")


@pytest.mark.gpu
def test_gpu_chosen_rows_fp16_and_a_cuda_graph(ws_form: str) -> None:
    """Chosen rows in fp16, then a CUDA graph's replays, equal to decode_gluon's result."""
    check_rows_fp16_and_graph(decode_ws, lambda case: {"max_seq_len": case.meta.max_seq_len},
                              128)


@pytest.mark.gpu
def test_gpu_the_switch_routes_many_head_launches(monkeypatch: pytest.MonkeyPatch) -> None:
    """decode_gluon.ws on: a decode_gluon call of the device's WS_MIN_HEADS (64 on an H200,
    128 on an H100) whose longest row has more than WS_SHORT_CONTEXT keys runs this kernel; 20
    heads (the swapped kernel's), a forced tile, or those heads over at most WS_SHORT_CONTEXT
    keys do not; on a device that keeps 64 heads off it, 64 heads do not."""
    heads = 64 if decode_gluon_ws.takes_heads(64, torch.device("cuda")) else 128
    check_routing(monkeypatch, decode_gluon_ws, "decode_ws", "ws", heads, long=True)
    if heads == 128:
        check_routing(monkeypatch, decode_gluon_ws, "decode_ws", "ws", 64, long=True,
                      routed=False)


@pytest.mark.gpu
@pytest.mark.parametrize("slots_by_pv", [False, True])
@pytest.mark.parametrize("num_heads", [64, 128])
def test_gpu_sparse_matches_the_reference(num_heads: int, slots_by_pv: bool, ws_form: str,
                                          no_tf32: None,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """DSA's sparse MLA by this kernel (decode_gluon.ws_sparse: sparse_gluon routes to
    sparse_ws) over 2,048 selected positions (-1 padding on a long prefill's first queries)
    against dsa_attention_ref, unpacked and packed, split or not, with each tile's cache rows
    loaded by the scores warpgroup or left in shared memory by the P V one (slots_by_pv);
    with the switch off, sparse_ws is not called."""
    from moeserve.kernels.attention.dsa.reference import dsa_attention_ref

    monkeypatch.setattr(decode_gluon_ws, "slots_by_pv", slots_by_pv)

    calls: list[int] = []
    real = decode_gluon_ws.sparse_ws
    monkeypatch.setattr(decode_gluon_ws, "sparse_ws",
                        lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    q, latent, meta, positions = gpu_sparse_inputs(num_heads)
    want = dsa_attention_ref(q, latent, meta, positions, 576 ** -0.5, 512).float()
    tol = TOL[torch.bfloat16]
    monkeypatch.setattr(decode_gluon, "ws_sparse", True)
    for kwargs in ({}, {"packed": True}, {"packed": True, "num_splits": 4},
                   {"num_splits": 1}):
        calls.clear()
        got = decode_gluon.sparse_gluon(q, latent, meta, positions, 576 ** -0.5, 512, **kwargs)
        assert calls == [1], kwargs
        torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol, msg=str(kwargs))
    monkeypatch.setattr(decode_gluon, "ws_sparse", False)
    calls.clear()
    decode_gluon.sparse_gluon(q, latent, meta, positions, 576 ** -0.5, 512)
    assert calls == []
