"""The Gluon MLA kernel's block-table prefetch (decode_gluon.table_prefetch, an experiment
switch: MOESERVE_MLA_TABLE_PREFETCH=1): each key tile's cache rows loaded an iteration before
its copies. It moves loads, not arithmetic, so every form gives the same bits with it as without
it: the decode (split or not, chosen rows, the overlap), DSA's sparse attention (packed or not,
split), and the prefill through the Triton launcher. GPU only (Gluon has no interpreter); on
CPU, the switch's reading of its variable."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moeserve import envs
from moeserve.kernels.attention.mla import decode_gluon
from tests.kernels.attention.test_mla_decode_gluon import gpu_sparse_inputs
from tests.kernels.attention.test_mla_triton import gpu_case


@pytest.mark.parametrize(("value", "on"), [(None, False), ("0", False), ("1", True)])
def test_the_switch_reads_its_variable(monkeypatch: pytest.MonkeyPatch, value: str | None,
                                       on: bool) -> None:
    if value is None:
        monkeypatch.delenv(envs.MLA_TABLE_PREFETCH, raising=False)
    else:
        monkeypatch.setenv(envs.MLA_TABLE_PREFETCH, value)
    assert envs.mla_table_prefetch() is on


def _decode(case, **kwargs: object) -> torch.Tensor:
    out = torch.zeros_like(case.q_lat[..., :case.L])
    decode_gluon.decode_gluon(case.q_lat, case.latent_cache, case.meta, case.scale, case.L, out,
                              None, case.meta.num_reqs, case.meta.max_seq_len, **kwargs)
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("num_heads", [20, 64, 128])
def test_gpu_decode_gives_the_same_bits(num_heads: int) -> None:
    rng = np.random.default_rng(num_heads)
    computed = rng.integers(0, 3000, 48).tolist()
    case = gpu_case(computed, [1] * 48, num_heads, seed=num_heads)
    for kwargs in ({}, {"num_splits": 1}, {"num_splits": 5},
                   {"overlap": True, "block_n": 32, "stages": 3}):
        want = _decode(case, prefetch=False, **kwargs)
        got = _decode(case, prefetch=True, **kwargs)
        assert torch.equal(got, want), kwargs


@pytest.mark.gpu
def test_gpu_sparse_gives_the_same_bits() -> None:
    q, latent, meta, positions = gpu_sparse_inputs(64)
    for kwargs in ({}, {"packed": True}, {"packed": True, "num_splits": 4}):
        want, got = (decode_gluon.sparse_gluon(q, latent, meta, positions, 576 ** -0.5, 512,
                                               prefetch=prefetch, **kwargs)
                     for prefetch in (False, True))
        assert torch.equal(got, want), kwargs


@pytest.mark.gpu
def test_gpu_prefill_gives_the_same_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    from moeserve.kernels.attention.mla.absorbed_triton import mla_attention_triton

    case = gpu_case([0, 0, 512, 1000, 37, 300], [128, 700, 256, 77, 300, 1], 20, seed=7)
    outs = []
    for on in (False, True):
        monkeypatch.setattr(decode_gluon, "table_prefetch", on)
        outs.append(mla_attention_triton(case.q_lat, case.latent_cache, case.meta, case.scale,
                                         case.L, prefill_gluon=True))
    assert not outs[0].isnan().any()
    assert torch.equal(outs[1], outs[0])
