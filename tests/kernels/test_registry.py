"""Backend registry: names to functions, clear errors, no triton import."""

from __future__ import annotations

import subprocess
import sys

import pytest

from moeserve.kernels.attention.mla.absorbed_triton import mla_attention_triton
from moeserve.kernels.attention.mla.reference import mla_attention_ref
from moeserve.kernels.attention.paged import paged_attention_ref
from moeserve.kernels.moe.grouped_mm import moe_grouped_mm
from moeserve.kernels.moe.measured import moe_measured
from moeserve.kernels.moe.ref import moe_loop_ref
from moeserve.kernels.registry import get_attention_backend, get_mla_backend, get_moe_backend


def test_known_backends() -> None:
    assert get_moe_backend("torch") is moe_loop_ref
    assert get_moe_backend("grouped_mm") is moe_grouped_mm
    assert get_moe_backend("measured") is moe_measured
    assert get_attention_backend("torch") is paged_attention_ref
    assert get_mla_backend("torch") is mla_attention_ref
    assert get_mla_backend("triton") is mla_attention_triton


def test_the_tile_source_is_bound_into_the_backends_that_read_tiles() -> None:
    from moeserve.kernels.moe.fused_triton import moe_triton

    assert get_moe_backend("triton", tiles="tuned") is moe_triton  # the function's own default
    assert get_moe_backend("measured", tiles="tuned") is moe_measured
    for name, fn in (("triton", moe_triton), ("measured", moe_measured)):
        bound = get_moe_backend(name, tiles="default")
        assert bound.func is fn and bound.args == () and bound.keywords == {"tiles": "default"}
    assert get_moe_backend("grouped_mm", tiles="default") is moe_grouped_mm  # no tiles to bind
    assert get_moe_backend("torch", tiles="default") is moe_loop_ref
    with pytest.raises(ValueError, match=r"MoE tiles must be one of tuned, default; got 'x'"):
        get_moe_backend("triton", tiles="x")


def test_unknown_backend_names_the_choices() -> None:
    with pytest.raises(ValueError, match=r"moe_backend .cutlass.; "
                       r"choices: grouped_mm, measured, torch, triton"):
        get_moe_backend("cutlass")
    with pytest.raises(ValueError, match=r"attention_backend 'flash'; choices: torch, triton"):
        get_attention_backend("flash")
    with pytest.raises(ValueError, match=r"mla_backend 'flashmla'; choices: torch, triton"):
        get_mla_backend("flashmla")


def test_importing_kernels_does_not_import_triton() -> None:
    code = ("import sys, moeserve.kernels.registry, moeserve.kernels.routing.select, "
            "moeserve.kernels.moe.ref; assert 'triton' not in sys.modules, 'triton imported'")
    result = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stderr
