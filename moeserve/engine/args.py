"""Engine arguments: flat keyword/CLI names mapped onto the nested frozen configs.

`LLM(model, block_size=32, max_running_requests=64)` and `moeserve generate --block-size 32` both
land here. Every field of EngineConfig, CacheConfig and SchedulerConfig is an argument under its
own name; the CLI help is the field's docstring in config.py (read once with `ast`), so the two
never drift apart.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import itertools
from typing import Any

from moeserve import config as cfgmod
from moeserve.config import CacheConfig, ConfigError, EngineConfig, ParallelConfig, SchedulerConfig

_SECTIONS = {"cache": CacheConfig, "scheduler": SchedulerConfig, "parallel": ParallelConfig}
_ALIASES = {"tensor_parallel_size": ("--tp",)}  # the peers' short names


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstring written under each field of a dataclass in config.py."""
    tree = ast.parse(inspect.getsource(cfgmod))
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls.__name__)
    docs: dict[str, str] = {}
    body = node.body
    for prev, cur in itertools.pairwise(body):
        if (isinstance(prev, ast.AnnAssign) and isinstance(prev.target, ast.Name)
                and isinstance(cur, ast.Expr) and isinstance(cur.value, ast.Constant)):
            docs[prev.target.id] = " ".join(str(cur.value.value).split())
    return docs


def _flat_fields() -> dict[str, tuple[str | None, dataclasses.Field]]:
    """name -> (section or None, field) over the engine config and its sections."""
    out: dict[str, tuple[str | None, dataclasses.Field]] = {}
    for f in dataclasses.fields(EngineConfig):
        if f.name not in _SECTIONS:
            out[f.name] = (None, f)
    for section, cls in _SECTIONS.items():
        for f in dataclasses.fields(cls):
            out[f.name] = (section, f)
    return out


def engine_config_from_kwargs(**kwargs: Any) -> EngineConfig:
    """Build an EngineConfig from flat keyword arguments; an unknown name is a ConfigError."""
    fields = _flat_fields()
    unknown = sorted(set(kwargs) - set(fields))
    if unknown:
        raise ConfigError(f"unknown engine argument(s): {', '.join(unknown)}")
    top: dict[str, Any] = {}
    sections: dict[str, dict[str, Any]] = {s: {} for s in _SECTIONS}
    for name, value in kwargs.items():
        section = fields[name][0]
        (top if section is None else sections[section])[name] = value
    for section, cls in _SECTIONS.items():
        top[section] = cls(**sections[section])
    return EngineConfig(**top)


def _parse_auto_int(text: str) -> int | str:
    return text if text == "auto" else int(text)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One --flag per config field, help from its docstring, default None (= the config's)."""
    for name, (section, f) in _flat_fields().items():
        cls = EngineConfig if section is None else _SECTIONS[section]
        default = f.default if f.default is not dataclasses.MISSING else None
        flags = ("--" + name.replace("_", "-"), *_ALIASES.get(name, ()))
        # argparse %-formats help: a docstring's "13%" would break --help
        help_text = f"{field_docs(cls).get(name, '')} (default: {default})".replace("%", "%%")
        if f.type in ("bool", "bool | None"):
            parser.add_argument(*flags, dest=name, default=None,
                                action=argparse.BooleanOptionalAction, help=help_text)
            continue
        kind = {"int": int, "float": float}.get(str(f.type), None)
        if "int | str" in str(f.type):
            kind = _parse_auto_int
        elif "int | None" in str(f.type):
            kind = int
        parser.add_argument(*flags, dest=name, default=None, type=kind or str, help=help_text)


def engine_kwargs_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The engine arguments the user actually gave on the command line."""
    return {name: getattr(args, name) for name in _flat_fields()
            if getattr(args, name, None) is not None}
