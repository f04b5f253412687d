"""The flat (work-partitioned) MLA decode (kernels/attention/mla/decode_flat_triton.py) against
the dense expectation and `mla_attention_ref`: CPU through Triton's interpreter at tiny shapes
with the program count forced so that rows are cut between programs (asserted with
`cut_rows`, the kernel's partition rule in Python), and the GPU at production dims, inside a
CUDA graph replayed at other contexts than it was captured at.

Without a GPU, tests/conftest.py turns Triton's interpreter on before anything imports triton.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from moeserve.kernels.attention.metadata import build_attention_metadata
from moeserve.kernels.attention.mla import decode_flat_triton
from moeserve.kernels.attention.mla.absorbed_triton import (
    FLAT_MAX_HEADS,
    TileConfig,
    auto_decode_form,
    default_config,
    mla_attention_triton,
)
from moeserve.kernels.attention.mla.reference import mla_attention_ref
from tests.kernels.attention.test_mla import DECODE, MIXED, make_mla_case
from tests.kernels.attention.test_mla_triton import TOL, check, gpu_case


def cut_rows(seq_lens: list[int], block_n: int, num_programs: int) -> list[int]:
    """The rows the kernel cuts between programs (its partition: ceil(total / P) flat tiles a
    program, every row at least one tile)."""
    tiles = [max(1, -(-s // block_n)) for s in seq_lens]
    cu = np.concatenate([[0], np.cumsum(tiles)])
    per = max(1, -(-int(cu[-1]) // num_programs))
    return [i for i in range(len(tiles)) if cu[i] // per != (cu[i + 1] - 1) // per]


@pytest.fixture
def programs(monkeypatch: pytest.MonkeyPatch):
    """Set the interpreter's program count."""
    def set_programs(n: int) -> int:
        monkeypatch.setattr(decode_flat_triton, "INTERPRETER_PROGRAMS", n)
        return n
    return set_programs


def block_n(case) -> int:
    return default_config("decode", case.L, case.q_lat.dtype, case.q_lat.shape[1]).block_n


# ---------------------------------------------------------------- CPU, Triton's interpreter

@pytest.mark.parametrize("num_programs", [1, 2, 3, 7, 64])
def test_decode_rows_cut_between_programs(programs, num_programs: int) -> None:
    # 64 programs: most have no tile (more programs than the step's tiles)
    programs(num_programs)
    case = make_mla_case([4, 9, 370, 0, 63], [1] * 5, block_size=16)
    cut = cut_rows(case.meta.seq_lens_np.tolist(), block_n(case), num_programs)
    assert (len(cut) > 0) == (num_programs > 1), cut
    check(case, decode_form="flat")


def test_one_long_row_over_every_program(programs) -> None:
    programs(7)
    case = make_mla_case([300], [1], block_size=4, num_heads=5)
    assert cut_rows([301], block_n(case), 7) == [0]
    check(case, decode_form="flat")


@pytest.mark.parametrize("num_programs", [2, 5])
def test_mixed_step_decode_rows(programs, num_programs: int) -> None:
    # the decode rows are a subset of the step's (row ids through USE_ROWS)
    programs(num_programs)
    check(make_mla_case(*MIXED, block_size=16, num_heads=5), decode_form="flat")


def test_padding_rows_of_no_keys_write_zeros(programs) -> None:
    # a CUDA-graph decode pads with rows of seq_len 0: one tile of no keys, a zero output
    programs(3)
    case = make_mla_case(*DECODE, block_size=4)
    meta = case.meta
    meta.seq_lens[1] = 0
    out = mla_attention_triton(case.q_lat, case.latent_cache, meta, case.scale, case.L,
                               decode_form="flat")
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    keep = [0, 2, 3]
    torch.testing.assert_close(out[keep], case.expected_latent[keep], atol=1e-5, rtol=1e-5)


def test_stale_max_seq_len_is_not_read(programs) -> None:
    # the flat decode sizes nothing from the host's max_seq_len (a graph captured shorter)
    programs(4)
    case = make_mla_case([3, 200, 77], [1] * 3, block_size=16)
    expected = check(case, decode_form="flat")
    out = mla_attention_triton(case.q_lat, case.latent_cache, replace(case.meta, max_seq_len=4),
                               case.scale, case.L, decode_form="flat")
    torch.testing.assert_close(out, expected, atol=0, rtol=0)


