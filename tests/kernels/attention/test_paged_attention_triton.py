"""Triton paged attention against the torch reference: CPU through Triton's interpreter (fp32,
fp16, tiny shapes), and the GPU (bf16, realistic shapes, one case inside a CUDA graph).

Without a GPU, tests/conftest.py turns Triton's interpreter on before anything imports triton.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pytest
import torch

from moeserve.kernels.attention.metadata import (
    AttentionMetadata,
    build_attention_metadata,
)
from moeserve.kernels.attention.paged import (
    paged_attention_loop_ref,
    paged_attention_ref,
    write_kv,
)
from moeserve.kernels.attention.paged_triton import (
    LONG_PREFILL_MIN_TOKENS,
    MIN_PARTITION_TOKENS,
    TileConfig,
    _split_rows,
    decode_num_splits,
    default_config,
    paged_attention_triton,
)

MIXED = ([5, 17, 0, 12, 300, 0, 40], [1, 1, 9, 7, 1, 1, 19])  # decodes (one long) + chunks
TOL = {torch.float32: 1e-5, torch.float16: 2e-3}
REPO = Path(__file__).resolve().parents[3]


@dataclass
class Step:
    q: torch.Tensor  # [T, H, D]
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, KVH, D]
    meta: AttentionMetadata
    scale: float


def make_step(num_computed: list[int], num_scheduled: list[int], block_size: int = 4,
              num_kv_heads: int = 2, group: int = 4, head_dim: int = 16,
              dtype: torch.dtype = torch.float32, device: str = "cpu", seed: int = 0) -> Step:
    """Every row's whole context written through write_kv into shuffled blocks of a NaN pool
    (reading any unwritten slot poisons the output), and the step's queries."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + s for c, s in zip(num_computed, num_scheduled, strict=True)]
    blocks_per_req = [-(-s // block_size) for s in seq_lens]
    num_blocks = 1 + sum(blocks_per_req) + 3  # null block 0 + what rows need + spare
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    firsts = np.cumsum([0, *blocks_per_req]).tolist()
    tables = [ids[a:b] for a, b in zip(firsts[:-1], firsts[1:])]
    kv_cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), float("nan"),
                          dtype=dtype, device=device)
    kv = torch.randn(2, sum(seq_lens), num_kv_heads, head_dim, generator=gen)
    whole = build_attention_metadata([0] * len(seq_lens), seq_lens, tables, block_size, device)
    write_kv(kv[0].to(device, dtype), kv[1].to(device, dtype), kv_cache, whole.slot_mapping)
    q = torch.randn(sum(num_scheduled), num_kv_heads * group, head_dim, generator=gen)
    meta = build_attention_metadata(num_computed, num_scheduled, tables, block_size, device)
    return Step(q.to(device, dtype), kv_cache, meta, head_dim ** -0.5)


def check(step: Step, tol: float | None = None, **kwargs: object) -> torch.Tensor:
    """Triton output == paged_attention_ref (and, on CPU, the fp32 loop reference)."""
    tol = TOL[step.q.dtype] if tol is None else tol
    out = paged_attention_triton(step.q, step.kv_cache, step.meta, step.scale, **kwargs)
    assert out.shape == step.q.shape and out.dtype == step.q.dtype
    assert not out.isnan().any()
    ref = paged_attention_ref(step.q, step.kv_cache, step.meta, step.scale)
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    if step.q.device.type == "cpu":
        loop = paged_attention_loop_ref(step.q.float(), step.kv_cache.float(), step.meta,
                                        step.scale)
        torch.testing.assert_close(out.float(), loop, atol=tol, rtol=tol)
    return out


# ---------------------------------------------------------------- CPU, Triton's interpreter

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("group", [1, 4])
def test_pure_decode_with_split_k(group: int, dtype: torch.dtype) -> None:
    computed = [4, 9, 300, 0, 15]  # 301 keys > one partition: the split path runs
    assert decode_num_splits(5, 2, 301) > 1
    check(make_step(computed, [1] * 5, group=group, dtype=dtype))


@pytest.mark.parametrize("splits", [1, 3, 8, 64])
def test_decode_forced_splits_incl_empty_partitions(splits: int) -> None:
    # 8 partitions of 48 tokens: the short rows leave most of theirs empty; 64 is MAX_SPLITS
    check(make_step([4, 9, 370, 0, 63], [1] * 5, block_size=16, head_dim=32), decode_splits=splits)


