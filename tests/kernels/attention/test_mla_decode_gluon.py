"""The Gluon MLA decode (kernels/attention/mla/decode_gluon.py, wgmma) against the dense
expectation of `make_mla_case` and mla_attention_ref: on the GPU (sm90) only, as Gluon has no
interpreter; on CPU, that it refuses the call by name without importing Gluon."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from moeserve.kernels.attention.mla import decode_gluon, decode_gluon_ws, prefill_gluon
from tests.kernels.attention.test_mla import DECODE, make_mla_case
from tests.kernels.attention.test_mla_triton import TOL, gpu_case


def run(case, rows: torch.Tensor | None = None, **kwargs: object) -> torch.Tensor:
    """decode_gluon over a decode-only case (all its rows, or `rows`)."""
    out = torch.zeros_like(case.q_lat[..., :case.L])
    num_rows = case.meta.num_reqs if rows is None else rows.shape[0]
    decode_gluon.decode_gluon(case.q_lat, case.latent_cache, case.meta, case.scale, case.L, out,
                              rows, num_rows, case.meta.max_seq_len, **kwargs)
    return out


def check_routing(monkeypatch: Any, module: Any, function: str, switch: str,
                  want_heads: int, long: bool = False, routed: bool = True) -> None:
    """With decode_gluon's `switch` on, decode_gluon calls of `want_heads` heads run
    `module.function` (`routed`; else they do not) and calls of the other head count (20, or
    64 / want_heads), with a forced tile, or (`long`: the switch's kernel takes long contexts
    only) over short contexts do not; every result equals the dense expectation."""
    calls: list[int] = []
    real = getattr(module, function)
    monkeypatch.setattr(module, function,
                        lambda *a, **k: (calls.append(a[0].shape[1]), real(*a, **k))[1])
    monkeypatch.setattr(decode_gluon, switch, True)
    tol = TOL[torch.bfloat16]
    few = gpu_case(np.random.default_rng(0).integers(1, 2048, 40).tolist(), [1] * 40, 20)
    # max_seq_len 1,024: within WS_SHORT_CONTEXT
    many = gpu_case([300, decode_gluon.WS_SHORT_CONTEXT - 1], [1, 1],
                    64 if want_heads == 20 else want_heads, seed=1)
    chosen, other = (few, many) if want_heads == 20 else (many, few)
    want = [want_heads] if routed else []
    cases = [(chosen, {}, want), (other, {}, []),
             (chosen, {"block_n": 64, "stages": 2}, [])]
    if long:  # the chosen case over contexts past the threshold; the short one stays out
        cases[0] = (gpu_case([300, decode_gluon.WS_SHORT_CONTEXT + 5], [1, 1], want_heads,
                             seed=2), {}, want)
        cases.append((chosen, {}, []))
    for case, kwargs, want in cases:
        calls.clear()
        out = torch.zeros_like(case.q_lat[..., :case.L])
        decode_gluon.decode_gluon(case.q_lat, case.latent_cache, case.meta, case.scale, case.L,
                                  out, None, case.meta.num_reqs, case.meta.max_seq_len, **kwargs)
        assert calls == want, kwargs
        torch.testing.assert_close(out.float(), case.expected_latent, atol=tol, rtol=tol)


def check_rows_fp16_and_graph(decode, extra_kw: Callable[[Any], dict], graph_heads: int
                              ) -> None:
    """A Gluon decode variant `decode(q, cache, meta, scale, L, out, rows, num_rows, **kw)`
    (decode_gluon's contract; extra_kw: its further arguments, given the case): `rows`
    picks decode rows (only their tokens written) in fp16; then, captured once in a CUDA graph
    and replayed with new queries written in place, it equals decode_gluon at `graph_heads`."""
    case = gpu_case([0, 30, 700, 4095, 64, 129], [1] * 6, 20, dtype=torch.float16, seed=3)
    rows = torch.tensor([4, 1, 3], dtype=torch.int32, device="cuda")
    out = torch.zeros_like(case.q_lat[..., :case.L])
    decode(case.q_lat, case.latent_cache, case.meta, case.scale, case.L, out, rows, 3,
           **extra_kw(case))
    tol = TOL[torch.bfloat16]
    picked = case.meta.query_start_loc[rows.long()].long()
    torch.testing.assert_close(out[picked].float(), case.expected_latent[picked], atol=tol,
                               rtol=tol)
    others = torch.ones(out.shape[0], dtype=torch.bool, device="cuda")
    others[picked] = False
    assert (out[others] == 0).all()
    case = gpu_case([100, 2000, 37, 500], [1] * 4, graph_heads, seed=5)
    out = torch.zeros_like(case.q_lat[..., :case.L])
    args = (case.q_lat, case.latent_cache, case.meta, case.scale, case.L, out, None, 4)
    decode(*args, **extra_kw(case))  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode(*args, **extra_kw(case))
    for seed in range(2):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        case.q_lat.copy_(torch.randn(case.q_lat.shape, generator=gen, device="cuda"))
        graph.replay()
        want = torch.zeros_like(out)
        decode_gluon.decode_gluon(case.q_lat, case.latent_cache, case.meta, case.scale, case.L,
                                  want, None, 4, case.meta.max_seq_len)
        torch.testing.assert_close(out.float(), want.float(), atol=tol, rtol=tol)


def gpu_sparse_inputs(num_heads: int) -> tuple:
    """DSA's sparse attention inputs on the GPU: (q, latent cache, meta, positions) of a mixed
    step's indexer selection (2,048 positions, -1 padding on a long prefill's first queries)."""
    from moeserve.kernels.attention.dsa.indexer_triton import indexer_topk_triton
    from tests.kernels.attention.test_dsa_triton import _latents, make_step
    from tests.kernels.attention.test_dsa_triton_gpu import (
        GPU_BLOCK,
        GPU_INDEXER,
        GPU_TOPK,
        _gpu_steps,
    )

    step = make_step(*_gpu_steps()["mixed"], GPU_BLOCK, dtype=torch.bfloat16, **GPU_INDEXER)
    positions, _ = indexer_topk_triton(step.q, step.w, step.cache, step.meta, 0.1, GPU_TOPK)
    q, latent = _latents(step.meta, num_heads, torch.bfloat16, "cuda", width=576)
    return q, latent, step.meta, positions


def test_refuses_what_it_cannot_take_by_name() -> None:
    case = make_mla_case(*DECODE, block_size=4, num_heads=5)
    assert not decode_gluon.supports(case.q_lat, case.latent_cache, case.L)
    with pytest.raises(ValueError, match="decode_gluon needs an sm90 GPU"):
        run(case)
    with pytest.raises(ValueError, match="decode_gluon needs an sm90 GPU"):
        prefill_gluon.prefill_gluon(case.q_lat, case.latent_cache, case.meta, case.scale,
                                   case.L, torch.empty_like(case.q_lat[..., :case.L]),
                                   case.meta.query_start_loc, 1)


def test_decode_kernel_names_the_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    """decode_kernel (decode_gluon's dispatch, and kernels_mla's name for a served row): the
    swapped kernel to 32 heads, the warp-specialized one past WS_SHORT_CONTEXT keys where it
    takes the call, this module's at a tile not the default or with the switches off."""
    q20, q64, cache = torch.empty(2, 20, 576), torch.empty(2, 64, 576), torch.empty(4, 16, 576)
    short, long = decode_gluon.WS_SHORT_CONTEXT, decode_gluon.WS_SHORT_CONTEXT + 1
    monkeypatch.setattr(decode_gluon, "swapped", True)
    monkeypatch.setattr(decode_gluon, "ws", True)
    monkeypatch.setattr(decode_gluon_ws, "takes", lambda q, c, L: True)  # as on an sm90 GPU
    monkeypatch.setattr(decode_gluon_ws, "min_heads", lambda device: 64)
    assert decode_gluon.decode_kernel(q20, cache, 512, long) == "swapped"
    assert decode_gluon.decode_kernel(q64, cache, 512, long) == "ws"
    assert decode_gluon.decode_kernel(q64, cache, 512, short) == "gluon"
    assert decode_gluon.decode_kernel(q20, cache, 512, long, default_tile=False) == "gluon"
    assert decode_gluon.decode_kernel(q64, cache, 512, long, default_tile=False) == "gluon"
    monkeypatch.setattr(decode_gluon, "swapped", False)
    monkeypatch.setattr(decode_gluon, "ws", False)
    assert decode_gluon.decode_kernel(q20, cache, 512, long) == "gluon"
    assert decode_gluon.decode_kernel(q64, cache, 512, long) == "gluon"


