"""Tile configs of the Triton fused-MoE kernel and the backend per batch size: the lookup.

A config is a dict BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages, used by both GEMMs
of `moe_triton` (BLOCK_M must be shared: it sets the expert-sorted padding). Tuned configs live in
one JSON file per (device, dtype, E, H, I, Triton version), named by `config_file_name`:

    {"meta":       {"device_name", "dtype", "E", "H", "I", "top_k", "triton", "torch"},
     "configs":    {"<num_tokens>": {BLOCK_M.., "ms": best Triton time,
                                     "grouped_mm_ms": torch._grouped_mm's time (when measured),
                                     "backend": "triton" | "grouped_mm" (the faster)}},
     "trials":     {"<num_tokens>": {"<candidate key>": ms | "error: ..."}},  <- Triton ledger
     "grouped_mm": {"<num_tokens>": ms | "error: ..."}}                       <- its ledger

`get_moe_config` looks in $MOESERVE_MOE_CONFIG_DIR (if set), then in the package's
`kernels/configs/moe/` (committed tunes), then in the user cache (`tune_dir()`, where a tune at
start-up writes), takes the entry whose token count is nearest (ties: the smaller), and else
falls back to in-code defaults chosen by tokens per expert (fitted to shared memory for the
dtype); the result says which (for the capacity report) and which backend the tune measured
faster there ("measured" backend, `moe_measured.py`). An entry without "backend" (older files)
means "triton". The tuner that writes these files is `moe_tune.py`.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from moeserve import envs

CONFIG_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages")
PACKAGE_CONFIG_DIR = Path(__file__).parent / "configs" / "moe"
CONFIG_DIR_ENV = envs.MOE_CONFIG_DIR
BACKENDS = ("triton", "grouped_mm")  # what a tuned entry's "backend" may name
MAX_TUNE_TOKENS = 8192  # engine_token_counts stops here: past it the GEMMs are compute-bound
@dataclass(frozen=True)
class MoeConfigChoice:
    """The tile config for one call, whether it came from a tuned file, and which."""

    config: dict[str, int]
    tuned: bool
    source: str  # the JSON path, or "default"
    backend: str = "triton"  # the backend the tune measured faster at tuned_tokens
    tuned_tokens: int | None = None  # the tuned token count whose entry was taken


@functools.cache
def triton_version() -> str:
    """The installed Triton version, without importing triton's compiler."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("triton")
    except PackageNotFoundError:
        return "none"


def config_file_name(num_experts: int, hidden: int, inter: int, dtype: torch.dtype,
                     device_name: str, triton: str | None = None) -> str:
    """E=128,H=2048,I=768,device_name=NVIDIA_H200,dtype=bfloat16,triton=3.6.0.json."""
    device = device_name.replace(" ", "_").replace("/", "_")
    dtype_name = str(dtype).removeprefix("torch.")
    return (f"E={num_experts},H={hidden},I={inter},device_name={device},dtype={dtype_name},"
            f"triton={triton or triton_version()}.json")


def tune_dir() -> Path:
    """Where a tune made at start-up is written: $MOESERVE_MOE_CONFIG_DIR if set, else the user
    cache (<MOESERVE_CACHE_DIR>/moe_configs)."""
    extra = envs.moe_config_dir()
    return Path(extra) if extra else Path(envs.cache_dir()) / "moe_configs"


def default_moe_config(num_experts: int, top_k: int, num_tokens: int) -> dict[str, int]:
    """In-code fallback: small tiles while few tokens reach each expert, larger ones after."""
    per_expert = num_tokens * top_k / max(num_experts, 1)
    if per_expert <= 16:  # decode: each expert reads its weights for a handful of rows
        return tile_config(16, 64, 128, 1, 4, 4)
    if per_expert <= 48:
        return tile_config(32, 64, 128, 8, 4, 4)
    if per_expert <= 192:
        return tile_config(64, 128, 64, 8, 8, 4)
    return tile_config(128, 128, 64, 8, 8, 3)


def nearest_token_count(tuned: Sequence[int] | dict[int, object], num_tokens: int) -> int:
    """The tuned token count closest to num_tokens (ties: the smaller), as vLLM picks."""
    return min(tuned, key=lambda n: (abs(n - num_tokens), n))


