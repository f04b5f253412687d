"""kernels/triton_common.py's launch rule for programmatic dependent launch: which launches
take it, and that a kernel's wait and the launch attribute always come together."""

from __future__ import annotations

import pytest
import torch

from moeserve import envs
from moeserve.kernels import triton_common
from tests.fresh_import import attribute_at_import


def test_the_environment_turns_pdl_on() -> None:
    """MOESERVE_PDL=1 sets the switch at import (a served A/B's processes); unset, off."""
    for value, want in ((None, "False"), ("1", "True"), ("0", "False")):
        assert attribute_at_import("moeserve.kernels.triton_common", "pdl", envs.PDL,
                                   value) == want


def test_pdl_only_on_hopper_cuda_and_only_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """Off: every launch plain (its PDL constexpr False, no launch_pdl). On: CUDA devices of
    compute capability 9 or more launch with it, the wait compiled in with the attribute; older
    GPUs and the interpreter's CPU tensors stay plain."""
    capability = {0: (9, 0), 1: (8, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: capability[index])
    triton_common._major_of.cache_clear()
    hopper, ampere, cpu = torch.device("cuda", 0), torch.device("cuda", 1), torch.device("cpu")
    monkeypatch.setattr(triton_common, "pdl", False)
    assert [triton_common.pdl_kwargs(d) for d in (hopper, ampere, cpu)] == [{"PDL": False}] * 3
    monkeypatch.setattr(triton_common, "pdl", True)
    assert triton_common.pdl_kwargs(hopper) == {"PDL": True, "launch_pdl": True}
    assert triton_common.pdl_kwargs(ampere) == triton_common.pdl_kwargs(cpu) == {"PDL": False}
    triton_common._major_of.cache_clear()  # no fake capability left for later tests
