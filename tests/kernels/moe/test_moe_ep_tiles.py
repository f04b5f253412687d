"""A rank that holds some of the experts (expert parallelism) looks its MoE tiles up at its own
pairs' density: `tile_tokens`. Of T x k pairs only about E_local / E_routed are its own (the
rest are -1), as many a local expert as E_local experts alone draw from T x E_local / E_routed
tokens; its tuned file is its local shape's, and the entry taken is that count's."""

from __future__ import annotations

import functools
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from moeserve.config import load_model_config
from moeserve.kernels.moe.grouped_mm import moe_grouped_mm
from moeserve.kernels.moe.measured import moe_measured
from moeserve.kernels.moe.tile_configs import tile_tokens
from moeserve.kernels.registry import bind_routed_experts, get_moe_backend, moe_tile_source
from moeserve.layers.moe import SparseMoeBlock
from tests.kernels.moe.test_moe_measured import (
    SMALL,
    TWO_BACKENDS,
    Spy,
    experts_and_tokens,
    write_tuned,
)

pytestmark = pytest.mark.usefixtures("isolated_config_dirs")  # conftest.py

ROUTED = 64  # the model's routed experts; test_moe_measured's E = 8 on this rank


def test_tile_tokens_scale_by_the_share_of_experts_held() -> None:
    assert tile_tokens(1024, 32, 256) == 128  # GLM-5 under EP 8
    assert tile_tokens(100, 32, 256) == 13  # rounded up
    assert tile_tokens(3, 32, 256) == 1  # never below one token
    assert tile_tokens(1024, 256, 256) == tile_tokens(1024, 256) == 1024  # every expert held
    assert tile_tokens(0, 32, 256) == 0


def test_a_sharded_rank_takes_the_entry_of_its_density(isolated_config_dirs: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    write_tuned(isolated_config_dirs / "env", TWO_BACKENDS)
    spy = Spy(monkeypatch)
    x, w13, w2, weights, ids = experts_and_tokens(16)
    whole = moe_measured(x, w13, w2, weights, ids)  # the 16-token entry: triton, BLOCK_N 32
    sharded = moe_measured(x, w13, w2, weights, ids, routed_experts=ROUTED)  # 16 x 8/64 = 2
    assert [(name, (config or {}).get("BLOCK_N")) for name, _, config in spy.calls] == [
        ("triton", 32), ("grouped_mm", None)]
    torch.testing.assert_close(sharded, whole, rtol=1e-4, atol=1e-5)  # same experts, same sum


def test_the_capacity_report_shows_a_ranks_entries(isolated_config_dirs: Path) -> None:
    from moeserve.engine.moe_setup import moe_configs

    write_tuned(isolated_config_dirs / "env", {2: SMALL, 16: {**SMALL, "BLOCK_N": 32}},
                device="Fake GPU", dtype=torch.float16)
    cfg = SimpleNamespace(moe_backend="triton", moe_tiles="tuned",
                          scheduler=SimpleNamespace(max_num_batched_tokens=128))
    mc = SimpleNamespace(num_experts=ROUTED, num_experts_per_tok=2)
    report = moe_configs(cfg, mc, torch.float16, "Fake GPU", (8, 32, 16))
    assert report["128"]["tuned_tokens"] == 16  # 128 x 8 / 64
    assert report["64"]["tuned_tokens"] == 2  # 8 tokens' density: 2 is nearer than 16


def test_only_the_tiled_backends_are_bound_and_their_tile_source_kept() -> None:
    triton = bind_routed_experts(get_moe_backend("triton"), ROUTED)
    assert isinstance(triton, functools.partial) and triton.keywords == {
        "routed_experts": ROUTED}
    default = bind_routed_experts(get_moe_backend("measured", tiles="default"), ROUTED)
    assert default.keywords == {"tiles": "default", "routed_experts": ROUTED}
    assert moe_tile_source(default) == "default"
    assert bind_routed_experts(moe_grouped_mm, ROUTED) is moe_grouped_mm  # no tiles


def test_a_block_holding_some_experts_binds_the_models_count() -> None:
    mc = load_model_config("tiny-moe")[0]
    e = mc.num_experts
    sharded = SparseMoeBlock(mc, get_moe_backend("measured"), torch.float32, "cpu",
                             experts=(e // 2, e // 2))
    assert sharded.backend.keywords == {"routed_experts": e}
    whole = SparseMoeBlock(mc, get_moe_backend("measured"), torch.float32, "cpu")
    assert whole.backend is moe_measured
