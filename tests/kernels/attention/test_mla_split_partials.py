"""The MLA split decode's partials and their combine (kernels/attention/mla/reduce_triton.py):
a bf16 output's accumulators held in bf16 (`half_partials`) and the combine reading 8 splits
at once (`split_block`), through every kernel that writes partials: Triton's split decode
(CPU and GPU), and on the GPU decode_gluon, its swapped kernel (20 heads), decode_gluon_ws
(128 heads past WS_SHORT_CONTEXT keys) and DSA's sparse MLA, each against the dense
expectation or the sparse reference. bf16 runs on the GPU only (Triton's interpreter loads
bf16 wrongly), so on the CPU the combine runs in fp32 and fp16."""

from __future__ import annotations

import pytest
import torch

from moeserve.kernels.attention.mla import decode_gluon
from moeserve.kernels.attention.mla import reduce_triton as mla_reduce_triton
from tests.kernels.attention.test_mla import make_mla_case
from tests.kernels.attention.test_mla_triton import TOL, check, gpu_case


def test_half_partials_only_for_a_bf16_output(monkeypatch: pytest.MonkeyPatch) -> None:
    """half_partials holds a bf16 output's split accumulators in bf16; any other output keeps
    fp32 (the maxima and sums are fp32 always); one split, no partials."""
    for half in (False, True):
        monkeypatch.setattr(mla_reduce_triton, "half_partials", half)
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            maxima, sums, acc = mla_reduce_triton.split_partials(
                torch.empty(5, 4, 32, dtype=dtype), 5, 8)
            assert acc.shape == (5, 4, 8, 32)
            assert maxima.dtype == sums.dtype == torch.float32
            assert acc.dtype == (torch.bfloat16 if half and dtype == torch.bfloat16
                                 else torch.float32), (half, dtype)
        out = torch.empty(5, 4, 32, dtype=torch.bfloat16)
        assert all(p is out for p in mla_reduce_triton.split_partials(out, 5, 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("splits", [3, 8, 9, 64])
def test_the_combine_eight_splits_at_once(splits: int, dtype: torch.dtype,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The combine 8 splits a block (9: a full block and one of one; 64: MAX_SPLITS) as a
    split at a time: rows leaving most partitions empty, within the dtype's tolerance."""
    monkeypatch.setattr(mla_reduce_triton, "split_block", 8)
    check(make_mla_case([4, 9, 370, 0, 63], [1] * 5, block_size=16, dtype=dtype),
          decode_splits=splits)


@pytest.mark.gpu
@pytest.mark.parametrize("split_block", [0, 8])
@pytest.mark.parametrize("half", [False, True])
@pytest.mark.parametrize("num_heads", [20, 64, 128])
def test_gpu_every_partials_writer(num_heads: int, half: bool, split_block: int,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 decodes forced over 3 and 8 partitions (rows with empty ones), fp32 or bf16
    accumulators, combined a split or 8 at a time: Triton's split kernel and decode_gluon's
    (its swapped kernel at 20 heads; decode_gluon_ws at 128 heads, the rows past its short
    context) within bf16's tolerance of the dense expectation."""
    monkeypatch.setattr(mla_reduce_triton, "half_partials", half)
    monkeypatch.setattr(mla_reduce_triton, "split_block", split_block)
    case = gpu_case([4, 9, 370, 0, 63, 1500, 2047], [1] * 7, num_heads, seed=3)
    tol = TOL[torch.bfloat16]
    for splits in (3, 8):
        check(case, decode_form="split", decode_splits=splits)
        if decode_gluon.supports(case.q_lat, case.latent_cache, case.L):
            out = torch.zeros_like(case.q_lat[..., :case.L])
            decode_gluon.decode_gluon(case.q_lat, case.latent_cache, case.meta, case.scale,
                                      case.L, out, None, case.meta.num_reqs,
                                      case.meta.max_seq_len, num_splits=splits)
            torch.testing.assert_close(out.float(), case.expected_latent, atol=tol, rtol=tol)


@pytest.mark.gpu
@pytest.mark.parametrize("half", [False, True])
def test_gpu_sparse_partials(half: bool, no_tf32: None,
                             monkeypatch: pytest.MonkeyPatch) -> None:
    """DSA's sparse MLA (64 heads: decode_gluon_ws on sm90, Triton's kernel too) over 4
    partitions of 2,048 selected positions, fp32 or bf16 accumulators combined 8 at a time,
    against dsa_attention_ref."""
    from moeserve.kernels.attention.dsa import sparse_triton
    from moeserve.kernels.attention.dsa.reference import dsa_attention_ref
    from tests.kernels.attention.test_mla_decode_gluon import gpu_sparse_inputs

    monkeypatch.setattr(mla_reduce_triton, "half_partials", half)
    monkeypatch.setattr(mla_reduce_triton, "split_block", 8)
    q, latent, meta, positions = gpu_sparse_inputs(64)
    want = dsa_attention_ref(q, latent, meta, positions, 576 ** -0.5, 512).float()
    tol = TOL[torch.bfloat16]
    for gluon in (True, False):
        got = sparse_triton.dsa_attention_triton(q, latent, meta, positions, 576 ** -0.5, 512,
                                                 num_splits=4, gluon=gluon)
        torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol, msg=str(gluon))