def test_lengths_changed_in_place_are_read_again(programs) -> None:
    """A CUDA-graph replay changes seq_lens in place under the same metadata: the tile counts
    are the kernel's own each launch, nothing derived is kept from the first call."""
    programs(3)
    case = make_mla_case([40, 40, 40], [1] * 3, block_size=4)
    meta = case.meta
    meta.seq_lens.copy_(torch.tensor([3, 41, 1], dtype=torch.int32))
    first = mla_attention_triton(case.q_lat, case.latent_cache, meta, case.scale, case.L,
                                 decode_form="flat")
    meta.seq_lens.copy_(torch.tensor([41, 2, 30], dtype=torch.int32))
    second = mla_attention_triton(case.q_lat, case.latent_cache, meta, case.scale, case.L,
                                  decode_form="flat")
    for out, lens in ((first, [3, 41, 1]), (second, [41, 2, 30])):
        fresh = build_attention_metadata([n - 1 for n in lens], [1] * 3,
                                         meta.block_tables.tolist(), meta.block_size, "cpu")
        ref = mla_attention_ref(case.q_lat, case.latent_cache, fresh, case.scale, case.L)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_equals_the_split_decode(programs) -> None:
    programs(3)
    case = make_mla_case([4, 9, 300, 0, 15], [1] * 5, block_size=16, num_heads=5)
    flat = check(case, decode_form="flat")
    split = check(case, decode_form="split")
    torch.testing.assert_close(flat, split, atol=1e-5, rtol=1e-5)


def test_auto_form_and_bad_forms() -> None:
    assert auto_decode_form(20, 256) == auto_decode_form(FLAT_MAX_HEADS, 1) == "flat"
    assert auto_decode_form(20, 257) == auto_decode_form(64, 8) == "split"
    assert auto_decode_form(20, 256, gluon=True) == auto_decode_form(128, 4096, True) == "gluon"
    case = make_mla_case(*DECODE)
    with pytest.raises(ValueError, match="decode_form 'wide' not in"):
        mla_attention_triton(case.q_lat, case.latent_cache, case.meta, case.scale, case.L,
                             decode_form="wide")
    wide = make_mla_case([3], [1], num_heads=FLAT_MAX_HEADS + 1)
    with pytest.raises(ValueError, match="the flat decode takes at most 32 heads, got 33"):
        mla_attention_triton(wide.q_lat, wide.latent_cache, wide.meta, wide.scale, wide.L,
                             decode_form="flat")
    # forcing a split count picks the split form under "auto"
    check(make_mla_case([4, 300], [1, 1], block_size=16), decode_splits=3)


# ---------------------------------------------------------------- GPU, production dims

@pytest.mark.gpu
@pytest.mark.parametrize("num_heads", [16, 20, 32])
@pytest.mark.parametrize(("batch", "max_context"), [(3, 8192), (1024, 256), (300, 4096)])
def test_gpu_flat_decode(num_heads: int, batch: int, max_context: int) -> None:
    rng = np.random.default_rng(batch)
    computed = rng.integers(1, max_context, batch).tolist()
    computed[0] = max_context - 1
    case = gpu_case(computed, [1] * batch, num_heads, seed=batch)
    for cfg in (None, TileConfig(32, 32, 8, 3), TileConfig(32, 64, 8, 2)):
        check(case, decode_form="flat", decode_config=cfg)


@pytest.mark.gpu
def test_gpu_flat_fp32_matches_dense(no_tf32: None) -> None:
    case = gpu_case([0, 100, 3000, 4000, 9], [37, 1, 20, 1, 1], 20, dtype=torch.float32)
    check(case, decode_form="flat")


@pytest.mark.gpu
def test_gpu_flat_decode_in_cuda_graph_at_other_contexts() -> None:
    """Captured with every row at 16 keys, replayed with rows of up to 4k (long rows then cut
    over many programs) and of 0 (padding): the grid is fixed, every length on the device."""
    batch, max_len, heads = 64, 4096, 20
    case = gpu_case([max_len - 1] * batch, [1] * batch, heads)  # block tables for max_len
    meta = case.meta
    meta.seq_lens.fill_(16)
    args = (case.q_lat, case.latent_cache, meta, case.scale, case.L)
    mla_attention_triton(*args, decode_form="flat")  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mla_attention_triton(*args, decode_form="flat")
    for seed in range(3):  # new queries, latents and lengths, written in place
        lens = np.random.default_rng(10 + seed).integers(0, max_len + 1, batch)
        lens[0] = max_len
        case.q_lat.copy_(torch.randn_like(case.q_lat))
        case.latent_cache.copy_(torch.randn_like(case.latent_cache))
        meta.seq_lens.copy_(torch.from_numpy(lens).int())
        graph.replay()
        fresh = build_attention_metadata(np.maximum(lens - 1, 0).tolist(), [1] * batch,
                                         meta.block_tables.cpu().tolist(), meta.block_size,
                                         "cuda")
        fresh.seq_lens.copy_(meta.seq_lens)
        ref = mla_attention_ref(case.q_lat, case.latent_cache, fresh, case.scale, case.L)
        got = out.float()
        empty = torch.from_numpy(lens == 0).cuda()
        assert torch.equal(got[empty], torch.zeros_like(got[empty]))
        torch.testing.assert_close(got[~empty], ref.float()[~empty], atol=TOL[torch.bfloat16],
                                   rtol=TOL[torch.bfloat16])
