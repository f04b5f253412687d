"""Triton absorbed MLA against the torch reference and the dense per-row expectation of
`make_mla_case`: CPU through Triton's interpreter (fp32, fp16, tiny shapes: L 32, R 16), and
the GPU (production dims L 512, R 64, H 16 and 128, block 64; bf16 and fp32, one case inside a
CUDA graph). bf16 runs on the GPU only: Triton's interpreter loads bf16 wrongly.

Without a GPU, tests/conftest.py turns Triton's interpreter on before anything imports triton.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from moeserve.kernels.attention.metadata import build_attention_metadata
from moeserve.kernels.attention.mla.absorbed_triton import (
    TileConfig,
    decode_num_splits,
    head_tiles,
    mla_attention_triton,
)
from moeserve.kernels.attention.mla.reference import mla_attention_ref
from tests.kernels.attention.test_mla import DECODE, MIXED, MlaCase, make_mla_case

TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}
LONG_DECODE = ([4, 9, 300, 0, 15], [1] * 5)  # 301 keys > one 256-token partition: split-K
REPO = Path(__file__).resolve().parents[3]


def check(case: MlaCase, tol: float | None = None, **kwargs: object) -> torch.Tensor:
    """Triton output == the dense expectation and mla_attention_ref (in q's dtype)."""
    tol = TOL[case.q_lat.dtype] if tol is None else tol
    out = mla_attention_triton(case.q_lat, case.latent_cache, case.meta, case.scale, case.L,
                               **kwargs)
    assert out.shape == case.expected_latent.shape and out.dtype == case.q_lat.dtype
    assert out.is_contiguous() and not out.isnan().any()
    torch.testing.assert_close(out.float(), case.expected_latent, atol=tol, rtol=tol)
    ref = mla_attention_ref(case.q_lat, case.latent_cache, case.meta, case.scale, case.L)
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    return out


# ---------------------------------------------------------------- CPU, Triton's interpreter

@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("num_heads", [4, 5])
def test_mixed_step(block_size: int, num_heads: int) -> None:
    check(make_mla_case(*MIXED, block_size=block_size, num_heads=num_heads))


@pytest.mark.parametrize("block_size", [4, 16])
def test_pure_decode(block_size: int) -> None:
    for form in ("split", "flat"):
        check(make_mla_case(*DECODE, block_size=block_size, num_heads=5), decode_form=form)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_long_decode_splits_the_context(dtype: torch.dtype) -> None:
    assert decode_num_splits(5, 1, 301, torch.device("cpu")) > 1
    check(make_mla_case(*LONG_DECODE, block_size=16, dtype=dtype), decode_form="split")


def test_decode_splits_aim_at_two_programs_an_sm() -> None:
    """MLA's heavy decode programs (one an SM): partitions up to two waves of them, none
    shorter than 256 keys, at most 64; off CUDA as on an H200's 132 SMs."""
    cpu = torch.device("cpu")
    assert decode_num_splits(256, 1, 8192, cpu) == 1  # 256 programs already
    assert decode_num_splits(128, 1, 32768, cpu) == 2
    assert decode_num_splits(32, 1, 65536, cpu) == 8  # 256 programs
    assert decode_num_splits(32, 1, 2048, cpu) == 8  # DSA's 2,048 selected keys
    assert decode_num_splits(64, 2, 4096, cpu) == 2  # 128 heads: two head tiles a row
    assert decode_num_splits(5, 1, 301, cpu) == 2  # by length: 256-key partitions
    assert decode_num_splits(1, 1, 10 ** 6, cpu) == 64  # at most MAX_SPLITS
    assert decode_num_splits(2048, 2, 100, cpu) == 1


def test_gluon_decode_splits_aim_at_one_wave() -> None:
    """decode_gluon's split count (its DECODE_WAVES, 1): at most one program an SM."""
    from moeserve.kernels.attention.mla import decode_gluon

    cpu = torch.device("cpu")
    waves = decode_gluon.DECODE_WAVES
    assert waves == 1
    assert decode_num_splits(32, 1, 2048, cpu, waves=waves) == 4  # 128 programs, not 256
    assert decode_num_splits(4, 1, 16384, cpu, waves=waves) == 33  # 132: exactly one wave
    assert decode_num_splits(256, 1, 8192, cpu, waves=waves) == 1
    assert decode_num_splits(5, 1, 301, cpu, waves=waves) == 2  # the length still limits


@pytest.mark.parametrize("splits", [1, 3, 8, 64])
def test_decode_forced_splits_incl_empty_partitions(splits: int) -> None:
    # 8 partitions of 48 tokens: the short rows leave most of theirs empty; 64 is MAX_SPLITS
    check(make_mla_case([4, 9, 370, 0, 63], [1] * 5, block_size=16), decode_splits=splits)


def test_decode_splits_outside_the_reduce_are_refused() -> None:
    case = make_mla_case([40, 9], [1, 1], block_size=16)
    for splits in (0, 65):
        with pytest.raises(ValueError, match="decode_splits must be in 1..64"):
            mla_attention_triton(case.q_lat, case.latent_cache, case.meta, case.scale, case.L,
                                 decode_splits=splits)


def test_heads_not_a_power_of_two_in_several_tiles() -> None:
    # 20 heads at block_m 16: two tiles of 10 heads (decode) and of 1 token x 10 heads (prefill)
    assert head_tiles(20, 16) == (2, 10)
    case = make_mla_case([0, 30, 7], [6, 1, 3], block_size=4, num_heads=20)
    check(case, decode_splits=2)


def test_decode_attends_past_a_stale_max_seq_len() -> None:
    # a CUDA graph captured at a shorter max_seq_len: the last partition runs to seq_len
    case = make_mla_case([3, 200, 77], [1] * 3, block_size=16)
    expected = check(case, decode_form="split")
    stale = replace(case.meta, max_seq_len=40)
    for splits in (None, 4):
        out = mla_attention_triton(case.q_lat, case.latent_cache, stale, case.scale, case.L,
                                   decode_splits=splits, decode_form="split")
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_prefill_fresh_and_after_a_prefix(dtype: torch.dtype) -> None:
    # queries start mid-context, not aligned to blocks or tiles
    check(make_mla_case([0, 0, 8, 37], [7, 23, 5, 20], block_size=4, dtype=dtype))


def test_a_register_capped_decode_tile_runs() -> None:
    """TileConfig.maxnreg goes to the decode launch (the interpreter drops the option)."""
    check(make_mla_case([5, 40, 17], [1, 1, 1], block_size=4),
          decode_config=TileConfig(16, 16, 2, 1, 128))


def test_prefill_config_sets_the_tiles() -> None:
    # block_m 8 and 32 over 4 heads: 2 and 8 query tokens per program, both cached on the meta
    case = make_mla_case([0, 6, 3], [9, 14, 1], block_size=4)
    for cfg in (TileConfig(8, 16, 1, 1), TileConfig(32, 32, 4, 1)):
        check(case, prefill_config=cfg)
    assert {k[1] for k in case.meta.derived if k[0] == "mla_attention_triton"} == {2, 8}


def test_mixed_step_rows_are_split_once_per_step() -> None:
    """The row split (a host-to-device copy) is made by a step's first layer and reused."""
    case = make_mla_case(*MIXED, block_size=16)
    first = check(case)
    assert [k[0] for k in case.meta.derived] == ["mla_attention_triton"]
    cached = dict(case.meta.derived)
    second = check(case)
    assert all(case.meta.derived[k] is v for k, v in cached.items())
    torch.testing.assert_close(first, second, atol=0, rtol=0)


def test_strided_q_and_single_token() -> None:
    case = make_mla_case([0, 20], [1, 6])
    t, h, d = case.q_lat.shape
    fused = torch.randn(t, h + 2, d)  # q as a strided view of a wider buffer
    fused[:, :h] = case.q_lat
    case.q_lat = fused[:, :h]
    assert not case.q_lat.is_contiguous()
    check(case)
    check(make_mla_case([0], [1]))


def test_production_dims_in_the_interpreter() -> None:
    """L 512, R 64, block 64, 20 heads: the GPU's default tiles, a reduce over 4 chunks of L."""
    case = make_mla_case([0, 300, 70, 1000], [5, 1, 1, 1], num_heads=20, **GPU_DIMS)
    check(case, decode_splits=5)


def test_empty_step() -> None:
    meta = build_attention_metadata([], [], [], 4, "cpu")
    out = mla_attention_triton(torch.randn(0, 4, 48), torch.zeros(2, 4, 48), meta, 0.25, 32)
    assert out.shape == (0, 4, 32)


@pytest.mark.parametrize(("change", "message"), [
    (lambda c: setattr(c, "latent_cache", c.latent_cache.half()), "latent_cache dtype"),
    (lambda c: (setattr(c, "q_lat", c.q_lat.bfloat16()),
                setattr(c, "latent_cache", c.latent_cache.bfloat16())),
     "bf16 is not supported on CPU"),
    (lambda c: setattr(c, "L", 24), "kv_lora_rank 24 must be a power of two"),
    (lambda c: (setattr(c, "q_lat", c.q_lat[..., :40]),
                setattr(c, "latent_cache", c.latent_cache[..., :40])),
     r"rope dims R = 40 - 32 = 8 must be a power of two"),
    (lambda c: setattr(c, "q_lat", c.q_lat[..., :40]), "q's last dim 40 != latent_cache's 48"),
    (lambda c: setattr(c, "latent_cache", c.latent_cache[:, :3]), r"block_size 3 not in"),
    (lambda c: setattr(c.meta, "block_size", 8), "meta.block_size 8"),
    (lambda c: setattr(c.meta, "seq_lens", c.meta.seq_lens.long()), "meta.seq_lens"),
    (lambda c: setattr(c, "q_lat", c.q_lat[:2]), "q has 2 tokens, meta 6"),
])
def test_bad_input_is_named(change: object, message: str) -> None:
    case = make_mla_case([3, 0], [1, 5])
    change(case)  # type: ignore[operator]
    with pytest.raises(ValueError, match=message):
        mla_attention_triton(case.q_lat, case.latent_cache, case.meta, case.scale, case.L)


def test_interpreter_works_when_triton_was_imported_first() -> None:
    # e.g. transformers imports triton (compiled mode) before conftest sets TRITON_INTERPRET
    code = ("import os, triton; os.environ['TRITON_INTERPRET'] = '1'; "
            "from tests.kernels.attention.test_mla_triton import check, make_mla_case, MIXED; "
            "check(make_mla_case(*MIXED))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True,
                            text=True, cwd=REPO, env=env)
    assert result.returncode == 0, result.stderr[-2000:]


def test_import_does_not_import_triton() -> None:
    code = ("import sys, moeserve.kernels.attention.mla.absorbed_triton; "
            "assert 'triton' not in sys.modules, 'triton imported'")
    result = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stderr


# ---------------------------------------------------------------- GPU, production dims
# DeepSeek-V3's MLA: kv_lora_rank 512, rope 64, nope 128, v 128; block 64. bf16 tolerance as in
# test_paged_attention_triton: outputs are averages of N(0, 1) latents.
GPU_DIMS = {"L": 512, "R": 64, "nope": 128, "v_dim": 128, "block_size": 64}




def gpu_case(computed: list[int], scheduled: list[int], num_heads: int,
             dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> MlaCase:
    return make_mla_case(computed, scheduled, num_heads=num_heads, dtype=dtype, seed=seed,
                         device="cuda", **GPU_DIMS)


@pytest.mark.gpu
@pytest.mark.parametrize("num_heads", [16, 20, 128])
@pytest.mark.parametrize(("batch", "max_context"), [(4, 4096), (64, 2048), (128, 256)])
def test_gpu_decode(num_heads: int, batch: int, max_context: int) -> None:
    rng = np.random.default_rng(batch)
    computed = rng.integers(1, max_context, batch).tolist()
    computed[0] = max_context - 1
    case = gpu_case(computed, [1] * batch, num_heads, seed=batch)
    check(case)  # decode_gluon on sm90 ("auto")
    check(case, decode_form="split")
    # 2 stages, and 3; a register cap of 128 (two programs an SM at 8 warps: some spill)
    for cfg in (TileConfig(16, 64, 4, 2), TileConfig(64, 32, 8, 3), TileConfig(32, 32, 8, 3, 128)):
        check(case, decode_config=cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("num_heads", [16, 20, 128])
def test_gpu_prefill_and_prefix_hits(num_heads: int) -> None:
    check(gpu_case([0, 0, 512, 1000, 37], [128, 700, 256, 77, 300], num_heads))


@pytest.mark.gpu
@pytest.mark.parametrize("num_heads", [16, 20, 128])
def test_gpu_mixed_step(num_heads: int) -> None:
    rng = np.random.default_rng(1)
    computed = rng.integers(1, 4096, 60).tolist() + [0, 40, 97, 2000]
    check(gpu_case(computed, [1] * 60 + [64, 128, 33, 512], num_heads))


@pytest.mark.gpu
@pytest.mark.parametrize("num_heads", [16, 128])
def test_gpu_fp32_matches_dense(num_heads: int, no_tf32: None) -> None:
    case = gpu_case([0, 100, 3000, 4000, 9], [37, 1, 20, 1, 1], num_heads, dtype=torch.float32)
    check(case)
    check(case, decode_splits=7)


@pytest.mark.gpu
def test_gpu_decode_in_cuda_graph() -> None:
    batch, max_len, heads = 32, 2048, 16
    rng = np.random.default_rng(2)
    case = gpu_case([max_len - 1] * batch, [1] * batch, heads)  # block tables sized for max_len
    meta = case.meta
    meta.seq_lens.copy_(torch.from_numpy(rng.integers(1, max_len, batch)).int())
    args = (case.q_lat, case.latent_cache, meta, case.scale, case.L)
    mla_attention_triton(*args)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mla_attention_triton(*args)
    for seed in range(2):  # new queries, latents and lengths, written in place
        lens = np.random.default_rng(10 + seed).integers(1, max_len + 1, batch)
        case.q_lat.copy_(torch.randn_like(case.q_lat))
        case.latent_cache.copy_(torch.randn_like(case.latent_cache))
        meta.seq_lens.copy_(torch.from_numpy(lens).int())
        graph.replay()
        fresh = build_attention_metadata((lens - 1).tolist(), [1] * batch,
                                         meta.block_tables.cpu().tolist(), meta.block_size,
                                         "cuda")
        ref = mla_attention_ref(case.q_lat, case.latent_cache, fresh, case.scale, case.L)
        torch.testing.assert_close(out.float(), ref.float(), atol=TOL[torch.bfloat16],
                                   rtol=TOL[torch.bfloat16])


def test_decode_default_tiles_by_heads() -> None:
    # bf16 at DeepSeek / GLM's latent: up to 32 heads one program of them over 64 keys; from 64
    # heads 64 heads over 64 keys (gpu_2928ff4), DSA's sparse MLA too (gpu_039305d/call3)
    from moeserve.kernels.attention.mla.absorbed_triton import TileConfig, default_config

    assert default_config("decode", 512, torch.bfloat16, 20) == TileConfig(32, 64, 8, 3)
    assert default_config("decode", 512, torch.bfloat16, 64) == TileConfig(64, 64, 8, 2)
    assert default_config("sparse", 512, torch.bfloat16, 64) == TileConfig(64, 64, 8, 2)
    assert default_config("sparse", 512, torch.bfloat16, 20) == TileConfig(32, 64, 8, 3)
