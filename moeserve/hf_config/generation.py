"""The model's own sampling defaults: generation_config.json's temperature, top_p, top_k, min_p,
repetition_penalty and max_new_tokens, for the fields a request leaves out (vLLM's
`--generation-config auto`, SGLang's `--sampling-defaults model`). A request's own value always
wins; `--generation-config none` keeps moeserve's neutral defaults (temperature 1, top_p 1, no
top_k, min_p or repetition penalty). Torch-free: the API processes read it.

    source "auto"     the model folder's generation_config.json (a preset has none: {})
    source "none"     {} ("vllm" is accepted for it, vLLM's name)
    source a folder   its generation_config.json, which must exist
"""

from __future__ import annotations

import json
import os
from typing import Any

from moeserve.config import ConfigError

# generation_config.json's name -> SamplingParams' name
FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
          "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
NEUTRAL = ("none", "vllm")


def sampling_defaults(model: str, source: str = "auto") -> dict[str, Any]:
    """SamplingParams field -> the model's default (only the fields its file sets)."""
    if source in NEUTRAL:
        return {}
    if source == "auto":
        path = os.path.join(model, "generation_config.json")
        if not os.path.isfile(path):
            return {}
    else:
        path = os.path.join(source, "generation_config.json")
        if not os.path.isfile(path):
            raise ConfigError(f"generation_config {source!r} must be auto, none or a folder "
                              f"with a generation_config.json; {path} does not exist")
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path} cannot be read as JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} is not a JSON object")
    defaults = {ours: raw[theirs] for theirs, ours in FIELDS.items()
                if raw.get(theirs) is not None}
    _check(defaults, path)
    return defaults


def _check(defaults: dict[str, Any], path: str) -> None:
    """Each default as SamplingParams would take it: a bad one names the file and the field."""
    from moeserve.types import SamplingParams

    for name, value in defaults.items():
        try:
            SamplingParams(**{name: value})
        except (ValueError, TypeError) as e:
            theirs = next(k for k, v in FIELDS.items() if v == name)
            raise ConfigError(f"{path}: {theirs} = {value!r} cannot be a sampling default: "
                              f"{e}") from None
