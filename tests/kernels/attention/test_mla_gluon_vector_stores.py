"""The Gluon MLA decode kernels' vector stores (decode_gluon.vector_stores, on unless
MOESERVE_MLA_VECTOR_STORES=0: outputs and split partials stored from a layout of 8 consecutive
latent columns a thread): only the stores' layout changes, so every form writes the same bits
as with the accumulator's own layout: the dense decode (decode_gluon at 64 / 128 heads, the
swapped kernel at 20; unsplit and split) and DSA's sparse attention. (The absorbed prefill
keeps the accumulator's stores.)"""

from __future__ import annotations

import pytest
import torch

from moeserve.kernels.attention.mla import decode_gluon
from tests.kernels.attention.test_mla_decode_gluon import gpu_sparse_inputs, run
from tests.kernels.attention.test_mla_triton import gpu_case


def both(monkeypatch: pytest.MonkeyPatch, fn) -> tuple[torch.Tensor, torch.Tensor]:
    """fn() with the accumulator's stores, then with vector stores."""
    outs = []
    for on in (False, True):
        monkeypatch.setattr(decode_gluon, "vector_stores", on)
        outs.append(fn())
    return outs[0], outs[1]


@pytest.mark.gpu
@pytest.mark.parametrize("num_heads", [20, 64, 128])
@pytest.mark.parametrize("splits", [1, 3])
def test_gpu_decode_writes_the_same_bits(monkeypatch: pytest.MonkeyPatch, num_heads: int,
                                         splits: int) -> None:
    case = gpu_case([0, 30, 700, 4095, 64, 129], [1] * 6, num_heads, seed=num_heads)
    plain, vec = both(monkeypatch, lambda: run(case, num_splits=splits))
    assert not plain.isnan().any() and torch.equal(plain, vec)


@pytest.mark.gpu
def test_gpu_sparse_writes_the_same_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    q, latent, meta, positions = gpu_sparse_inputs(64)
    plain, vec = both(monkeypatch, lambda: decode_gluon.sparse_gluon(
        q, latent, meta, positions, 0.1, 512))
    assert not plain.isnan().any() and torch.equal(plain, vec)

