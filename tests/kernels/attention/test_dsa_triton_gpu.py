"""The Triton DSA kernels on the GPU (`-m gpu`), at GLM-5's shapes, against the torch
references (test_dsa_triton.py's contracts and helpers): the indexer at 32 heads x 128, topk
2048, contexts 4k-16k, bf16 keys in blocks of 64; its sparse MLA (L 512, R 64, 64 and 128
heads); one decode step captured in a CUDA graph (plain and programmatic dependent launches)
and one run under torch's sync debug mode "error" (no host sync).

Random normal data: scores agree with the reference's to fp32 rounding only (other summation
orders), so two scores closer than that may swap; integer-valued data makes every score exact,
so there the selection must be equal bit for bit (and it ties in bulk).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moeserve.kernels import triton_common
from moeserve.kernels.attention.dsa import indexer_triton as dsa_triton
from moeserve.kernels.attention.dsa.indexer_triton import indexer_topk_triton
from moeserve.kernels.attention.dsa.reference import dsa_attention_ref, indexer_topk_ref
from moeserve.kernels.attention.dsa.sparse_triton import dsa_attention_triton
from moeserve.kernels.attention.metadata import build_attention_metadata
from tests.kernels.attention.test_dsa_triton import (
    TOL,
    Step,
    _integers,
    _latents,
    check_topk,
    make_step,
)

GPU_INDEXER = {"heads": 32, "dim": 128, "device": "cuda"}
GPU_TOPK, GPU_BLOCK = 2048, 64


def _gpu_steps() -> dict[str, tuple[list[int], list[int]]]:
    rng = np.random.default_rng(0)
    decode = rng.integers(4096, 16384, 32).tolist()
    return {
        "decode_4": ([4095, 8191, 12000, 16383], [1] * 4),
        "decode_32": (decode, [1] * 32),
        "prefill_and_chunk": ([0, 6000], [2500, 512]),  # 2500 crosses topk; a chunk at 6000
        "mixed": (decode[:8] + [0, 9000], [1] * 8 + [300, 256]),
    }


def _ref_scores(step: Step, scale: float) -> torch.Tensor:
    """The reference's scores [T, S_max] (fp32, -inf past each context), a token at a time."""
    meta, flat = step.meta, step.cache.view(-1, step.cache.shape[-1])
    out = torch.full((meta.num_tokens, meta.max_seq_len), float("-inf"), device=flat.device)
    rows, positions = meta.token_to_req.tolist(), meta.positions.tolist()
    slots_by_row = {}
    for tok, (row, p) in enumerate(zip(rows, positions)):
        if row not in slots_by_row:
            slots_by_row[row] = torch.tensor(step.slots(row, int(meta.seq_lens_np[row])),
                                             device=flat.device)
        k = flat[slots_by_row[row][:p + 1]].float()  # [p + 1, D]
        s = torch.relu(step.q[tok].float() @ k.T * scale)  # [H, p + 1]
        out[tok, :p + 1] = step.w[tok] @ s
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("key_tiles", [1, 4])
@pytest.mark.parametrize("name", list(_gpu_steps()))
def test_gpu_topk_integer_data_is_exact(name: str, key_tiles: int,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dsa_triton, "score_key_tiles", key_tiles)
    step = make_step(*_gpu_steps()[name], GPU_BLOCK, dtype=torch.bfloat16, **GPU_INDEXER)
    _integers(step)
    _, ties = check_topk(step, topk=GPU_TOPK, scale=0.25)
    assert ties > 0


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(_gpu_steps()))
def test_gpu_topk_random_data_matches_to_rounding(name: str, no_tf32: None) -> None:
    """The same positions as the reference but where two scores are within rounding: at most
    a few swaps a token, each between scores equal to 1e-5 of the largest."""
    step = make_step(*_gpu_steps()[name], GPU_BLOCK, dtype=torch.bfloat16, **GPU_INDEXER)
    scale = 128 ** -0.5
    got, _ = indexer_topk_triton(step.q, step.w, step.cache, step.meta, scale, GPU_TOPK)
    want, _ = indexer_topk_ref(step.q, step.w, step.cache, step.meta, scale, GPU_TOPK)
    assert torch.equal(got >= 0, want >= 0)
    scores = _ref_scores(step, scale)
    of = torch.cat([scores, scores.new_full((scores.shape[0], 1), float("-inf"))], dim=1)
    s_got = of.gather(1, torch.where(got >= 0, got, of.shape[1] - 1).long())
    s_want = of.gather(1, torch.where(want >= 0, want, of.shape[1] - 1).long())
    eps = 1e-5 * float(scores[scores > float("-inf")].abs().max())
    valid = want >= 0
    assert ((s_got - s_want).abs()[valid] <= eps).all()  # rank by rank, the same score
    assert (got == want).float().mean() > 0.99