@pytest.mark.parametrize(("num_heads", "want"), [(20, (1, 20, 3)), (16, (1, 16, 4)),
                                                 (64, (1, 64, 1)), (128, (2, 64, 1)),
                                                 (96, (2, 48, 1))])
def test_prefill_tiles(num_heads: int, want: tuple) -> None:
    """(head tiles, heads a tile, tokens a tile): as many tokens as fill 64 query rows."""
    assert prefill_gluon.prefill_block_q(num_heads) == want


def test_cpu_prefill_gluon_falls_back_to_the_triton_prefill(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Where decode_gluon does not take the inputs (here a CPU) prefill_gluon=True runs the
    Triton prefill: the same output; MOESERVE_MLA_PREFILL_GLUON=1 is what asks for it in
    serving (the MLA layer's backend arguments)."""
    from moeserve.kernels.attention.mla.absorbed_triton import mla_attention_triton
    from tests.kernels.attention.test_mla import MIXED

    case = make_mla_case(*MIXED)
    args = (case.q_lat, case.latent_cache, case.meta, case.scale, case.L)
    torch.testing.assert_close(mla_attention_triton(*args, prefill_gluon=True),
                               mla_attention_triton(*args))


@pytest.mark.gpu
def test_gpu_overlap_needs_three_stages() -> None:
    case = gpu_case([100], [1], 20)
    with pytest.raises(ValueError, match="overlap needs stages >= 3, got 2"):
        run(case, overlap=True, stages=2)


@pytest.mark.gpu
@pytest.mark.parametrize("num_heads", [16, 20, 64, 128])
@pytest.mark.parametrize(("batch", "max_context"), [(4, 4096), (64, 2048), (128, 256)])
def test_gpu_decode_matches(num_heads: int, batch: int, max_context: int) -> None:
    rng = np.random.default_rng(batch)
    computed = rng.integers(1, max_context, batch).tolist()
    computed[0] = max_context - 1
    case = gpu_case(computed, [1] * batch, num_heads, seed=batch)
    tol = TOL[torch.bfloat16]
    ref = case.expected_latent
    for kwargs in ({}, {"num_splits": 1}, {"num_splits": 3}, {"block_n": 64, "stages": 2},
                   {"block_n": 16, "stages": 4}, {"overlap": True},
                   {"overlap": True, "num_splits": 3, "block_n": 16, "stages": 4}):
        out = run(case, **kwargs)
        assert not out.isnan().any(), kwargs
        torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol, msg=str(kwargs))


@pytest.mark.gpu
def test_gpu_fp16_and_chosen_rows() -> None:
    """fp16; `rows` picks decode rows (the mixed step's contract): only their tokens written;
    contexts of 1 key, of a partial tile and of several partitions."""
    case = gpu_case([0, 30, 700, 4095, 64], [1] * 5, 20, dtype=torch.float16, seed=3)
    out = run(case)
    torch.testing.assert_close(out.float(), case.expected_latent, atol=TOL[torch.float16],
                               rtol=TOL[torch.float16])
    rows = torch.tensor([3, 1], dtype=torch.int32, device="cuda")
    picked = run(case, rows=rows, num_splits=2, overlap=True)
    tokens = case.meta.query_start_loc[rows.long()].long()
    torch.testing.assert_close(picked[tokens].float(), case.expected_latent[tokens],
                               atol=TOL[torch.float16], rtol=TOL[torch.float16])
    others = torch.ones(out.shape[0], dtype=torch.bool, device="cuda")
    others[tokens] = False
    assert not picked[others].any()


@pytest.mark.gpu
def test_gpu_replays_in_a_cuda_graph() -> None:
    case = gpu_case([100, 2000, 37], [1] * 3, 64, seed=5)
    out = run(case)  # compiled outside the capture
    graph_out = torch.zeros_like(out)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode_gluon.decode_gluon(case.q_lat, case.latent_cache, case.meta, case.scale, case.L,
                                  graph_out, None, case.meta.num_reqs, case.meta.max_seq_len,
                                  num_splits=2)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(graph_out.float(), case.expected_latent,
                               atol=TOL[torch.bfloat16], rtol=TOL[torch.bfloat16])


@pytest.mark.gpu
@pytest.mark.parametrize("num_heads", [20, 64, 128])
def test_gpu_sparse_matches_the_reference(num_heads: int, no_tf32: None) -> None:
    """sparse_gluon: L 512, R 64 over 2,048 selected positions (-1 padding on a 2,500-token
    prefill's first queries) against dsa_attention_ref, unpacked and packed, split or not."""
    from moeserve.kernels.attention.dsa.reference import dsa_attention_ref

    q, latent, meta, positions = gpu_sparse_inputs(num_heads)
    want = dsa_attention_ref(q, latent, meta, positions, 576 ** -0.5, 512).float()
    tol = TOL[torch.bfloat16]
    for kwargs in ({}, {"packed": True}, {"packed": True, "num_splits": 4},
                   {"packed": True, "overlap": True}, {"block_n": 64, "stages": 2}):
        got = decode_gluon.sparse_gluon(q, latent, meta, positions, 576 ** -0.5, 512, **kwargs)
        torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol, msg=str(kwargs))


