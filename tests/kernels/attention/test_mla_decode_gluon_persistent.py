"""The persistent Gluon MLA decode (kernels/attention/mla/decode_gluon_persistent.py) against
the dense expectation of `make_mla_case`: on the GPU (sm90) only, as Gluon has no interpreter;
on CPU, that it refuses the call by name."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moeserve.kernels.attention.mla import decode_gluon
from moeserve.kernels.attention.mla.decode_gluon_persistent import decode_persistent
from tests.kernels.attention.test_mla import DECODE, make_mla_case
from tests.kernels.attention.test_mla_decode_gluon import check_rows_fp16_and_graph
from tests.kernels.attention.test_mla_triton import TOL, gpu_case


def run(case, rows: torch.Tensor | None = None, **kwargs: object) -> torch.Tensor:
    """decode_persistent over a decode-only case (all its rows, or `rows`)."""
    out = torch.zeros_like(case.q_lat[..., :case.L])
    num_rows = case.meta.num_reqs if rows is None else rows.shape[0]
    decode_persistent(case.q_lat, case.latent_cache, case.meta, case.scale, case.L, out, rows,
                      num_rows, **kwargs)
    return out


def test_refuses_what_it_cannot_take_by_name() -> None:
    case = make_mla_case(*DECODE, block_size=4, num_heads=5)
    with pytest.raises(ValueError, match="decode_gluon needs an sm90 GPU"):
        run(case)


@pytest.mark.gpu
def test_gpu_two_stages_only() -> None:
    with pytest.raises(ValueError, match="stages must be 2, got 3"):
        run(gpu_case([100], [1], 20), stages=3, block_n=32)


@pytest.mark.gpu
@pytest.mark.parametrize("num_heads", [16, 20, 64, 128])
@pytest.mark.parametrize(("batch", "max_context"), [(4, 4096), (64, 2048), (300, 256)])
def test_gpu_decode_matches(num_heads: int, batch: int, max_context: int) -> None:
    """Rows of 1 key to several tiles, a program an SM and few programs (each walking many
    items across row boundaries, some programs one item more than others)."""
    rng = np.random.default_rng(batch)
    computed = rng.integers(0, max_context, batch).tolist()
    computed[0] = max_context - 1
    case = gpu_case(computed, [1] * batch, num_heads, seed=batch)
    tol = TOL[torch.bfloat16]
    for programs in (None, 1, 3, 7):
        out = run(case, programs=programs)
        assert not out.isnan().any(), programs
        torch.testing.assert_close(out.float(), case.expected_latent, atol=tol, rtol=tol,
                                   msg=f"programs {programs}")


@pytest.mark.gpu
def test_gpu_chosen_rows_fp16_and_a_cuda_graph() -> None:
    """Chosen rows in fp16 (two programs), then a CUDA graph's replays at 64 heads."""
    check_rows_fp16_and_graph(decode_persistent, lambda case: {"programs": 2}, 64)


@pytest.mark.gpu
def test_gpu_the_switch_routes_unsplit_launches(monkeypatch: pytest.MonkeyPatch) -> None:
    """decode_gluon.persistent on: an unsplit decode_gluon call (many rows) runs the persistent
    kernel, a split one (few rows, long contexts) or a forced split count does not."""
    from moeserve.kernels.attention.mla import decode_gluon_persistent

    calls: list[int] = []
    real = decode_gluon_persistent.decode_persistent
    monkeypatch.setattr(decode_gluon_persistent, "decode_persistent",
                        lambda *a, **k: (calls.append(a[7]), real(*a, **k))[1])
    monkeypatch.setattr(decode_gluon, "persistent", True)
    tol = TOL[torch.bfloat16]
    many = gpu_case(np.random.default_rng(0).integers(1, 256, 600).tolist(), [1] * 600, 20)
    few = gpu_case([4000, 3000], [1, 1], 20, seed=1)
    for case, kwargs, want in ((many, {}, [600]), (few, {}, []),
                               (many, {"num_splits": 1}, [])):
        calls.clear()
        out = torch.zeros_like(case.q_lat[..., :case.L])
        decode_gluon.decode_gluon(case.q_lat, case.latent_cache, case.meta, case.scale, case.L,
                                  out, None, case.meta.num_reqs, case.meta.max_seq_len, **kwargs)
        assert calls == want, kwargs
        torch.testing.assert_close(out.float(), case.expected_latent, atol=tol, rtol=tol)
