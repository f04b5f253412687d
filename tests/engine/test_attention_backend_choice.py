"""The engine picks its attention backend before loading anything (config.resolve_static): on
CUDA the Triton paged attention where it takes the model's heads, the torch reference (with the
reason) where it does not, and an explicit 'triton' it cannot serve is refused by name."""

from __future__ import annotations

import pytest

from moeserve.config import ConfigError, EngineConfig, load_model_config, resolve_static


def _resolve(head_dim: int | None, cuda: bool = True, **engine: object):
    overrides = {"head_dim": head_dim} if head_dim is not None else None
    model, preset = load_model_config("tiny-moe", overrides)
    cfg = EngineConfig(model="tiny-moe", device="cuda" if cuda else "auto", **engine)
    return resolve_static(cfg, model, preset, cuda_available=cuda)


def test_cuda_takes_triton_for_a_power_of_two_head() -> None:
    cfg, why = _resolve(64)
    assert cfg.attention_backend == "triton"
    assert "Triton paged attention" in why["attention_backend"]


def test_cuda_falls_back_to_torch_for_head_dim_80() -> None:
    cfg, why = _resolve(80)
    assert cfg.attention_backend == "torch"
    assert "head_dim 80" in why["attention_backend"]


def test_explicit_triton_with_head_dim_80_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="head_dim 80"):
        _resolve(80, attention_backend="triton")


def test_cpu_stays_on_torch() -> None:
    cfg, why = _resolve(None, cuda=False)
    assert cfg.attention_backend == "torch"
    assert "interpreted on CPU" in why["attention_backend"]


def test_mla_models_are_not_judged_by_head_dim() -> None:
    model, preset = load_model_config("glm-4.7-flash", {"num_hidden_layers": 1})
    cfg, _ = resolve_static(EngineConfig(model="glm-4.7-flash", device="cuda"), model, preset,
                            cuda_available=True)
    assert cfg.attention_backend == "triton"