@pytest.mark.gpu
def test_gpu_the_triton_launcher_takes_the_gluon_form() -> None:
    """mla_attention_triton(decode_form="gluon") (the engine's mla_decode="gluon") on a mixed
    step: its decode rows through decode_gluon, its prefill rows through the Triton prefill."""
    from moeserve.kernels.attention.mla.absorbed_triton import mla_attention_triton

    case = gpu_case([300, 0, 2000, 37], [1, 64, 1, 1], 20, seed=7)
    out = mla_attention_triton(case.q_lat, case.latent_cache, case.meta, case.scale, case.L,
                               decode_form="gluon")
    torch.testing.assert_close(out.float(), case.expected_latent, atol=TOL[torch.bfloat16],
                               rtol=TOL[torch.bfloat16])


@pytest.mark.gpu
def test_gpu_auto_takes_gluon_unless_a_triton_tile_or_split_is_forced(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """On sm90 in bf16 the launcher's "auto" runs decode_gluon, and DSA's sparse attention
    sparse_gluon; a forced Triton tile, split count or gluon=False keeps the Triton kernels.
    Each result equals the expectation."""
    from moeserve.kernels.attention.dsa import sparse_triton
    from moeserve.kernels.attention.mla import absorbed_triton

    calls: list[str] = []
    for name in ("decode_gluon", "sparse_gluon"):
        real = getattr(decode_gluon, name)
        monkeypatch.setattr(decode_gluon, name,
                            lambda *a, _real=real, _name=name, **k: (calls.append(_name),
                                                                     _real(*a, **k))[1])
    case = gpu_case([300, 0, 2000, 37], [1, 64, 1, 1], 20, seed=11)
    tol = TOL[torch.bfloat16]
    for kwargs, want in (({}, ["decode_gluon"]), ({"decode_splits": 2}, []),
                         ({"decode_config": absorbed_triton.default_config(
                             "decode", case.L, torch.bfloat16, 20)}, [])):
        calls.clear()
        out = absorbed_triton.mla_attention_triton(case.q_lat, case.latent_cache, case.meta,
                                                   case.scale, case.L, **kwargs)
        assert calls == want, kwargs
        torch.testing.assert_close(out.float(), case.expected_latent, atol=tol, rtol=tol)
    decode = gpu_case([500, 900], [1, 1], 64, seed=12)
    positions = torch.tensor([[0, 3, 7, 499], [5, 6, 700, 899]], dtype=torch.int32,
                             device="cuda")
    outs = {}
    for gluon, want in ((None, ["sparse_gluon"]), (False, [])):
        calls.clear()
        outs[gluon] = sparse_triton.dsa_attention_triton(
            decode.q_lat, decode.latent_cache, decode.meta, positions, decode.scale,
            decode.L, packed=True, gluon=gluon)
        assert calls == want, gluon
    torch.testing.assert_close(outs[None].float(), outs[False].float(), atol=tol, rtol=tol)


@pytest.mark.gpu
@pytest.mark.parametrize("num_heads", [16, 20, 64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_prefill_matches(num_heads: int, dtype: torch.dtype,
                             monkeypatch: pytest.MonkeyPatch) -> None:
    """prefill_gluon through the Triton launcher (prefill_gluon=True, and by default; False:
    the Triton prefill) on a mixed step: fresh prompts, prefix hits, chunks ending in a partial
    query tile, one-token chunks and a decode row, each token over its causal context; equal
    to the dense expectation."""
    from moeserve.kernels.attention.mla.absorbed_triton import mla_attention_triton

    calls: list[int] = []
    real = prefill_gluon.prefill_gluon
    monkeypatch.setattr(prefill_gluon, "prefill_gluon",
                        lambda *a, **k: (calls.append(a[-1]), real(*a, **k))[1])
    case = gpu_case([0, 0, 512, 1000, 37, 300, 64], [128, 700, 256, 77, 300, 1, 2], num_heads,
                    dtype=dtype, seed=num_heads)
    block_q = prefill_gluon.prefill_block_q(num_heads)[2]
    tiles = sum(-(-n // block_q) for n in (128, 700, 256, 77, 300, 2))
    tol = TOL[torch.bfloat16]
    for kwargs, want in (({"prefill_gluon": True}, [tiles]), ({}, [tiles]),
                         ({"prefill_gluon": False}, [])):
        calls.clear()
        out = mla_attention_triton(case.q_lat, case.latent_cache, case.meta, case.scale,
                                   case.L, **kwargs)
        assert calls == want, kwargs
        assert not out.isnan().any()
        torch.testing.assert_close(out.float(), case.expected_latent, atol=tol, rtol=tol)


def _glm_layer(backend, preset: str = "glm-4.7-flash"):
    """Layer 0's MLAttention of a preset, on the meta device (its shapes only)."""
    from moeserve.layers.mla import MLAttention
    from moeserve.model_config import ModelConfig
    from moeserve.presets import load_preset

    return MLAttention(0, ModelConfig.from_hf(load_preset(preset)), backend, torch.bfloat16,
                       "meta")


@pytest.mark.parametrize("env", [None, "0", "1"])
def test_layer_keeps_the_triton_prefill_only_when_the_switch_is_off(
        env: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """MOESERVE_MLA_PREFILL_GLUON=0 (envs.py) adds prefill_gluon=False to the Triton backend's
    arguments, kept through a decode form set after; never for the torch reference. Over a
    CPU cache "auto" absorbs rows up to AUTO_ABSORBED_MAX_CONTEXT."""
    from moeserve import envs
    from moeserve.kernels.attention.mla.absorbed_triton import mla_attention_triton
    from moeserve.kernels.attention.mla.reference import mla_attention_ref
    from moeserve.layers.mla import AUTO_ABSORBED_MAX_CONTEXT

    if env is None:
        monkeypatch.delenv(envs.MLA_PREFILL_GLUON, raising=False)
    else:
        monkeypatch.setenv(envs.MLA_PREFILL_GLUON, env)
    layer = _glm_layer(mla_attention_triton)
    want = {"prefill_gluon": False} if env == "0" else {}
    assert layer.decode_kwargs == want
    layer.set_decode_form("split")
    assert layer.decode_kwargs == {"decode_form": "split", **want}
    assert _glm_layer(mla_attention_ref).decode_kwargs == {}
    layer.kv_cache = torch.zeros(2, 16, 576, dtype=torch.bfloat16)
    assert layer.absorbed_max_context() == AUTO_ABSORBED_MAX_CONTEXT
    layer.auto_max_context = 77  # a set limit wins
    assert layer.absorbed_max_context() == 77


def test_layer_names_the_ws_bound_for_its_decode_graphs(monkeypatch: pytest.MonkeyPatch
                                                       ) -> None:
    """An MLA layer's `decode_kernel_bounds` (what the decode CUDA graphs capture a bound at):
    decode_gluon.WS_SHORT_CONTEXT for GLM-5's 64 heads under the Triton backend over a cache
    decode_gluon takes (stubbed on CPU; an H200), in "auto" and "gluon" forms; none without a cache,
    for GLM-4.7-Flash's 20 heads (the swapped kernel), in the split form, or under the torch
    reference."""
    from moeserve.kernels.attention.mla.absorbed_triton import mla_attention_triton
    from moeserve.kernels.attention.mla.reference import mla_attention_ref

    monkeypatch.setattr(decode_gluon, "supports_cache", lambda c, L: True)
    monkeypatch.setattr(decode_gluon_ws, "_device_name", lambda index: "NVIDIA H200")
    monkeypatch.setattr(decode_gluon, "ws", True)
    cache = torch.zeros(2, 16, 576, dtype=torch.bfloat16)
    layer = _glm_layer(mla_attention_triton, "glm-5")
    assert layer.decode_kernel_bounds() == {}  # no cache bound yet
    layer.kv_cache = cache
    assert list(layer.decode_kernel_bounds()) == [decode_gluon.WS_SHORT_CONTEXT]
    layer.set_decode_form("gluon")
    assert list(layer.decode_kernel_bounds()) == [decode_gluon.WS_SHORT_CONTEXT]
    layer.set_decode_form("split")
    assert layer.decode_kernel_bounds() == {}
    for other in (_glm_layer(mla_attention_triton), _glm_layer(mla_attention_ref, "glm-5")):
        other.kv_cache = cache
        assert other.decode_kernel_bounds() == {}


@pytest.mark.gpu
def test_gpu_auto_absorbs_longer_rows_where_the_prefill_runs_in_gluon(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Over a bf16 cache on sm90 "auto"'s absorbed limit is GLUON_ABSORBED_MAX_CONTEXT (8,192,
    at GLM's shapes and DeepSeek-V3's); an fp8 cache, the torch
    reference or the switch off keep AUTO_ABSORBED_MAX_CONTEXT."""
    from moeserve import envs
    from moeserve.kernels.attention.mla.absorbed_triton import mla_attention_triton
    from moeserve.kernels.attention.mla.reference import mla_attention_ref
    from moeserve.layers.mla import AUTO_ABSORBED_MAX_CONTEXT

    monkeypatch.delenv(envs.MLA_PREFILL_GLUON, raising=False)
    cache = torch.zeros(2, 16, 576, dtype=torch.bfloat16, device="cuda")
    for preset, want in (("glm-4.7-flash", 8192), ("glm-5", 8192), ("deepseek-v3", 8192)):
        layer = _glm_layer(mla_attention_triton, preset)
        layer.kv_cache = cache
        assert layer.absorbed_max_context() == want, preset
        layer.kv_cache = cache.to(torch.float8_e4m3fn)
        assert layer.absorbed_max_context() == AUTO_ABSORBED_MAX_CONTEXT, preset
    ref = _glm_layer(mla_attention_ref)
    ref.kv_cache = cache
    assert ref.absorbed_max_context() == AUTO_ABSORBED_MAX_CONTEXT
    monkeypatch.setenv(envs.MLA_PREFILL_GLUON, "0")
    off = _glm_layer(mla_attention_triton)
    off.kv_cache = cache
    assert off.absorbed_max_context() == AUTO_ABSORBED_MAX_CONTEXT


def test_the_capacity_report_names_the_mla_kernels_that_run() -> None:
    """mla_decode_line: the form as set, with the kernels that run here (the Triton ones on a
    CPU; none named under the torch reference)."""
    from moeserve.config import EngineConfig
    from moeserve.runner.capacity import mla_decode_line

    cpu = torch.device("cpu")
    line = mla_decode_line(EngineConfig(attention_backend="triton"), cpu, torch.bfloat16)
    assert line.startswith("auto (Triton")
    assert mla_decode_line(EngineConfig(attention_backend="torch"), cpu, torch.bfloat16) == "auto"
    assert mla_decode_line(EngineConfig(attention_backend="triton", mla_decode="split"), cpu,
                           torch.bfloat16) == "split"


@pytest.mark.gpu
def test_gpu_the_capacity_report_names_gluon_on_sm90(monkeypatch: pytest.MonkeyPatch) -> None:
    from moeserve import envs
    from moeserve.config import CacheConfig, EngineConfig
    from moeserve.runner.capacity import mla_decode_line

    monkeypatch.delenv(envs.MLA_PREFILL_GLUON, raising=False)
    monkeypatch.setattr(decode_gluon, "swapped", True)  # the defaults
    monkeypatch.setattr(decode_gluon, "ws", False)
    monkeypatch.setattr(decode_gluon, "ws_sparse", False)
    cfg = EngineConfig(attention_backend="triton")
    cuda = torch.device("cuda")
    assert mla_decode_line(cfg, cuda, torch.bfloat16) == "auto (Gluon on sm90's wgmma)"
    assert "Triton" in mla_decode_line(cfg, cuda, torch.float32)
    fp8 = EngineConfig(attention_backend="triton", cache=CacheConfig(kv_cache_dtype="fp8"))
    assert "Triton" in mla_decode_line(fp8, cuda, torch.bfloat16)
    monkeypatch.setenv(envs.MLA_PREFILL_GLUON, "0")
    assert "prefill rows in Triton" in mla_decode_line(cfg, cuda, torch.bfloat16)
    monkeypatch.setattr(decode_gluon, "swapped", False)  # the A/B switch, named when set
    assert "not swapped" in mla_decode_line(cfg, cuda, torch.bfloat16)
    monkeypatch.setattr(decode_gluon, "ws", True)  # the warp-specialized decode, when on
    assert "warp-specialized past" in mla_decode_line(cfg, cuda, torch.bfloat16)
    monkeypatch.setattr(decode_gluon, "ws_sparse", True)  # ... and DSA's sparse MLA on it
    assert "DSA's sparse MLA warp-specialized" in mla_decode_line(cfg, cuda, torch.bfloat16)
