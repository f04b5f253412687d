"""The quantized fused MoE's tile lookup (kernels/moe/quant/configs.py): a tuned file read back
at the nearest token count, by the weights' layout (rows, or `layout=micro` in the name), its
entries' options (SUB_M, "down") and their errors; `moe_quant_triton` takes it with tiles
"tuned" and reads no file with tiles "default". The tuner's tests (test_moe_quant_tune.py)
write the files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from moeserve.kernels.moe import tile_configs as moe_configs
from moeserve.kernels.moe.quant import configs as quant_configs
from moeserve.kernels.moe.quant import fused_triton as fused_quant_triton
from moeserve.kernels.moe.quant.configs import (
    default_quant_config,
    get_quant_config,
    quant_config_file_name,
)
from moeserve.kernels.moe.quant.ref import moe_quant_ref
from moeserve.kernels.moe.quant.tune import ensure_quant_tuned, random_quant_experts
from moeserve.kernels.moe.tile_configs import tile_config
from moeserve.kernels.moe.timer import random_tokens
from tests.kernels.moe.launch_spy import spy_launches
from tests.kernels.moe.test_moe_quant_tune import (
    SMALL,
    E,
    H,
    K,
    N,
    fake_timer,
    tune,
    write_tuned,
)

pytestmark = pytest.mark.usefixtures("isolated_config_dirs")  # conftest.py


def test_the_lookup_reads_the_tune_back_at_the_nearest_token_count(
        isolated_config_dirs: Path) -> None:
    path = isolated_config_dirs / "env" / quant_config_file_name(
        "nvfp4", E, H, N, K, 16, torch.float32, "cpu")
    _, timer = fake_timer()
    done = tune("nvfp4", path, [1, 64], timer)
    args = ("nvfp4", E, H, N, K, 16, torch.float32)
    for num_tokens, nearest in ((1, 1), (20, 1), (40, 64), (5000, 64)):
        choice = get_quant_config(*args, num_tokens, "cpu")
        assert choice.tuned and choice.source == str(path) and choice.tuned_tokens == nearest
        assert choice.config == {k: v for k, v in done[nearest].items()
                                 if k not in ("ms", "default_ms")}  # tiles and SUB_M
    other = get_quant_config("nvfp4", E, H, N, 8, 16, torch.float32, 1, "cpu")  # top-k 8
    assert not other.tuned and other.source == "default"
    default = get_quant_config(*args, 1, "cpu", tiles="default")
    assert not default.tuned and default.config == default_quant_config("nvfp4", 1, K, E, 16)


def test_a_bad_entry_names_the_file(isolated_config_dirs: Path) -> None:
    path = write_tuned(isolated_config_dirs / "env", "fp8", {4: dict(SMALL)})  # BLOCK_K 32
    with pytest.raises(ValueError, match=rf"{path.name}: the entry for 4 tokens: .*BLOCK_K 128"):
        get_quant_config("fp8", E, H, N, K, 128, torch.float32, 4, "cpu")


def test_the_lookup_takes_the_file_of_the_weights_layout(isolated_config_dirs: Path) -> None:
    """A rows tune serves row-layout weights only, a micro one micro-tiled weights only (the
    same tiles time differently in the two); micro-tiled weights with a rows file alone take
    the micro default."""
    rows_tiles, micro_tiles = tile_config(16, 32, 32, 1, 4, 2), tile_config(16, 64, 32, 1, 4, 3)
    write_tuned(isolated_config_dirs / "env", "nvfp4", {4: {**rows_tiles, "ms": 0.1}})
    args = ("nvfp4", E, H, N, K, 16, torch.float32, 4, "cpu")
    assert get_quant_config(*args).config == rows_tiles
    micro = get_quant_config(*args, micro=True)
    assert not micro.tuned and micro.config == default_quant_config("nvfp4", 4, K, E, 16,
                                                                    (H, N), micro=True)
    path = isolated_config_dirs / "env" / quant_config_file_name(
        "nvfp4", E, H, N, K, 16, torch.float32, "cpu", layout="micro")
    path.write_text(json.dumps({"meta": {}, "configs": {"4": {**micro_tiles, "ms": 0.1}}}))
    moe_configs.clear_caches()
    assert get_quant_config(*args, micro=True).config == micro_tiles
    assert get_quant_config(*args).config == rows_tiles
    with pytest.raises(ValueError, match="weight layout must be one of"):
        quant_config_file_name("nvfp4", E, H, N, K, 16, torch.float32, "cpu", layout="cols")


def test_micro_experts_with_only_a_committed_rows_file_take_the_defaults_at_once(
        isolated_config_dirs: Path) -> None:
    write_tuned(isolated_config_dirs / "package", "nvfp4", {64: tile_config(16, 64, 128, 1, 4, 3)},
                device="Fake GPU")
    w13, w2 = random_quant_experts("nvfp4", E, H, N, 16, torch.float32, torch.device("cpu"))
    w13.micro_tiled = True  # as the engine marks them
    outcome = ensure_quant_tuned("nvfp4", E, H, N, K, 16, torch.float32, 8192,
                                 weights=(w13, w2), device_name="Fake GPU", log=lambda s: None,
                                 timer=lambda c, n: pytest.fail("no start-up tune"))
    assert not outcome.tuned and outcome.source == "default"
    assert "timed the other weight layout, not these micro experts" in outcome.detail
    w13.micro_tiled = False  # rows weights: the committed file itself
    outcome = ensure_quant_tuned("nvfp4", E, H, N, K, 16, torch.float32, 8192,
                                 weights=(w13, w2), device_name="Fake GPU", log=lambda s: None,
                                 timer=lambda c, n: pytest.fail("a committed file is kept"))
    assert outcome.tuned and outcome.detail == "committed"


def test_an_entry_with_sub_m_is_read_back_with_it(isolated_config_dirs: Path) -> None:
    sub = {**SMALL, "BLOCK_K": 128, "BLOCK_M": 64, "SUB_M": 1}
    write_tuned(isolated_config_dirs / "env", "fp8", {4: {**sub, "ms": 0.2}, 64: dict(sub)
                                                      | {"SUB_M": 0, "ms": 0.3}})
    args = ("fp8", E, H, N, K, 128, torch.float32)
    assert get_quant_config(*args, 4, "cpu").config == sub
    assert "SUB_M" not in get_quant_config(*args, 64, "cpu").config  # 0: absent, as untuned
    write_tuned(isolated_config_dirs / "env", "fp8", {4: {**sub, "PERSISTENT": 2}})
    with pytest.raises(ValueError, match=r"the entry for 4 tokens: .*PERSISTENT"):
        get_quant_config(*args, 4, "cpu")


def test_an_entry_with_down_tiles_is_read_back_with_them(isolated_config_dirs: Path) -> None:
    down = {"BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 1, "num_warps": 4, "num_stages": 3}
    split = {**SMALL, "BLOCK_K": 128, "down": down}
    write_tuned(isolated_config_dirs / "env", "fp8", {4: {**split, "ms": 0.2}})
    assert get_quant_config("fp8", E, H, N, K, 128, torch.float32, 4, "cpu").config == split
    write_tuned(isolated_config_dirs / "env", "fp8", {4: {**split, "down": down
                                                          | {"BLOCK_K": 64}}})
    with pytest.raises(ValueError, match=r"the entry for 4 tokens: .*'down': fp8 needs"):
        get_quant_config("fp8", E, H, N, K, 128, torch.float32, 4, "cpu")


def test_moe_quant_triton_takes_tuned_tiles_and_default_reads_no_file(
        isolated_config_dirs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_tuned(isolated_config_dirs / "env", "nvfp4", {2: {**SMALL, "ms": 0.1}})
    launched = spy_launches(monkeypatch, fused_quant_triton, 11)
    w13, w2 = random_quant_experts("nvfp4", E, H, N, 16, torch.float32, torch.device("cpu"))
    x, weights, ids = random_tokens(3, H, E, K, torch.float32, torch.Generator().manual_seed(1))
    expected = moe_quant_ref(x, w13, w2, weights, ids)
    tuned = fused_quant_triton.moe_quant_triton(x, w13, w2, weights, ids)  # tiles="tuned"
    assert launched == [SMALL, SMALL]  # both launches, the entry of 2 tokens (nearest 3)
    torch.testing.assert_close(tuned, expected, atol=1e-4, rtol=1e-4)

    def no_file(*args: object) -> None:
        raise AssertionError("tiles='default' reads no tuned file")

    monkeypatch.setattr(quant_configs, "find_quant_tuned", no_file)
    launched.clear()
    out = fused_quant_triton.moe_quant_triton(x, w13, w2, weights, ids, tiles="default")
    assert launched == [default_quant_config("nvfp4", 3, K, E, 16)] * 2
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="MoE tiles must be one of tuned, default"):
        fused_quant_triton.moe_quant_triton(x, w13, w2, weights, ids, tiles="x")
