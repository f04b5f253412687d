"""The swapped Gluon MLA decode (kernels/attention/mla/decode_gluon_swapped.py: keys as wgmma's M,
at most 32 heads) against the dense expectation of `make_mla_case`: on the GPU (sm90) only, as
Gluon has no interpreter; on CPU, that it refuses the call by name and that the switch leaves
other calls alone. Both its forms, one key stage (`one_stage`, the default: two programs an
SM) and two (MOESERVE_MLA_SWAPPED_ONE_STAGE=0), are checked by the same GPU cases."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moeserve.kernels.attention.mla import decode_gluon_swapped
from moeserve.kernels.attention.mla.decode_gluon_swapped import decode_swapped
from tests.kernels.attention.test_mla import DECODE, make_mla_case
from tests.kernels.attention.test_mla_decode_gluon import (
    check_routing,
    check_rows_fp16_and_graph,
)
from tests.kernels.attention.test_mla_triton import TOL, gpu_case


def run(case, rows: torch.Tensor | None = None, **kwargs: object) -> torch.Tensor:
    """decode_swapped over a decode-only case (all its rows, or `rows`)."""
    out = torch.zeros_like(case.q_lat[..., :case.L])
    num_rows = case.meta.num_reqs if rows is None else rows.shape[0]
    decode_swapped(case.q_lat, case.latent_cache, case.meta, case.scale, case.L, out, rows,
                   num_rows, case.meta.max_seq_len, **kwargs)
    return out


def test_refuses_what_it_cannot_take_by_name() -> None:
    case = make_mla_case(*DECODE, block_size=4, num_heads=5)
    with pytest.raises(ValueError, match="decode_gluon needs an sm90 GPU"):
        run(case)


def test_takes_at_most_its_heads() -> None:
    assert decode_gluon_swapped.takes(1) and decode_gluon_swapped.takes(20)
    assert decode_gluon_swapped.takes(decode_gluon_swapped.SWAPPED_HEADS)
    assert not decode_gluon_swapped.takes(decode_gluon_swapped.SWAPPED_HEADS + 1)
    assert not decode_gluon_swapped.takes(0)


@pytest.mark.gpu
def test_gpu_refuses_too_many_heads() -> None:
    with pytest.raises(ValueError, match="at most 32 heads, got 64"):
        run(gpu_case([100], [1], 64))


@pytest.fixture(params=[False, True], ids=["two_stages", "one_stage"])
def stages(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """The kernel's two-stage form, and its one-stage form (the default)."""
    monkeypatch.setattr(decode_gluon_swapped, "one_stage", request.param)
    return request.param


@pytest.mark.gpu
@pytest.mark.parametrize("num_heads", [16, 20, 32])
@pytest.mark.parametrize(("batch", "max_context"), [(4, 4096), (64, 2048), (300, 256)])
def test_gpu_decode_matches(num_heads: int, batch: int, max_context: int, stages: bool) -> None:
    """Rows of 1 key to many tiles, with the default split count (one wave of programs) and
    forced ones (1: unsplit; 3: partitions of unequal tiles)."""
    rng = np.random.default_rng(batch)
    computed = rng.integers(0, max_context, batch).tolist()
    computed[0] = max_context - 1
    case = gpu_case(computed, [1] * batch, num_heads, seed=batch)
    tol = TOL[torch.bfloat16]
    for splits in (None, 1, 3):
        out = run(case, num_splits=splits)
        assert not out.isnan().any(), splits
        torch.testing.assert_close(out.float(), case.expected_latent, atol=tol, rtol=tol,
                                   msg=f"splits {splits}")


@pytest.mark.gpu
def test_gpu_chosen_rows_fp16_and_a_cuda_graph(stages: bool) -> None:
    """Chosen rows in fp16, then a CUDA graph's replays, equal to decode_gluon's result."""
    check_rows_fp16_and_graph(decode_swapped,
                              lambda case: {"max_seq_len": case.meta.max_seq_len}, 20)


@pytest.mark.gpu
def test_gpu_the_switch_routes_few_head_launches(monkeypatch: pytest.MonkeyPatch) -> None:
    """decode_gluon.swapped on: a decode_gluon call of at most 32 heads runs the swapped
    kernel; 64 heads, or a forced tile, do not."""
    check_routing(monkeypatch, decode_gluon_swapped, "decode_swapped", "swapped", 20)
