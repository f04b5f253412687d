"""The Gluon MLA decode's rows launched longest context first (metadata.longest_first,
decode_gluon.longest_first, MOESERVE_DECODE_LONGEST_FIRST): the order (ties in step order, a
chosen subset of rows, one argsort a step) on the CPU, the switch handing the order to the
kernel it routes to; on the GPU (sm90), the same bits as the step order for each kernel, also
replayed from a CUDA graph."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moeserve.kernels.attention.metadata import build_attention_metadata, longest_first
from moeserve.kernels.attention.mla import decode_gluon
from tests.kernels.attention.test_mla import DECODE, make_mla_case
from tests.kernels.attention.test_mla_triton import gpu_case


def _meta(contexts: list[int]):
    tables = [[i] * (-(-c // 4)) for i, c in enumerate(contexts)]
    return build_attention_metadata([c - 1 for c in contexts], [1] * len(contexts), tables, 4,
                                    "cpu")


def test_rows_longest_context_first_ties_in_step_order() -> None:
    meta = _meta([5, 40, 17, 40, 3, 17])
    order = longest_first(meta, None)
    assert order.dtype == torch.int32 and order.tolist() == [1, 3, 2, 5, 0, 4]
    assert longest_first(meta, None) is order  # one argsort a step: its layers share it
    rows = torch.tensor([4, 0, 5, 2], dtype=torch.int32)
    chosen = longest_first(meta, rows)
    assert chosen.tolist() == [5, 2, 0, 4]  # only the chosen rows
    assert longest_first(meta, rows[:]) is chosen  # a layer's new view of the same rows
    assert longest_first(meta, rows[:3]).tolist() == [5, 0, 4]  # fewer rows: their own order
    assert longest_first(meta, None) is order


def test_the_switch_hands_the_order_to_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """decode_gluon.decode_gluon with longest_first on: the kernel it routes to (here the
    swapped one, faked: Gluon has no interpreter) gets the rows longest first; off, as given;
    a single row is launched as it is."""
    case = make_mla_case(*DECODE, block_size=4, num_heads=5)  # contexts 6, 18, 4, 41
    got: list = []

    class Swapped:
        @staticmethod
        def takes(num_heads: int) -> bool:
            return True

        @staticmethod
        def decode_swapped(q, cache, meta, scale, L, out, rows, num_rows, *rest) -> None:
            got.append(None if rows is None else rows.tolist())
    monkeypatch.setattr(decode_gluon, "_swapped", lambda: Swapped)
    monkeypatch.setattr(decode_gluon, "swapped", True)
    args = (case.q_lat, case.latent_cache, case.meta, case.scale, case.L,
            torch.empty(0))
    for on in (False, True):
        monkeypatch.setattr(decode_gluon, "longest_first", on)
        decode_gluon.decode_gluon(*args, None, 4, case.meta.max_seq_len)
        decode_gluon.decode_gluon(*args, torch.tensor([2, 0], dtype=torch.int32), 2,
                                  case.meta.max_seq_len)
        decode_gluon.decode_gluon(*args, torch.tensor([1], dtype=torch.int32), 1,
                                  case.meta.max_seq_len)
    assert got == [None, [2, 0], [1], [3, 1, 0, 2], [0, 2], [1]]


@pytest.mark.gpu
@pytest.mark.parametrize("num_heads", [20, 64, 128])
def test_gpu_longest_first_gives_the_same_bits(monkeypatch: pytest.MonkeyPatch,
                                               num_heads: int) -> None:
    """W1-like contexts (129-256 keys) and a few long rows (the warp-specialized kernel's past
    1,024 keys at 64+ heads): every row's output bit for bit as in step order, eager and
    replayed from a CUDA graph with new queries."""
    rng = np.random.default_rng(num_heads)
    computed = rng.integers(128, 256, 300).tolist()
    computed[7] = computed[100] = 3000
    case = gpu_case(computed, [1] * 300, num_heads, seed=num_heads)
    args = (case.q_lat, case.latent_cache, case.meta, case.scale, case.L)

    def run(out: torch.Tensor) -> torch.Tensor:
        decode_gluon.decode_gluon(*args, out, None, 300, case.meta.max_seq_len)
        return out
    monkeypatch.setattr(decode_gluon, "longest_first", False)
    want = run(torch.zeros_like(case.q_lat[..., :case.L]))
    monkeypatch.setattr(decode_gluon, "longest_first", True)
    out = run(torch.zeros_like(want))
    assert not want.isnan().any() and torch.equal(out, want)
    case.meta.derived.clear()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run(out)
    case.q_lat.copy_(torch.randn(case.q_lat.shape, device="cuda",
                                 generator=torch.Generator(device="cuda").manual_seed(1)))
    graph.replay()
    monkeypatch.setattr(decode_gluon, "longest_first", False)
    assert torch.equal(out, run(torch.zeros_like(want)))
