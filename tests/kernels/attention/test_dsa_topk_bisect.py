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
    (device, ties, warps, row alignment), not again. (The launch count itself is the GPU
    specialization test's.)"""
    built: list[dict] = []

    class Kernel:
        def warmup(self, *args, grid, **constexprs):
            built.append({"grid": grid, **constexprs})
    monkeypatch.setattr(bisect, "_kernels", lambda: SimpleNamespace(bisect=Kernel()))
    monkeypatch.setattr(bisect, "_compiled", set())
    args = (torch.zeros(2, 100, dtype=torch.int32),)
    bisect._compile_every_width(args, False, False)
    bisect._compile_every_width(args, False, False)  # once
    # each chunk count at both warp counts the rule may pick
    assert [(b["CHUNKS"], b["num_warps"]) for b in built] == [
        (c, w) for w in (bisect.WARPS_FEW, bisect.WARPS_MANY) for c in (1, 2, 3, 4)]
    assert all(b["CHUNK"] == bisect.CHUNK and not b["COUNT_TIES"] and not b["ALIGNED"]
               for b in built)
    bisect._compile_every_width(args, True, False)  # the tie-counting variants are others
    assert [b["CHUNKS"] for b in built[8:]] == [1, 2, 3, 4] * 2
    bisect._compile_every_width(args, False, True)  # the aligned rows' variants too
    assert [b["CHUNKS"] for b in built[16:] if b["ALIGNED"]] == [1, 2, 3, 4] * 2
    monkeypatch.setattr(bisect, "WARPS", 32)  # a forced count: its variants alone
    bisect._compile_every_width(args, False, False)
    assert [(b["CHUNKS"], b["num_warps"]) for b in built[24:]] == [(c, 32) for c in (1, 2, 3, 4)]


def test_warps_by_tokens_against_the_sms(monkeypatch: pytest.MonkeyPatch) -> None:
    """16 warps a program up to one program an SM, 8 past the SM count (two an SM); a forced
    WARPS wins; off CUDA (the interpreter) the first."""
    monkeypatch.setattr(bisect, "num_sms", lambda device: 132)
    cuda = torch.device("cuda", 0)
    assert [bisect.warps(n, cuda) for n in (1, 32, 132, 133, 256)] == [16, 16, 16, 8, 8]
    assert bisect.warps(256, torch.device("cpu")) == 16
    monkeypatch.setattr(bisect, "WARPS", 32)
    assert bisect.warps(256, cuda) == bisect.warps(1, cuda) == 32


@pytest.mark.parametrize("width", [13000, 13008])
@pytest.mark.parametrize("values", ["random", "ties"])
def test_rows_over_several_register_chunks(values: str, width: int) -> None:
    """Rows of 2-4 register chunks, contexts ending in each chunk and at its edges; heavy ties
    spanning chunks taken lowest first. Both row layouts: a width that is a multiple of
    ROW_ALIGN (13,008) reads on to each end rounded up to 16, whose scores past the end
    (random here, above the selected ones as often as not) must not be taken."""
    assert (width % bisect.ROW_ALIGN == 0) == (width == 13008)
    gen = torch.Generator().manual_seed(11)
    topk = 2048
    ends = [width, 4096, 4097, 8193, 2049, 12288 + 7]
    scores = (torch.randn(len(ends), width, generator=gen) if values == "random" else
              torch.randint(0, 5, (len(ends), width), generator=gen).float())
    out = torch.full((len(ends), topk), GARBAGE, dtype=torch.int32)
    ties = radix_topk(ord_of(scores), rows_meta(ends), 0, topk, out, count_boundary_ties=True,
                      form="bisect")
    want, want_ties = want_topk(scores, ends, topk)
    assert torch.equal(out, want) and ties == want_ties
