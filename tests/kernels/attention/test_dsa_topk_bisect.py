"""DSA's bisect top-k (attention/dsa/topk_bisect_triton.py) on what only it has: its register
bound (rows past 16,384 positions refused, nothing written), rows over 2-4 register chunks
(the CPU runs the GPU's chunk loop; test_dsa_topk_triton.py's rows, run in every form, fit one
chunk), its build of every chunk-count variant at a device's first call; and the form switch
MOESERVE_DSA_TOPK_FORM. Against test_dsa_topk_triton.py's torch statement of the contract."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from moeserve import envs
from moeserve.kernels.attention.dsa import topk_bisect_triton as bisect
from moeserve.kernels.attention.dsa import topk_triton
from moeserve.kernels.attention.dsa.topk_triton import radix_topk
from tests.fresh_import import attribute_at_import
from tests.kernels.attention.test_dsa_topk_triton import GARBAGE, ord_of, rows_meta, want_topk


def test_the_environment_sets_the_default_form() -> None:
    """MOESERVE_DSA_TOPK_FORM is FORM at import (a served A/B's processes); unset, "auto".
    In a fresh interpreter: reloading the module here would unbind the jitted helpers other
    forms' modules hold."""
    for value, want in ((None, "auto"), ("bisect", "bisect")):
        assert attribute_at_import("moeserve.kernels.attention.dsa.topk_triton", "FORM",
                                   envs.DSA_TOPK_FORM, value) == want


def test_bisect_holds_rows_to_its_register_bound() -> None:
    """The row is in registers, chunks of 4,096 positions (a compiled variant a count): rows
    past MAX_KEYS refused by name, nothing written (the other forms take them)."""
    assert [bisect.num_chunks(k) for k in (1, 4096, 4097, 12288, bisect.MAX_KEYS)] == [
        1, 1, 2, 3, 4]
    assert topk_triton.BISECT_MAX_KEYS <= bisect.MAX_KEYS  # "auto" never hands it a wider row
    wide = torch.zeros(1, bisect.MAX_KEYS + 1, dtype=torch.int32)
    out = torch.full((1, 8), GARBAGE, dtype=torch.int32)
    with pytest.raises(ValueError, match="rows of 16385 positions, at most 16384"):
        radix_topk(wide, rows_meta([40]), 0, 8, out, form="bisect")
    assert (out == GARBAGE).all()  # nothing written


def test_bisect_builds_every_chunk_count_at_its_first_call(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA the first call of a device compiles the kernel at every register chunk count
    (warmup: no launch), so that a later step's wider rows do not compile mid-serving; once a
    (device, ties, warps), not again. (The launch count itself is the GPU specialization
    test's.)"""
    built: list[dict] = []

    class Kernel:
        def warmup(self, *args, grid, **constexprs):
            built.append({"grid": grid, **constexprs})
    monkeypatch.setattr(bisect, "_kernels", lambda: SimpleNamespace(bisect=Kernel()))
    monkeypatch.setattr(bisect, "_compiled", set())
    args = (torch.zeros(2, 100, dtype=torch.int32),)
    bisect._compile_every_width(args, False)
    bisect._compile_every_width(args, False)  # once
    assert [b["CHUNKS"] for b in built] == [1, 2, 3, 4]
    assert all(b["CHUNK"] == bisect.CHUNK and b["num_warps"] == bisect.WARPS
               and not b["COUNT_TIES"] for b in built)
    bisect._compile_every_width(args, True)  # the tie-counting variants are others
    assert [b["CHUNKS"] for b in built[4:]] == [1, 2, 3, 4]


@pytest.mark.parametrize("digit", [1, 4])
@pytest.mark.parametrize("values", ["random", "ties"])
def test_rows_over_several_register_chunks(values: str, digit: int,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows of 2-4 register chunks, contexts ending in each chunk and at its edges; heavy ties
    spanning chunks taken lowest first (every round run, no exact count); at one threshold
    bit a round and at a 4-bit digit a round."""
    monkeypatch.setattr(bisect, "DIGIT_BITS", digit)
    gen = torch.Generator().manual_seed(11)
    width, topk = 13000, 2048
    ends = [width, 4096, 4097, 8193, 2049, 12288 + 7]
    scores = (torch.randn(len(ends), width, generator=gen) if values == "random" else
              torch.randint(0, 5, (len(ends), width), generator=gen).float())
    out = torch.full((len(ends), topk), GARBAGE, dtype=torch.int32)
    ties = radix_topk(ord_of(scores), rows_meta(ends), 0, topk, out, count_boundary_ties=True,
                      form="bisect")
    want, want_ties = want_topk(scores, ends, topk)
    assert torch.equal(out, want) and ties == want_ties


@pytest.mark.parametrize("case", ["signs", "one_above_topk", "exact_early", "all_equal",
                                  "one_ulp_apart"])
def test_a_digit_a_round_selects_as_a_bit_a_round(case: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """4-bit digits from histograms select what single bits do: the top digit's round
    (negative and positive scores), a context one past topk, counts exact after the first
    round, a row of one value (every round to the last), scores a few ulps apart (the low
    digits choose)."""
    topk = 64
    gen = torch.Generator().manual_seed(5)
    if case == "signs":
        scores, ends = torch.randn(3, 300, generator=gen) * 1e3, [300, 200, 65]
    elif case == "one_above_topk":
        scores, ends = torch.randn(2, 300, generator=gen), [topk + 1, topk + 1]
    elif case == "exact_early":  # 64 scores far above the rest: the first round splits them
        scores = -torch.rand(2, 300, generator=gen)
        scores[:, 100:164] = 1e30
        ends = [300, 250]
    elif case == "all_equal":
        scores, ends = torch.full((2, 300), -2.5), [300, 100]
    else:
        ulps = torch.randint(0, 300, (2, 300), generator=gen, dtype=torch.int32)
        scores = (torch.tensor(1.5).view(torch.int32) + ulps).view(torch.float32)
        scores[1] = -scores[1]
        ends = [300, 290]
    want, want_ties = want_topk(scores, ends, topk)
    for digit in (1, 4):
        monkeypatch.setattr(bisect, "DIGIT_BITS", digit)
        out = torch.full((len(ends), topk), GARBAGE, dtype=torch.int32)
        ties = radix_topk(ord_of(scores), rows_meta(ends), 0, topk, out,
                          count_boundary_ties=True, form="bisect")
        assert torch.equal(out, want) and ties == want_ties, digit


def test_bisect_refuses_other_digit_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """DIGIT_BITS is 1 or 4, by name otherwise; nothing written."""
    monkeypatch.setattr(bisect, "DIGIT_BITS", 2)
    out = torch.full((1, 8), GARBAGE, dtype=torch.int32)
    with pytest.raises(ValueError, match="DIGIT_BITS must be 1 or 4, got 2"):
        radix_topk(torch.zeros(1, 40, dtype=torch.int32), rows_meta([40]), 0, 8, out,
                   form="bisect")
    assert (out == GARBAGE).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("digit", [1, 4])
def test_gpu_both_digit_widths(digit: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA, rows of 1-4 register chunks at a bit and at a 4-bit digit a round: random
    scores (counts exact early) and heavy ties (every round run)."""
    monkeypatch.setattr(bisect, "DIGIT_BITS", digit)
    gen = torch.Generator().manual_seed(digit)
    width = 16000
    ends = [width, 2048, 2049, 5000, 0, width - 1, 4096, 4097, 12000]
    for scores in (torch.randn(len(ends), width, generator=gen),
                   torch.randint(0, 7, (len(ends), width), generator=gen).float() * 0.5):
        meta = rows_meta(ends)
        meta = SimpleNamespace(**{k: v.cuda() for k, v in vars(meta).items()})
        out = torch.full((len(ends), 2048), GARBAGE, dtype=torch.int32, device="cuda")
        ties = radix_topk(ord_of(scores).cuda(), meta, 0, 2048, out, count_boundary_ties=True,
                          form="bisect")
        want, want_ties = want_topk(scores, ends, 2048)
        assert torch.equal(out.cpu(), want) and ties == want_ties