def get_moe_config(num_experts: int, hidden: int, inter: int, top_k: int, dtype: torch.dtype,
                   num_tokens: int, device_name: str) -> MoeConfigChoice:
    """The tuned entry nearest `num_tokens` for this shape and device, else the default."""
    found = find_tuned(num_experts, hidden, inter, dtype, device_name)
    if found is not None:
        path, table = found
        nearest = nearest_token_count(table, num_tokens)
        entry = table[nearest]
        return MoeConfigChoice({k: entry[k] for k in CONFIG_KEYS}, True, path,
                               entry["backend"], nearest)
    config = fit_shared_memory(default_moe_config(num_experts, top_k, num_tokens),
                               torch.empty((), dtype=dtype).element_size())
    return MoeConfigChoice(config, False, "default")


SHARED_MEMORY_BUDGET = 200 * 1024  # bytes per block: under an H100/H200's 227 KiB, with room


def fit_shared_memory(config: dict[str, int], elem_size: int) -> dict[str, int]:
    """The default tiles are sized for 2-byte dtypes: for wider ones (fp32) drop pipeline
    stages, then halve BLOCK_K, until the gated GEMM's tiles, (BLOCK_M + 2 BLOCK_N) x BLOCK_K
    per stage, fit SHARED_MEMORY_BUDGET."""
    config = dict(config)

    def need() -> int:
        return ((config["BLOCK_M"] + 2 * config["BLOCK_N"]) * config["BLOCK_K"] * elem_size
                * config["num_stages"])

    while need() > SHARED_MEMORY_BUDGET and config["num_stages"] > 2:
        config["num_stages"] -= 1
    while need() > SHARED_MEMORY_BUDGET and config["BLOCK_K"] > 16:
        config["BLOCK_K"] //= 2
    return config


def find_tuned(num_experts: int, hidden: int, inter: int, dtype: torch.dtype,
               device_name: str) -> tuple[str, dict[int, dict]] | None:
    """(path, {num_tokens: entry}) of the first config folder with a finished entry for this
    shape, or None. An entry holds CONFIG_KEYS and "backend" (plus "ms", "grouped_mm_ms" when
    recorded)."""
    name = config_file_name(num_experts, hidden, inter, dtype, device_name)
    for directory in _config_dirs():
        path = str(directory / name)
        table = _load_tuned(path)
        if table:
            return path, table
    return None


def engine_token_counts(max_num_batched_tokens: int = MAX_TUNE_TOKENS) -> list[int]:
    """The token counts to tune for an engine: 1, 2, 4, ... below min(its max batched tokens,
    MAX_TUNE_TOKENS), then that cap itself (a step never runs more tokens)."""
    cap = max(1, min(max_num_batched_tokens, MAX_TUNE_TOKENS))
    counts = [1 << i for i in range(cap.bit_length()) if 1 << i < cap]
    return counts + [cap]


def clear_caches() -> None:
    """Forget every loaded tuned file and derived plan (after a tune, or when the config
    folders change)."""
    for clear in _CACHE_CLEARERS:
        clear()


def register_cache(clear: Callable[[], None]) -> None:
    """Have `clear_caches` (called after each tune) also call `clear` (moe_measured's plans)."""
    _CACHE_CLEARERS.append(clear)


def tile_config(block_m: int, block_n: int, block_k: int, group_m: int, warps: int,
            stages: int) -> dict[str, int]:
    return dict(zip(CONFIG_KEYS, (block_m, block_n, block_k, group_m, warps, stages)))


def _config_dirs() -> list[Path]:
    extra = envs.moe_config_dir()
    user = Path(envs.cache_dir()) / "moe_configs"
    return ([Path(extra)] if extra else []) + [PACKAGE_CONFIG_DIR, user]


@functools.lru_cache(maxsize=64)
def _load_tuned(path: str) -> dict[int, dict]:
    """{num_tokens: entry} of a tuned file; empty if absent or holding no finished entry."""
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        doc = json.load(f)
    return {int(n): parse_entry(cfg) for n, cfg in doc.get("configs", {}).items()}


def parse_entry(raw: dict) -> dict:
    entry: dict = {k: int(raw[k]) for k in CONFIG_KEYS}
    backend = raw.get("backend", "triton")
    if backend not in BACKENDS:
        raise ValueError(f"tuned MoE entry names backend {backend!r}, not one of {BACKENDS}")
    entry["backend"] = backend
    for key in ("ms", "grouped_mm_ms"):
        if key in raw:
            entry[key] = float(raw[key])
    return entry


_CACHE_CLEARERS: list[Callable[[], None]] = [_load_tuned.cache_clear]