def test_decode_splits_outside_the_reduce_are_refused() -> None:
    step = make_step([40, 9], [1, 1], block_size=16, head_dim=32)
    for splits in (0, 65):
        with pytest.raises(ValueError, match="decode_splits must be in 1..64"):
            paged_attention_triton(step.q, step.kv_cache, step.meta, step.scale,
                                   decode_splits=splits)


def test_decode_attends_past_a_stale_max_seq_len() -> None:
    # a CUDA graph captured at a shorter max_seq_len: the last partition runs to seq_len
    step = make_step([3, 200, 77], [1] * 3, block_size=8)
    expected = check(step)
    stale = replace(step.meta, max_seq_len=40)
    for splits in (None, 1, 4):
        out = paged_attention_triton(step.q, step.kv_cache, stale, step.scale,
                                     decode_splits=splits)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("block_size", [4, 16])
def test_pure_prefill(block_size: int, dtype: torch.dtype) -> None:
    check(make_step([0, 0, 0], [7, 45, 2], block_size=block_size, dtype=dtype))


@pytest.mark.parametrize("group", [1, 4])
def test_chunked_prefill_after_prefix_hit(group: int) -> None:
    # queries start mid-context (num_computed > 0), not aligned to blocks or tiles
    check(make_step([8, 37, 16, 61], [5, 20, 3, 34], block_size=8, group=group))


def test_prefill_config_sets_the_tiles() -> None:
    # block_m 8 and 64 over group 4: 2 and 16 query tokens per program, both cached on the meta
    step = make_step([0, 6, 3], [9, 14, 1], block_size=8, group=4)
    for cfg in (TileConfig(8, 16, 1, 1), TileConfig(64, 32, 4, 2)):
        check(step, prefill_config=cfg)
    assert {k[1] for k in step.meta.derived} == {2, 16}


def test_long_prompts_take_the_long_prefill_tile() -> None:
    """A prefill chunk of LONG_PREFILL_MIN_TOKENS or more at head_dim 128 in a half type takes
    the long-prompt tile; shorter chunks, fp32 and other head sizes keep the W1 tile."""
    short = default_config("prefill", 128, torch.bfloat16, LONG_PREFILL_MIN_TOKENS - 1)
    long = default_config("prefill", 128, torch.bfloat16, LONG_PREFILL_MIN_TOKENS)
    assert short == default_config("prefill", 128, torch.bfloat16) == TileConfig(64, 32, 4, 2)
    assert long == TileConfig(128, 64, 4, 3)
    assert default_config("prefill", 128, torch.float16, 8192) == long
    assert default_config("prefill", 128, torch.float32, 8192) == TileConfig(64, 32, 4, 2)
    assert default_config("prefill", 64, torch.bfloat16, 8192) == TileConfig(128, 64, 4, 2)
    assert default_config("decode", 128, torch.bfloat16, 8192) == TileConfig(16, 64, 4, 2)


