"""kernels/triton_common.py's launch rule for programmatic dependent launch: which launches
take it, and that a kernel's wait and the launch attribute always come together."""

from __future__ import annotations

import pytest
import torch

from moeserve import envs
from moeserve.kernels import triton_common
from tests.fresh_import import attribute_at_import


def test_the_environment_sets_the_pdl_level() -> None:
    """MOESERVE_PDL=0 to 3 sets the level at import (a served A/B's processes); unset, 2."""
    for value, want in ((None, "2"), ("1", "1"), ("2", "2"), ("3", "3"), ("0", "0")):
        assert attribute_at_import("moeserve.kernels.triton_common", "pdl", envs.PDL,
                                   value) == want


def test_an_unknown_pdl_level_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """A value other than 0, 1 or 2 is an error naming the variable, not a silent off."""
    monkeypatch.setenv(envs.PDL, "yes")
    with pytest.raises(ValueError, match="MOESERVE_PDL='yes'"):
        envs.pdl()


def test_pdl_only_on_hopper_cuda_and_only_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """Off: every launch plain (its PDL constexpr 0, no launch_pdl). On (level 1 or 2): CUDA
    devices of compute capability 9 or more launch with it, the level compiled in with the
    attribute; older GPUs and the interpreter's CPU tensors stay plain."""
    capability = {0: (9, 0), 1: (8, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: capability[index])
    triton_common._major_of.cache_clear()
    hopper, ampere, cpu = torch.device("cuda", 0), torch.device("cuda", 1), torch.device("cpu")
    monkeypatch.setattr(triton_common, "pdl", 0)
    assert [triton_common.pdl_kwargs(d) for d in (hopper, ampere, cpu)] == [{"PDL": 0}] * 3
    for level in (1, 2, 3):
        monkeypatch.setattr(triton_common, "pdl", level)
        assert triton_common.pdl_kwargs(hopper) == {"PDL": level, "launch_pdl": True}
        assert triton_common.pdl_kwargs(ampere) == triton_common.pdl_kwargs(cpu) == {"PDL": 0}
    triton_common._major_of.cache_clear()  # no fake capability left for later tests


def test_queries_made_earlier_holds_only_within_its_block() -> None:
    """The early-queries context is set inside the block only, and reset on an error too."""
    assert not triton_common.queries_early()
    with triton_common.queries_made_earlier():
        assert triton_common.queries_early()
    assert not triton_common.queries_early()
    with pytest.raises(RuntimeError), triton_common.queries_made_earlier():
        raise RuntimeError("a launch failed")
    assert not triton_common.queries_early()
