"""The MoE tile lookup on a device of the same chip as one with committed tiles
(tile_configs.SAME_CHIP: the H100 SXM and the H200): the package's committed file of the other
is used as it is and reported as such, never a cached or env-folder one of the other device,
never for another chip; the device's own file wins; a start-up tune is not run over it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from moeserve.kernels.moe import tile_configs as moe_configs
from moeserve.kernels.moe.quant.configs import find_quant_tuned, quant_config_file_name
from moeserve.kernels.moe.quant.tune import ensure_quant_tuned
from moeserve.kernels.moe.tile_configs import (
    committed_detail,
    config_file_name,
    find_tuned,
    get_moe_config,
    same_chip_devices,
    tile_config,
)
from moeserve.kernels.moe.tune import ensure_tuned

E, H, N, K = 8, 32, 16, 2
H100, H200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"
SMALL = tile_config(16, 16, 16, 1, 4, 2)
LARGE = tile_config(64, 64, 32, 8, 8, 3)


def write(directory: Path, name: str, config: dict) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_text(json.dumps({"meta": {}, "configs": {"64": config}}))
    moe_configs.clear_caches()
    return path


def bf16_name(device: str) -> str:
    return config_file_name(E, H, N, torch.float16, device)


def test_same_chip_devices() -> None:
    assert same_chip_devices(H100) == [H200] and same_chip_devices(H200) == [H100]
    assert same_chip_devices("NVIDIA H100 PCIe") == [] and same_chip_devices("cpu") == []


def test_an_h100_uses_the_h200s_committed_tiles_only(isolated_config_dirs: Path) -> None:
    # the H200's file in the env folder and the cache: another device's tune, not borrowed
    write(isolated_config_dirs / "env", bf16_name(H200), SMALL)
    write(isolated_config_dirs / "cache" / "moe_configs", bf16_name(H200), SMALL)
    assert find_tuned(E, H, N, torch.float16, H100) is None
    committed = write(isolated_config_dirs / "package", bf16_name(H200), SMALL)
    path, table = find_tuned(E, H, N, torch.float16, H100)
    assert path == str(committed) and list(table) == [64]
    choice = get_moe_config(E, H, N, K, torch.float16, 64, H100)
    assert choice.tuned and choice.source == str(committed) and choice.config == SMALL
    assert find_tuned(E, H, N, torch.float16, "NVIDIA H100 PCIe") is None  # another chip
    # the device's own file, wherever it is, wins over the other's committed one
    own = write(isolated_config_dirs / "cache" / "moe_configs", bf16_name(H100), LARGE)
    assert find_tuned(E, H, N, torch.float16, H100)[0] == str(own)


def test_a_start_up_tune_is_not_run_over_the_borrowed_file(isolated_config_dirs: Path) -> None:
    committed = write(isolated_config_dirs / "package", bf16_name(H200), SMALL)

    def timer(part: str, config: dict, num_tokens: int) -> float:
        raise AssertionError("a committed file of the same chip is not re-tuned")

    outcome = ensure_tuned(E, H, N, K, torch.float16, 8192, timer=timer, device_name=H100,
                           log=lambda s: None)
    assert outcome.tuned and outcome.source == str(committed)
    assert outcome.detail == committed_detail(str(committed), H100)
    assert outcome.detail.startswith(f"committed, tuned on {H200} (the same chip")
    assert committed_detail(str(committed), H200) == "committed"


def test_quantized_tiles_follow_the_same_rule(isolated_config_dirs: Path) -> None:
    def name(device: str) -> str:
        return quant_config_file_name("nvfp4", E, H, N, K, 16, torch.float32, device)

    write(isolated_config_dirs / "cache" / "moe_configs", name(H200), LARGE)
    assert find_quant_tuned("nvfp4", E, H, N, K, 16, torch.float32, H100) is None
    committed = write(isolated_config_dirs / "package", name(H200), LARGE)
    assert find_quant_tuned("nvfp4", E, H, N, K, 16, torch.float32, H100)[0] == str(committed)
    outcome = ensure_quant_tuned("nvfp4", E, H, N, K, 16, torch.float32, 8192,
                                 timer=lambda c, n: pytest.fail("a committed file is kept"),
                                 device_name=H100, log=lambda s: None)
    assert outcome.tuned and outcome.detail.startswith(f"committed, tuned on {H200}")