def test_prefill_tiles_run_longest_first() -> None:
    """The row split lists every query tile of every prefill row once, each row's tiles from
    its last (the most keys under the causal mask) to its first; decode rows come first."""
    step = make_step(*MIXED, block_size=16)
    dev, num_decode, num_tiles, max_seq = _split_rows(
        step.meta, step.meta.query_lens_np == 1, 4, torch.device("cpu"))
    host = dev.tolist()
    assert host[:num_decode] == [0, 1, 4, 5] and max_seq == 301
    rows, tiles = host[num_decode:num_decode + num_tiles], host[num_decode + num_tiles:]
    # rows 2, 3, 6 with 9, 7 and 19 new tokens: 3, 2 and 5 tiles of 4
    assert rows == [2] * 3 + [3] * 2 + [6] * 5
    assert tiles == [2, 1, 0, 1, 0, 4, 3, 2, 1, 0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("group", [1, 4])
def test_mixed_batch(group: int, dtype: torch.dtype) -> None:
    check(make_step(*MIXED, block_size=16, group=group, dtype=dtype))


def test_mixed_step_rows_are_split_once_per_step() -> None:
    """Every layer of a step shares its metadata: the row split (a host-to-device copy) is made
    by the first call and reused by the others, with the same result."""
    step = make_step(*MIXED, block_size=16)
    first = check(step)
    assert len(step.meta.derived) == 1
    cached = next(iter(step.meta.derived.values()))
    second = check(step)
    assert next(iter(step.meta.derived.values())) is cached
    torch.testing.assert_close(first, second, atol=0, rtol=0)


@pytest.mark.parametrize("splits", [None, 1])
def test_decode_rows_longest_first_give_the_same_bits(monkeypatch: pytest.MonkeyPatch,
                                                      splits: int | None) -> None:
    """paged_triton.longest_first (MOESERVE_DECODE_LONGEST_FIRST): the decode rows launched
    longest context first, in a pure decode (split or not) and a mixed step's decode rows:
    every output as in step order, bit for bit."""
    from moeserve.kernels.attention import paged_triton

    for step in (make_step([4, 9, 300, 0, 15, 40], [1] * 6), make_step(*MIXED, block_size=16)):
        monkeypatch.setattr(paged_triton, "longest_first", False)
        want = check(step, decode_splits=splits)
        step.meta.derived.clear()
        monkeypatch.setattr(paged_triton, "longest_first", True)
        got = check(step, decode_splits=splits)
        assert torch.equal(got, want)
        assert any(key[0] == "longest_first" for key in step.meta.derived)


@pytest.mark.parametrize(("block_size", "head_dim", "group"), [(32, 32, 3), (8, 64, 8)])
def test_other_block_sizes_head_dims_and_groups(block_size: int, head_dim: int,
                                                group: int) -> None:
    check(make_step([0, 50, 3, 0], [9, 1, 1, 13], block_size=block_size, head_dim=head_dim,
                    group=group, num_kv_heads=1))


def test_strided_q_and_single_token() -> None:
    step = make_step([0, 20], [1, 6], group=2)
    t, h, d = step.q.shape
    qkv = torch.randn(t, h + 2, d)  # q as a strided view of a fused projection
    qkv[:, :h] = step.q
    step.q = qkv[:, :h]
    assert not step.q.is_contiguous()
    check(step)
    check(make_step([0], [1]))


def test_empty_step() -> None:
    meta = build_attention_metadata([], [], [], 4, "cpu")
    out = paged_attention_triton(torch.randn(0, 8, 16), torch.zeros(2, 2, 4, 2, 16), meta, 0.25)
    assert out.shape == (0, 8, 16)


def test_split_policy() -> None:
    assert decode_num_splits(5, 2, MIN_PARTITION_TOKENS) == 1  # short: one pass
    assert decode_num_splits(256, 4, 4096) == 1  # the GPU is full without splitting
    assert decode_num_splits(8, 4, 4096) == 4096 // MIN_PARTITION_TOKENS
    assert decode_num_splits(64, 4, 4096) == 4


@pytest.mark.parametrize(("change", "message"), [
    (lambda s: setattr(s, "kv_cache", s.kv_cache.half()), "kv_cache dtype"),
    (lambda s: (setattr(s, "q", s.q.bfloat16()), setattr(s, "kv_cache", s.kv_cache.bfloat16())),
     "bf16 is not supported on CPU"),
    (lambda s: setattr(s, "q", s.q[..., :8]), "head_dim 8"),
    (lambda s: setattr(s, "kv_cache", s.kv_cache.transpose(1, 2)), r"block_size \d+ not in"),
    (lambda s: setattr(s.meta, "block_size", 8), "meta.block_size 8"),
    (lambda s: setattr(s.meta, "seq_lens", s.meta.seq_lens.long()), "meta.seq_lens"),
    (lambda s: setattr(s, "q", s.q[:, :7]), "num_heads 7"),
])
def test_bad_input_is_named(change: object, message: str) -> None:
    step = make_step([3, 0], [1, 5])
    change(step)  # type: ignore[operator]
    with pytest.raises(ValueError, match=message):
        paged_attention_triton(step.q, step.kv_cache, step.meta, step.scale)


def test_cpu_without_interpreter_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    step = make_step([3], [1])
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        paged_attention_triton(step.q, step.kv_cache, step.meta, step.scale)


def test_interpreter_works_when_triton_was_imported_first() -> None:
    # e.g. transformers imports triton (compiled mode) before this module sets TRITON_INTERPRET
    code = ("import os, triton; os.environ['TRITON_INTERPRET'] = '1'; "
            "from tests.kernels.attention.test_paged_attention_triton import check, make_step; "
            "check(make_step([5, 40], [1, 9]))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True,
                            text=True, cwd=REPO, env=env)
    assert result.returncode == 0, result.stderr[-2000:]


def test_import_does_not_import_triton() -> None:
    code = ("import sys, moeserve.kernels.attention.paged_triton; "
            "assert 'triton' not in sys.modules, 'triton imported'")
    result = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stderr


# ---------------------------------------------------------------- GPU, bf16, realistic shapes
# bf16 tolerance: outputs are averages of N(0, 1) values; bf16 rounding of q, K, V, P and the
# output (2^-8 relative) bounds the error well under 2e-2.
GPU_TOL = 2e-2
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 4, 128, 16


def gpu_step(computed: list[int], scheduled: list[int], seed: int = 0) -> Step:
    return make_step(computed, scheduled, block_size=BLOCK, num_kv_heads=KV_HEADS,
                     group=HEADS // KV_HEADS, head_dim=HEAD_DIM, dtype=torch.bfloat16,
                     device="cuda", seed=seed)


@pytest.mark.gpu
@pytest.mark.parametrize(("batch", "max_context"), [(64, 4096), (256, 1024), (256, 128)])
def test_gpu_decode(batch: int, max_context: int) -> None:
    rng = np.random.default_rng(batch)
    computed = rng.integers(1, max_context, batch).tolist()
    check(gpu_step(computed, [1] * batch), tol=GPU_TOL)


@pytest.mark.gpu
def test_gpu_decode_matches_fp32_loop_ref() -> None:
    step = gpu_step([4000, 17, 129, 1024, 3], [1] * 5)  # small batch: long rows split
    out = paged_attention_triton(step.q, step.kv_cache, step.meta, step.scale)
    loop = paged_attention_loop_ref(step.q.float(), step.kv_cache.float(), step.meta, step.scale)
    torch.testing.assert_close(out.float(), loop, atol=GPU_TOL, rtol=GPU_TOL)


@pytest.mark.gpu
def test_gpu_prefill_and_prefix_hits() -> None:
    check(gpu_step([0, 0, 512, 1000, 37], [128, 1024, 256, 77, 300]), tol=GPU_TOL)


@pytest.mark.gpu
def test_gpu_long_prompts_through_the_long_tile() -> None:
    """Issue 14's long prompts: a fresh 4k chunk and 2k chunks after cached context take the
    long-prompt tile (a block_q of 16 tokens cached on the meta) and match the reference."""
    step = gpu_step([0, 6144, 3000, 100], [4096, 2048, 2100, 1])
    check(step, tol=GPU_TOL)
    assert {k[1] for k in step.meta.derived} == {128 // (HEADS // KV_HEADS)}


@pytest.mark.gpu
def test_gpu_mixed_batch() -> None:
    rng = np.random.default_rng(1)
    computed = rng.integers(1, 2048, 200).tolist() + [0, 40, 97, 2000]
    check(gpu_step(computed, [1] * 200 + [64, 128, 33, 512]), tol=GPU_TOL)


@pytest.mark.gpu
def test_gpu_fp32_matches_loop_ref() -> None:
    step = make_step([0, 100, 700], [37, 1, 20], block_size=BLOCK, num_kv_heads=KV_HEADS,
                     group=8, head_dim=HEAD_DIM, dtype=torch.float32, device="cuda")
    out = paged_attention_triton(step.q, step.kv_cache, step.meta, step.scale)
    loop = paged_attention_loop_ref(step.q, step.kv_cache, step.meta, step.scale)
    torch.testing.assert_close(out, loop, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
def test_gpu_decode_in_cuda_graph() -> None:
    batch, max_len = 64, 2048
    rng = np.random.default_rng(2)
    step = gpu_step([max_len - 1] * batch, [1] * batch)  # block tables sized for max_len
    meta = step.meta
    short = rng.integers(1, max_len, batch)
    meta.seq_lens.copy_(torch.from_numpy(short).int())  # capture with other lengths
    paged_attention_triton(step.q, step.kv_cache, meta, step.scale)  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_attention_triton(step.q, step.kv_cache, meta, step.scale)
    for seed in range(2):  # new queries, K/V and lengths, written in place
        lens = np.random.default_rng(10 + seed).integers(1, max_len + 1, batch)
        step.q.copy_(torch.randn_like(step.q))
        step.kv_cache.copy_(torch.randn_like(step.kv_cache))
        meta.seq_lens.copy_(torch.from_numpy(lens).int())
        graph.replay()
        fresh = build_attention_metadata((lens - 1).tolist(), [1] * batch,
                                         meta.block_tables.cpu().tolist(), BLOCK, "cuda")
        ref = paged_attention_ref(step.q, step.kv_cache, fresh, step.scale)
        torch.testing.assert_close(out.float(), ref.float(), atol=GPU_TOL, rtol=GPU_TOL)
