"""MLA over the paged latent cache (torch path): the absorbed form against a dense per-row
loop, and the up-projected (MHA) form against the absorbed one, on steps that mix decodes,
fresh prefills and chunks after a prefix."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from moeserve.kernels.attention.metadata import AttentionMetadata, build_attention_metadata
from moeserve.kernels.attention.mla.reference import (
    mla_attention_ref,
    mla_prefill_ref,
    write_latent,
)

MIXED = ([5, 17, 0, 12, 30, 0], [1, 1, 9, 7, 1, 1])  # decodes + prefill chunks, some mid-context
DECODE = ([5, 17, 3, 40], [1, 1, 1, 1])


@dataclass
class MlaCase:
    q_lat: torch.Tensor  # [T, H, L + R] absorbed queries
    q: torch.Tensor  # [T, H, nope + R] the same queries before absorption
    latent_cache: torch.Tensor  # [num_blocks, block_size, L + R]
    kv_b_proj: torch.Tensor  # [H * (nope + v), L]
    meta: AttentionMetadata
    expected_latent: torch.Tensor  # [T, H, L] fp32, dense per-row absorbed attention
    scale: float
    L: int
    R: int
    nope: int
    v_dim: int


def make_mla_case(num_computed: list[int], num_scheduled: list[int], block_size: int = 4,
                  num_heads: int = 4, L: int = 32, R: int = 16, nope: int = 16, v_dim: int = 16,
                  dtype: torch.dtype = torch.float32, seed: int = 0,
                  device: str = "cpu") -> MlaCase:
    """Random latents written through write_latent into shuffled blocks of a NaN pool (reading
    a slot that was not written poisons the output). Drawn on the CPU (the same numbers on any
    device), then everything, the dense expectation included, computed on `device`."""
    gen = torch.Generator().manual_seed(seed)
    scale = (nope + R) ** -0.5
    seq_lens = [c + s for c, s in zip(num_computed, num_scheduled, strict=True)]
    blocks_per_req = [-(-s // block_size) for s in seq_lens]
    num_blocks = 1 + sum(blocks_per_req) + 3
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables, first = [], 0
    for n in blocks_per_req:
        tables.append(ids[first:first + n])
        first += n
    cache = torch.full((num_blocks, block_size, L + R), float("nan"), dtype=dtype,
                       device=device)
    latents = [torch.randn(s, L + R, generator=gen).to(device, dtype) for s in seq_lens]
    whole = build_attention_metadata([0] * len(seq_lens), seq_lens, tables, block_size, device)
    write_latent(torch.cat(latents), cache, whole.slot_mapping)
    kv_b = (torch.randn(num_heads * (nope + v_dim), L, generator=gen) * L ** -0.5).to(device,
                                                                                       dtype)
    w = kv_b.float().view(num_heads, nope + v_dim, L)
    w_uk = w[:, :nope]  # [H, nope, L]
    qs, q_lats, expected = [], [], []
    for lat, start, n in zip(latents, num_computed, num_scheduled, strict=True):
        q = torch.randn(n, num_heads, nope + R, generator=gen).to(device, dtype)
        q_lat = torch.cat([torch.einsum("thn,hnl->thl", q[..., :nope].float(), w_uk),
                           q[..., nope:].float()], dim=-1).to(dtype)  # [n, H, L + R]
        s = lat.shape[0]
        scores = torch.einsum("thd,sd->hts", q_lat.float(), lat.float()) * scale
        key_pos = torch.arange(s, device=device)
        q_pos = torch.arange(start, start + n, device=device)
        scores = scores.masked_fill(key_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        expected.append(torch.einsum("hts,sl->thl", scores.softmax(-1), lat[:, :L].float()))
        qs.append(q)
        q_lats.append(q_lat)
    meta = build_attention_metadata(num_computed, num_scheduled, tables, block_size, device)
    return MlaCase(torch.cat(q_lats), torch.cat(qs), cache, kv_b, meta, torch.cat(expected),
                   scale, L, R, nope, v_dim)


def up_project_output(case: MlaCase, out_latent: torch.Tensor) -> torch.Tensor:
    """Absorbed output [T, H, L] -> per-head values [T, H, v] through W_UV."""
    heads = out_latent.shape[1]
    w_uv = case.kv_b_proj.float().view(heads, case.nope + case.v_dim, case.L)[:, case.nope:]
    return torch.einsum("thl,hvl->thv", out_latent.float(), w_uv)


@pytest.mark.parametrize("steps", [MIXED, DECODE], ids=["mixed", "decode"])
@pytest.mark.parametrize("block_size", [4, 16])
def test_absorbed_matches_dense(steps, block_size: int) -> None:
    case = make_mla_case(*steps, block_size=block_size)
    out = mla_attention_ref(case.q_lat, case.latent_cache, case.meta, case.scale, case.L)
    assert out.shape == case.expected_latent.shape
    torch.testing.assert_close(out, case.expected_latent, rtol=1e-5, atol=1e-5)


LONG_AND_SHORT = ([100, 0, 2, 0], [4, 3, 5, 1])  # one long context: attended apart


@pytest.mark.parametrize("steps", [MIXED, ([0, 0], [9, 13]), ([8, 20], [5, 3]), LONG_AND_SHORT],
                         ids=["mixed", "fresh", "after-prefix", "long-and-short"])
def test_up_projected_matches_absorbed(steps) -> None:
    case = make_mla_case(*steps)
    if steps is LONG_AND_SHORT:  # the prefill rows really go in two groups
        from moeserve.kernels.attention.paged import bounded_groups

        rows = np.flatnonzero(case.meta.query_lens_np > 1)
        groups = bounded_groups(case.meta.query_lens_np[rows], case.meta.seq_lens_np[rows], rows)
        assert [g.tolist() for g in groups] == [[0], [1, 2]]
    out = mla_prefill_ref(case.q, case.latent_cache, case.meta, case.scale, case.kv_b_proj,
                          case.nope, case.v_dim)  # [T, H, v]
    torch.testing.assert_close(out, up_project_output(case, case.expected_latent),
                               rtol=1e-5, atol=1e-5)


def test_up_projected_rows_past_the_mask_limit_attend_alone_without_a_mask(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Groups whose causal mask would pass paged.MAX_MASK_ELEMENTS go row by row, each row's
    context through up_projected.attend_row_in_chunks (no [Q, S] mask): the same output."""
    from moeserve.kernels.attention import paged
    from moeserve.kernels.attention.mla import reference

    case = make_mla_case([0, 0, 8, 20, 5], [9, 13, 5, 3, 1])  # four prefill rows, a decode
    alone: list[tuple[int, int]] = []
    chunked = reference.attend_row_in_chunks

    def spy(q: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        alone.append((q.shape[0], args[2]))  # (queries, context)
        return chunked(q, *args, **kwargs)

    monkeypatch.setattr(reference, "attend_row_in_chunks", spy)
    want = up_project_output(case, case.expected_latent)
    out = mla_prefill_ref(case.q, case.latent_cache, case.meta, case.scale, case.kv_b_proj,
                          case.nope, case.v_dim)
    # bounded_groups: the 23- and the 9-token contexts alone, the two of 13 one masked group
    assert alone == [(3, 23), (9, 9)]
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    alone.clear()
    monkeypatch.setattr(paged, "MAX_MASK_ELEMENTS", 1)
    out = mla_prefill_ref(case.q, case.latent_cache, case.meta, case.scale, case.kv_b_proj,
                          case.nope, case.v_dim)
    assert sorted(alone) == [(3, 23), (5, 13), (9, 9), (13, 13)]  # each prefill row alone
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunk", [1, 3, 64])
def test_a_row_alone_attends_its_context_in_chunks(monkeypatch: pytest.MonkeyPatch,
                                                   chunk: int) -> None:
    """A long row's prefix in chunks of `chunk` tokens (the last one partial), then its own
    span, merged by their log-sum-exps: the dense expectation, at 1, several and one piece
    of prefix; values narrower than the keys (v 16, nope + R 32)."""
    from moeserve.kernels.attention.mla import up_projected

    monkeypatch.setattr(up_projected, "MIN_CHUNK", chunk)
    monkeypatch.setattr(up_projected, "CHUNK_BYTES", 1)
    assert up_projected.chunk_tokens(4, 32, 16) == chunk
    pieces: list[bool] = []
    attend_piece = up_projected._attend_piece

    def spy(q, k, v, scale, causal, kernel=None):
        pieces.append(causal)
        return attend_piece(q, k, v, scale, causal, kernel)

    monkeypatch.setattr(up_projected, "_attend_piece", spy)
    case = make_mla_case([0, 40], [9, 7], block_size=4)  # fresh 9; 7 after a 40-token prefix
    out = mla_prefill_ref(case.q, case.latent_cache, case.meta, case.scale, case.kv_b_proj,
                          case.nope, case.v_dim)
    # each row alone: the fresh one its own span, the other its prefix's chunks and its span
    assert sorted(pieces) == [False] * -(-40 // chunk) + [True, True]
    torch.testing.assert_close(out, up_project_output(case, case.expected_latent),
                               rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="7 queries in a context of 5"):
        up_projected.attend_row_in_chunks(case.q[9:], case.latent_cache,
                                          case.meta.block_tables[1], 5, case.scale,
                                          case.kv_b_proj, case.nope, case.v_dim)


def test_a_memory_probe_attends_the_first_two_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under up_projected.memory_probe (the memory plan's profile step) a row attends its first
    two prefix chunks (the second folds beside a full chunk's keys: the peak) and its own span:
    of 40 prefix tokens in chunks of 6 (six full, one of 4), two full chunks and the span;
    outside it, every chunk."""
    from moeserve.kernels.attention.mla import up_projected

    monkeypatch.setattr(up_projected, "MIN_CHUNK", 6)
    monkeypatch.setattr(up_projected, "CHUNK_BYTES", 1)
    sizes: list[tuple[int, bool]] = []
    up_project = up_projected._up_project

    def spy(cache, table, first, end, *args):
        sizes.append((end - first, first == 40))
        return up_project(cache, table, first, end, *args)

    monkeypatch.setattr(up_projected, "_up_project", spy)
    case = make_mla_case([40], [7], block_size=4)
    args = (case.q, case.latent_cache, case.meta.block_tables[0], 47, case.scale,
            case.kv_b_proj, case.nope, case.v_dim)
    with up_projected.memory_probe():
        probed = up_projected.attend_row_in_chunks(*args)
    assert sizes == [(6, False), (6, False), (7, True)] and not up_projected._probing
    sizes.clear()
    out = up_projected.attend_row_in_chunks(*args)
    assert sorted(sizes) == [(4, False)] + [(6, False)] * 6 + [(7, True)]
    torch.testing.assert_close(out, up_project_output(case, case.expected_latent),
                               rtol=1e-5, atol=1e-5)
    assert probed.shape == out.shape and not torch.allclose(probed, out)


def test_fold_merges_bf16_pieces_by_their_log_sum_exps_without_touching_them() -> None:
    """up_projected.fold, as the CUDA pieces hand it: bf16 outputs (one a view of a wider,
    padded output) and fp32 log-sum-exps -> the softmax-weighted mean in fp32; the accumulator
    is updated in place, so the first piece's output (fp32 here) is copied, not aliased."""
    from moeserve.kernels.attention.mla.up_projected import fold

    gen = torch.Generator().manual_seed(0)
    first = torch.randn(1, 4, 8, 16, generator=gen)
    padded = torch.randn(1, 4, 8, 32, generator=gen).bfloat16()
    lses = torch.randn(2, 1, 4, 8, generator=gen) * 4
    kept = first.clone()
    acc, total, top = fold(fold(None, first, lses[0]), padded[..., :16], lses[1])
    weights = torch.exp(lses - lses.max(0).values)
    want = (first * weights[0, ..., None] + padded[..., :16].float() * weights[1, ..., None]
            ) / weights.sum(0)[..., None]
    torch.testing.assert_close(acc / total[..., None], want, rtol=1e-6, atol=1e-6)
    assert torch.equal(top, lses.max(0).values) and torch.equal(first, kept)


def test_an_unknown_piece_kernel_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    from moeserve.kernels.attention.mla import up_projected

    monkeypatch.setattr(up_projected, "PIECE_KERNEL", "flash3")
    case = make_mla_case([8], [4])
    with pytest.raises(ValueError, match="PIECE_KERNEL 'flash3' not in"):
        up_projected.attend_row_in_chunks(case.q, case.latent_cache, case.meta.block_tables[0],
                                          12, case.scale, case.kv_b_proj, case.nope, case.v_dim)


def test_bf16_absorbed_stays_close() -> None:
    case = make_mla_case(*MIXED, dtype=torch.bfloat16)
    out = mla_attention_ref(case.q_lat, case.latent_cache, case.meta, case.scale, case.L)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), case.expected_latent, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
def test_gpu_a_long_prefill_row_holds_neither_its_mask_nor_its_whole_context(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefill row of 1,024 queries at the end of a 32,768-token context, its prefix in
    chunks of 2,048 tokens (CHUNK_BYTES 8 MiB): its peak stays below the bytes its [Q, S] bool
    mask alone would take (32 MiB) and the whole context's up-projected keys and values
    (112 MiB); the output is the dense expectation's (the memory-efficient kernel's
    log-sum-exps merged)."""
    from moeserve.kernels.attention.mla import up_projected

    monkeypatch.setattr(up_projected, "CHUNK_BYTES", 8 << 20)
    case = make_mla_case([31744], [1024], block_size=16, num_heads=8, L=64, R=32, nope=64,
                         v_dim=64, dtype=torch.bfloat16, device="cuda")
    assert up_projected.chunk_tokens(8, 96, 64) == 2048
    want = up_project_output(case, case.expected_latent)
    whole_context = 32768 * 8 * (64 + 64 + 96) * 2
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = mla_prefill_ref(case.q, case.latent_cache, case.meta, case.scale, case.kv_b_proj,
                          case.nope, case.v_dim)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    assert peak < min(1024 * 32768, whole_context), (peak, whole_context)
    torch.testing.assert_close(out.float(), want, rtol=3e-2, atol=3e-2)


@pytest.mark.gpu
def test_gpu_a_memory_probe_reaches_the_whole_rows_peak(monkeypatch: pytest.MonkeyPatch) -> None:
    """The memory plan's profile step attends a long row under up_projected.memory_probe (its
    first two prefix chunks): its peak is the whole row's, 1,024 queries after 31,744 tokens
    in chunks of 2,048 (fifteen full, one of 1,024). One chunk of each size, as it was, gave
    16.5 against 20.2 MB on the H200: the first chunk folds into nothing. One unmeasured call
    first: what a process allocates once and keeps (a library's workspace on the first GEMM of
    a stream) is neither's peak (it failed once in the whole tree, gpu_e6ddc73/call2, after
    passing alone and in session 34's tree)."""
    from moeserve.kernels.attention.mla import up_projected

    monkeypatch.setattr(up_projected, "CHUNK_BYTES", 8 << 20)
    case = make_mla_case([31744], [1024], block_size=16, num_heads=8, L=64, R=32, nope=64,
                         v_dim=64, dtype=torch.bfloat16, device="cuda")
    mla_prefill_ref(case.q, case.latent_cache, case.meta, case.scale, case.kv_b_proj, case.nope,
                    case.v_dim)
    peaks = []
    for probe in (False, True):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with up_projected.memory_probe() if probe else contextlib.nullcontext():
            mla_prefill_ref(case.q, case.latent_cache, case.meta, case.scale, case.kv_b_proj,
                            case.nope, case.v_dim)
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - base)
    # within 1 MiB: the caching allocator leaves a large block unsplit where less than 1 MiB
    # would remain, and counts all of it allocated, so a peak depends on the blocks the
    # allocations before found (with the flash pieces' padded values the whole row's peak
    # was 512 KiB above the probe's on an H100, gpu_948136d/call11); the probe missing a
    # piece's peak, as it once did, was 3.7 MB below
    assert peaks[1] > 0 and abs(peaks[1] - peaks[0]) <= 1 << 20, peaks


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_fresh_rows_attend_their_own_latents_in_one_launch(device: str) -> None:
    """up_projected.attend_fresh_rows over fresh prompts' latents read back at their slots:
    the dense expectation (on CUDA one FlashAttention-2 varlen launch, the values zero-padded
    from 16 to the keys' 32); lengths that disagree are refused."""
    from moeserve.kernels.attention.mla.up_projected import attend_fresh_rows

    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    case = make_mla_case([0, 0, 0], [9, 2, 13], dtype=dtype, device=device)
    latents = case.latent_cache.view(-1, case.L + case.R)[case.meta.slot_mapping]
    out = attend_fresh_rows(case.q, latents, case.meta.query_start_loc, [9, 2, 13], case.scale,
                            case.kv_b_proj, case.nope, case.v_dim)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.float(), up_project_output(case, case.expected_latent),
                               rtol=tol, atol=tol)
    with pytest.raises(ValueError, match="24 queries, 24 latents, rows of 23 tokens"):
        attend_fresh_rows(case.q, latents, case.meta.query_start_loc, [9, 1, 13], case.scale,
                          case.kv_b_proj, case.nope, case.v_dim)
