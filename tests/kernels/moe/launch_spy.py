"""A spy on a fused-MoE module's `_launch`: each launch's tiles recorded, then the launch run."""

from __future__ import annotations

from types import ModuleType

import pytest


def spy_launches(monkeypatch: pytest.MonkeyPatch, module: ModuleType,
                 config_arg: int) -> list[dict]:
    """The tiles each `module._launch` call gets (its positional argument `config_arg`), in
    order; the launches still run."""
    launched: list[dict] = []
    real_launch = module._launch

    def spy(*args: object, **kwargs: object) -> None:
        launched.append(args[config_arg])
        real_launch(*args, **kwargs)

    monkeypatch.setattr(module, "_launch", spy)
    return launched
