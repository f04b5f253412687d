"""Built-in model shapes: HF-style config.json files (no weights) shipped inside the package.

A preset is served with dummy weights and the built-in byte tokenizer its `moeserve_tokenizer`
field names. `moeserve presets` lists them with parameter counts and bf16 memory.
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

_SUFFIX = ".json"


def list_presets() -> list[str]:
    return sorted(p.name[: -len(_SUFFIX)] for p in resources.files(__name__).iterdir()
                  if p.name.endswith(_SUFFIX))


def is_preset(name: str) -> bool:
    return name in list_presets()


def load_preset(name: str) -> dict[str, Any]:
    """The preset's HF-style config dict; ValueError naming the choices for an unknown name."""
    if not is_preset(name):
        raise ValueError(f"unknown preset {name!r}; presets: {', '.join(list_presets())}")
    return json.loads(resources.files(__name__).joinpath(name + _SUFFIX).read_text())
