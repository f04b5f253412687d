"""Fixtures of the kernel tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from moeserve.kernels.moe import tile_configs as moe_configs


@pytest.fixture
def isolated_config_dirs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Config lookup sees only tmp folders: the env folder, an empty package folder, the cache
    (the MoE tile-config test modules use it for every test: their `pytestmark`)."""
    monkeypatch.setenv(moe_configs.CONFIG_DIR_ENV, str(tmp_path / "env"))
    monkeypatch.setenv("MOESERVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(moe_configs, "PACKAGE_CONFIG_DIR", tmp_path / "package")
    moe_configs.clear_caches()
    yield tmp_path
    moe_configs.clear_caches()