@pytest.mark.gpu
@pytest.mark.parametrize("num_heads", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("gluon", [None, False])
def test_gpu_sparse_attention(num_heads: int, dtype: torch.dtype, gluon: bool | None,
                              no_tf32: None) -> None:
    """L 512, R 64 over 2048 selected positions (-1 padding on the 2500-token prefill's first
    queries), against the reference: the default (sparse_gluon in bf16 on sm90) and the Triton
    kernel."""
    step = make_step(*_gpu_steps()["mixed"], GPU_BLOCK, dtype=torch.bfloat16, **GPU_INDEXER)
    positions, _ = indexer_topk_triton(step.q, step.w, step.cache, step.meta, 0.1, GPU_TOPK)
    q, latent = _latents(step.meta, num_heads, dtype, "cuda", width=576)
    got = dsa_attention_triton(q, latent, step.meta, positions, 576 ** -0.5, 512, gluon=gluon)
    want = dsa_attention_ref(q, latent, step.meta, positions, 576 ** -0.5, 512)
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("pdl", [0, 1, 2, 3])
def test_gpu_decode_makes_no_host_sync_and_replays_in_a_cuda_graph(
        pdl: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 32-row decode: no sync under torch's sync debug mode; captured once, replayed with new
    queries, keys and lengths written in place, equal to the reference each time; its kernels
    launched plain and at each programmatic dependent launch level (triton_common.pdl)."""
    monkeypatch.setattr(triton_common, "pdl", pdl)
    batch, max_len = 32, 8192
    step = make_step([max_len - 1] * batch, [1] * batch, GPU_BLOCK, dtype=torch.bfloat16,
                     **GPU_INDEXER)  # block tables sized for max_len
    _integers(step)
    meta = step.meta
    q_lat, latent = _latents(meta, 64, torch.bfloat16, "cuda", width=576)

    def run() -> tuple[torch.Tensor, torch.Tensor]:  # as a full DSA layer runs it
        pos, _ = indexer_topk_triton(step.q, step.w, step.cache, meta, 0.25, GPU_TOPK)
        with triton_common.queries_made_earlier():  # q_lat made before the indexer's launches
            return pos, dsa_attention_triton(q_lat, latent, meta, pos, 0.1, 512)

    run()  # compile outside the capture
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        run()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        pos_out, attn_out = run()
    for seed in range(2):
        lens = np.random.default_rng(10 + seed).integers(1, max_len + 1, batch)
        meta.seq_lens.copy_(torch.from_numpy(lens).int())
        meta.positions.copy_(torch.from_numpy(lens - 1))
        _integers(step, seed=20 + seed)
        latent.copy_(torch.randn_like(latent))
        graph.replay()
        fresh = build_attention_metadata((lens - 1).tolist(), [1] * batch,
                                         meta.block_tables.cpu().tolist(), GPU_BLOCK, "cuda")
        fresh.max_seq_len = meta.max_seq_len  # the captured shapes
        want, _ = indexer_topk_ref(step.q, step.w, step.cache, fresh, 0.25, GPU_TOPK)
        assert torch.equal(pos_out, want)
        ref = dsa_attention_ref(q_lat, latent, fresh, want, 0.1, 512)
        torch.testing.assert_close(attn_out.float(), ref.float(), atol=TOL[torch.bfloat16],
                                   rtol=TOL[torch.bfloat16])
