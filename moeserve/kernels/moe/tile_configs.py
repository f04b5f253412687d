"""Tile configs of the Triton fused-MoE kernel and the backend per batch size: the lookup.

A config is a dict BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages (CONFIG_KEYS) for
the two launches of `moe_triton`, plus an optional "down": {BLOCK_N, BLOCK_K, GROUP_M, num_warps,
num_stages} (DOWN_KEYS) for the second (down) launch alone; without it both launches use the
top-level tiles. BLOCK_M is always shared: it sets the expert-sorted padding of the one align.
Optional launch options (OPTION_KEYS, 0 when absent) ride beside the tiles: "ONE_DOT" 1 (top
level only: the gated launch reads gate and up columns as one tile of twice the width and does
one dot, split in the epilogue), "PERSISTENT" n (n programs per SM walk the used tiles) and
"SUB_M" 1 (a program whose row block holds at most a half or a quarter of BLOCK_M real rows
computes only those: an expert's last block is mostly padding). The top level's are the gated
launch's, the "down" entry's the down launch's. SUB_M and PERSISTENT exclude each other.
`check_config` validates both parts (a bad value raises a ValueError naming the key and value),
`down_tiles` gives the down launch's full tiles, `split_config` joins a gated and a down pick
(adding "down" only where they differ), `config_key` names a config (M64_N64_K64_G8_w4_s4, with
_1dot / _p1 / _sub for the options, then +down_N128_K64_G8_w8_s3 when split). Tuned configs live in
one JSON file per (device, dtype, E, H, I, Triton version), named by `config_file_name`:

    {"meta":       {"device_name", "dtype", "E", "H", "I", "top_k", "triton", "torch"},
     "configs":    {"<num_tokens>": {BLOCK_M.., ["down": {BLOCK_N..}], "ms": the Triton MoE's
                                     time with these tiles (align, both launches, combine),
                                     "grouped_mm_ms": torch._grouped_mm's time (when measured),
                                     "backend": "triton" | "grouped_mm" (the faster)}},
     "trials":     {"<num_tokens>": {"<part>:<key>": ms | "error: ..."}},  <- Triton ledger
     "grouped_mm": {"<num_tokens>": ms | "error: ..."}}                    <- its ledger

(the ledger's parts are `moe_tune.py`'s; files of older tuners hold plain candidate keys there,
whole-op times, which are kept but not reused). Entries are validated on load
(`parse_entry`), so a bad file fails at start-up naming the file and token count.

`get_moe_config` looks in $MOESERVE_MOE_CONFIG_DIR (if set), then in the package's
`kernels/moe/configs/` (committed tunes), then in the user cache (`tune_dir()`, where a tune at
start-up writes), takes the entry whose token count is nearest (ties: the smaller), and else
falls back to in-code defaults chosen by tokens per expert (fitted to shared memory for the
dtype); the result says which (for the capacity report) and which backend the tune measured
faster there ("measured" backend, `moe_measured.py`). An entry without "backend" (older files)
means "triton". The tuner that writes these files is `moe_tune.py`.

The tile source (`tiles`, TILE_SOURCES; the engine's `moe_tiles`) picks between the two:

    "tuned"    the lookup above: a tuned file when one exists, else the defaults
    "default"  the in-code defaults at every token count, no file read; backend "triton"
               (no tune measured anything, so the "measured" backend runs the fused Triton MoE)
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
DOWN_KEYS = CONFIG_KEYS[1:]  # an optional "down" entry: the down launch's own tiles, no BLOCK_M
# Launch options beside the tiles, 0 when absent: {key: (largest value, name suffix)}. ONE_DOT is
# the gated launch's only (the down launch has one weight tile); the others may be in both.
OPTION_KEYS = {"ONE_DOT": (1, "1dot"), "PERSISTENT": (8, "p"), "SUB_M": (1, "sub")}
DOWN_OPTION_KEYS = ("PERSISTENT", "SUB_M")
PACKAGE_CONFIG_DIR = Path(__file__).parent / "configs"
CONFIG_DIR_ENV = envs.MOE_CONFIG_DIR
BACKENDS = ("triton", "grouped_mm")  # what a tuned entry's "backend" may name
TILE_SOURCES = ("tuned", "default")  # where get_moe_config takes the tiles from
MAX_TUNE_TOKENS = 8192  # engine_token_counts stops here: past it the GEMMs are compute-bound


@dataclass(frozen=True)
class MoeConfigChoice:
    """The tile config for one call, whether it came from a tuned file, and which."""

    config: dict  # CONFIG_KEYS, plus "down" (DOWN_KEYS) when the down launch has its own tiles
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


@functools.cache
def tile_device_name(device: torch.device) -> str:
    """The device part of a tuned file's name: the CUDA device's name, else the device type
    ("cpu"). One function for the kernels' lookups and the engine's report and tune, so both
    find the same file."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def tune_dir() -> Path:
    """Where a tune made at start-up is written: $MOESERVE_MOE_CONFIG_DIR if set, else the user
    cache (<MOESERVE_CACHE_DIR>/moe_configs)."""
    extra = envs.moe_config_dir()
    return Path(extra) if extra else Path(envs.cache_dir()) / "moe_configs"


def default_moe_config(num_experts: int, top_k: int, num_tokens: int) -> dict[str, int]:
    """In-code fallback: small tiles while few tokens reach each expert, larger ones after (one
    set for both launches)."""
    per_expert = num_tokens * top_k / max(num_experts, 1)
    if per_expert <= 16:  # decode: each expert reads its weights for a handful of rows
        return tile_config(16, 64, 128, 1, 4, 4)
    if per_expert <= 48:
        return tile_config(32, 64, 128, 8, 4, 4)
    if per_expert <= 192:
        return tile_config(64, 128, 64, 8, 8, 4)
    return tile_config(128, 128, 64, 8, 8, 3)


def tile_tokens(num_tokens: int, num_experts: int, routed_experts: int | None = None) -> int:
    """The token count whose tiles fit a rank that holds `num_experts` of the model's
    `routed_experts` (expert parallelism): of its num_tokens x k pairs only about num_experts /
    routed_experts are its own (the rest are -1, skipped), as many pairs per expert as
    num_experts experts alone draw from that share of the tokens. The tuned files and the
    default tiles are by that count, so a rank's tiles are its local shape's tuned at that
    density (tuning the local shape at num_tokens would give it routed / local times too many
    pairs an expert). num_tokens itself when the rank holds every expert."""
    if not routed_experts or routed_experts <= num_experts or num_tokens <= 0:
        return num_tokens
    return max(1, -(-num_tokens * num_experts // routed_experts))


def nearest_token_count(tuned: Sequence[int] | dict[int, object], num_tokens: int) -> int:
    """The tuned token count closest to num_tokens (ties: the smaller), as vLLM picks."""
    return min(tuned, key=lambda n: (abs(n - num_tokens), n))


def get_moe_config(num_experts: int, hidden: int, inter: int, top_k: int, dtype: torch.dtype,
                   num_tokens: int, device_name: str, tiles: str = "tuned") -> MoeConfigChoice:
    """The tuned entry nearest `num_tokens` for this shape and device, else the default.
    tiles "default": the default at once, whatever tuned files exist (backend "triton")."""
    check_tile_source(tiles)
    found = (find_tuned(num_experts, hidden, inter, dtype, device_name) if tiles == "tuned"
             else None)
    if found is not None:
        path, table = found
        nearest = nearest_token_count(table, num_tokens)
        entry = table[nearest]
        return MoeConfigChoice(entry_config(entry), True, path, entry["backend"], nearest)
    config = fit_shared_memory(default_moe_config(num_experts, top_k, num_tokens),
                               torch.empty((), dtype=dtype).element_size())
    return MoeConfigChoice(config, False, "default", backend="triton")  # nothing measured


def check_tile_source(tiles: str) -> None:
    """A ValueError naming the choices unless `tiles` is one of TILE_SOURCES."""
    if tiles not in TILE_SOURCES:
        raise ValueError(f"MoE tiles must be one of {', '.join(TILE_SOURCES)}; got {tiles!r}")


SHARED_MEMORY_BUDGET = 200 * 1024  # bytes per block: under an H100/H200's 227 KiB, with room


def fit_shared_memory(config: dict, elem_size: int) -> dict:
    """The default tiles are sized for 2-byte dtypes: for wider ones (fp32) drop pipeline
    stages, then halve BLOCK_K, until the tiles fit SHARED_MEMORY_BUDGET. The gated launch holds
    (BLOCK_M + 2 BLOCK_N) x BLOCK_K per stage (x rows, gate and up columns); the down launch
    (BLOCK_M + BLOCK_N) x BLOCK_K, with its own tiles when the config has "down" (else the
    top-level ones, which then fit a fortiori). BLOCK_M is shared and never changed."""
    block_m = config["BLOCK_M"]
    fitted = _fit_tiles(config, block_m, elem_size, b_tiles=2)
    if "down" in config:
        fitted["down"] = _fit_tiles(config["down"], block_m, elem_size, b_tiles=1)
    return fitted


def shared_memory_bytes(config: dict, elem_size: int) -> tuple[int, int]:
    """(gated, down) launch's shared memory per block for `config`'s tiles: the operand tiles
    of every pipeline stage, as `fit_shared_memory` counts them."""
    down = down_tiles(config)
    return (_tile_bytes(config, config["BLOCK_M"], elem_size, 2),
            _tile_bytes(down, config["BLOCK_M"], elem_size, 1))


def _tile_bytes(tiles: dict, block_m: int, elem_size: int, b_tiles: int) -> int:
    return ((block_m + b_tiles * tiles["BLOCK_N"]) * tiles["BLOCK_K"] * elem_size
            * tiles["num_stages"])


def _fit_tiles(tiles: dict, block_m: int, elem_size: int, b_tiles: int) -> dict:
    tiles = dict(tiles)
    while (_tile_bytes(tiles, block_m, elem_size, b_tiles) > SHARED_MEMORY_BUDGET
           and tiles["num_stages"] > 2):
        tiles["num_stages"] -= 1
    while (_tile_bytes(tiles, block_m, elem_size, b_tiles) > SHARED_MEMORY_BUDGET
           and tiles["BLOCK_K"] > 16):
        tiles["BLOCK_K"] //= 2
    return tiles


def down_tiles(config: dict) -> dict[str, int]:
    """The down launch's full tiles (CONFIG_KEYS, and its DOWN_OPTION_KEYS when set): the shared
    BLOCK_M with the "down" entry's tiles, or the top-level ones when there is none."""
    down = config.get("down") or config
    return ({"BLOCK_M": config["BLOCK_M"]} | {k: down[k] for k in DOWN_KEYS}
            | _set_options(down, DOWN_OPTION_KEYS))


def _set_options(tiles: dict, keys: Sequence[str]) -> dict[str, int]:
    """The options among `keys` that `tiles` sets to a non-zero value (0 is their default)."""
    return {k: tiles[k] for k in keys if tiles.get(k)}


def sub_heights(tiles: dict) -> dict[str, int]:
    """The kernels' HALF_M and QUARTER_M for a launch's tiles: with SUB_M the heights under
    BLOCK_M a block of few real rows computes (those of at least 16 rows, else 0), both 0
    without it (the bf16 and the quantized fused MoE alike)."""
    if not tiles.get("SUB_M"):
        return {"HALF_M": 0, "QUARTER_M": 0}
    half, quarter = tiles["BLOCK_M"] // 2, tiles["BLOCK_M"] // 4
    return {"HALF_M": half if half >= 16 else 0, "QUARTER_M": quarter if quarter >= 16 else 0}


def launch_options(tiles: dict) -> tuple[int, int, int]:
    """(ONE_DOT, PERSISTENT, SUB_M) of one launch's tiles, 0 where absent."""
    return tuple(int(tiles.get(key, 0)) for key in OPTION_KEYS)  # type: ignore[return-value]


def split_config(gated: dict, down: dict) -> dict:
    """One config from the gated launch's tiles and the down launch's (both with the same
    BLOCK_M): the gated ones at the top level, "down" added only when the two differ."""
    if gated["BLOCK_M"] != down["BLOCK_M"]:
        raise ValueError(f"the two launches share BLOCK_M: gated {gated['BLOCK_M']}, "
                         f"down {down['BLOCK_M']}")
    config = {k: gated[k] for k in CONFIG_KEYS} | _set_options(gated, OPTION_KEYS)
    down_part = {k: down[k] for k in DOWN_KEYS} | _set_options(down, DOWN_OPTION_KEYS)
    if down_part != {k: gated[k] for k in DOWN_KEYS} | _set_options(gated, DOWN_OPTION_KEYS):
        config["down"] = down_part
    return config


def entry_config(entry: dict) -> dict:
    """The tile config of a tuned entry (CONFIG_KEYS, any set OPTION_KEYS, and "down" when it
    has one)."""
    config: dict = {k: entry[k] for k in CONFIG_KEYS}
    config.update(_set_options(entry, OPTION_KEYS))
    if "down" in entry:
        config["down"] = dict(entry["down"])
    return config


def config_key(config: dict) -> str:
    """M16_N64_K128_G1_w4_s4 (+ _1dot / _p1 / _sub for the options set), then
    +down_N128_K64_G8_w8_s3 when the down launch has its own tiles: a config's name in the
    tuner's ledger and in reports."""
    key = ("M{BLOCK_M}_N{BLOCK_N}_K{BLOCK_K}_G{GROUP_M}_w{num_warps}_s{num_stages}".format(**config)
           + _options_suffix(config))
    if "down" in config:
        key += "+down_N{BLOCK_N}_K{BLOCK_K}_G{GROUP_M}_w{num_warps}_s{num_stages}".format(
            **config["down"]) + _options_suffix(config["down"])
    return key


def _options_suffix(tiles: dict) -> str:
    """_1dot, _p2, ... for the options set in `tiles` (nothing for the plain launch)."""
    suffix = ""
    for key, (largest, name) in OPTION_KEYS.items():
        value = tiles.get(key, 0)
        if value:
            suffix += f"_{name}" if largest == 1 else f"_{name}{value}"
    return suffix


def check_config(config: dict, what: str = "MoE tile config") -> None:
    """Raise a ValueError naming the key and value when `config` cannot run: a missing key,
    BLOCK_M/N/K not a power of two >= 16 (tl.dot), GROUP_M or num_stages < 1, num_warps not a
    power of two; an optional "down" must be a dict of exactly DOWN_KEYS (BLOCK_M is shared),
    checked the same way. OPTION_KEYS, when present, must be ints in [0, their largest value]
    (ONE_DOT not in "down"). Other keys at the top level are ignored."""
    if not isinstance(config, dict):
        raise ValueError(f"{what} must be a dict, got {type(config).__name__}: {config!r}")
    _check_tiles(config, CONFIG_KEYS, what)
    _check_options(config, tuple(OPTION_KEYS), what)
    if "down" not in config:
        return
    down = config["down"]
    if not isinstance(down, dict):
        raise ValueError(f"{what}: 'down' must be a dict of {list(DOWN_KEYS)}, got "
                         f"{type(down).__name__}: {down!r}")
    if "BLOCK_M" in down:
        raise ValueError(f"{what}: 'down' must not set BLOCK_M (got {down['BLOCK_M']!r}): both "
                         "launches share the top-level BLOCK_M (the align's block size)")
    allowed = (*DOWN_KEYS, *DOWN_OPTION_KEYS)
    unknown = sorted(set(down) - set(allowed), key=str)
    if unknown:
        raise ValueError(f"{what}: 'down' holds unknown keys {unknown} (allowed: "
                         f"{list(allowed)}): {down!r}")
    _check_tiles(down, DOWN_KEYS, f"{what} 'down'")
    _check_options(down, DOWN_OPTION_KEYS, f"{what} 'down'")


def _check_options(tiles: dict, keys: Sequence[str], what: str) -> None:
    for key in keys:
        value = tiles.get(key, 0)
        largest = OPTION_KEYS[key][0]
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= largest:
            raise ValueError(f"{what} {key} must be an int in [0, {largest}], got {value!r}")
    if tiles.get("SUB_M") and tiles.get("PERSISTENT"):
        raise ValueError(f"{what}: SUB_M and PERSISTENT cannot be combined (the persistent walk "
                         f"has no sub-tiles): {tiles!r}")


def _check_tiles(tiles: dict, keys: Sequence[str], what: str) -> None:
    missing = [k for k in keys if k not in tiles]
    if missing:
        raise ValueError(f"{what} lacks {missing}: {tiles}")
    for key in keys:
        value = tiles[key]
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"{what} {key} must be an int, got {value!r}")
        if key.startswith("BLOCK_") and (value < 16 or value & (value - 1)):
            raise ValueError(f"{what} {key} must be a power of two >= 16 (tl.dot), got {value}")
        if key in ("GROUP_M", "num_stages") and value < 1:
            raise ValueError(f"{what} {key} must be >= 1, got {value}")
        if key == "num_warps" and (value < 1 or value & (value - 1)):
            raise ValueError(f"{what} {key} must be a power of two >= 1, got {value}")


# Devices of one chip (the H200 is the H100 SXM's Hopper die, 132 SMs, 50 MB L2, with more and
# faster memory): where one has no tuned file for a shape, the package's committed file of
# another is used as it is (reported as such), rather than the in-code default tiles or a
# start-up tune of minutes. Only committed files are borrowed: a tune here writes under this
# device's own name. Not the H100 PCIe or NVL (114 / 132 SMs with other memory).
SAME_CHIP = (("NVIDIA H200", "NVIDIA H100 80GB HBM3"),)


def same_chip_devices(device_name: str) -> list[str]:
    """The other devices of `device_name`'s chip (SAME_CHIP), whose committed tiles it borrows."""
    return [other for chip in SAME_CHIP if device_name in chip for other in chip
            if other != device_name]


def find_config_file(file_name: Callable[[str], str], load: Callable[[str], dict[int, dict]],
                     device_name: str) -> tuple[str, dict[int, dict]] | None:
    """(path, table) of the first folder of `config_dirs` whose file `file_name(device_name)`
    holds a finished entry, else of the package's committed file of a device of the same chip
    (`same_chip_devices`), else None."""
    paths = [directory / file_name(device_name) for directory in config_dirs()]
    paths += [PACKAGE_CONFIG_DIR / file_name(other) for other in same_chip_devices(device_name)]
    for path in paths:
        table = load(str(path))
        if table:
            return str(path), table
    return None


def committed_detail(path: str, device_name: str) -> str:
    """The report's word for a committed file serving `device_name`: "committed", or, when it
    is another device's (same_chip_devices), which."""
    for other in same_chip_devices(device_name):
        if f"device_name={other.replace(' ', '_')}," in Path(path).name:
            return (f"committed, tuned on {other} (the same chip; benchmarks/kernels/"
                    f"kernels_moe.py --tune tunes {device_name} itself)")
    return "committed"


def find_tuned(num_experts: int, hidden: int, inter: int, dtype: torch.dtype,
               device_name: str) -> tuple[str, dict[int, dict]] | None:
    """(path, {num_tokens: entry}) of the first config folder with a finished entry for this
    shape, or None (`find_config_file`: a same-chip device's committed file too). An entry
    holds CONFIG_KEYS and "backend" (plus "down", "ms", "grouped_mm_ms" when recorded)."""
    return find_config_file(
        lambda device: config_file_name(num_experts, hidden, inter, dtype, device), _load_tuned,
        device_name)


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


def config_dirs() -> list[Path]:
    """The folders a lookup searches, in order: $MOESERVE_MOE_CONFIG_DIR (if set), the package's
    committed configs, the user cache (the quantized tuner's files live in the same ones)."""
    extra = envs.moe_config_dir()
    user = Path(envs.cache_dir()) / "moe_configs"
    return ([Path(extra)] if extra else []) + [PACKAGE_CONFIG_DIR, user]


@functools.lru_cache(maxsize=64)
def _load_tuned(path: str) -> dict[int, dict]:
    return read_tuned_table(path, parse_entry)


def read_tuned_table(path: str, parse: Callable[[dict], dict]) -> dict[int, dict]:
    """{num_tokens: parse(entry)} of a tuned file (the bf16 one's or the quantized MoE's);
    empty if absent or holding no finished entry; a bad entry raises ValueError naming it."""
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        doc = json.load(f)
    table = {}
    for n, raw in doc.get("configs", {}).items():
        try:
            table[int(n)] = parse(raw)
        except (ValueError, TypeError, KeyError) as exc:
            raise ValueError(f"{path}: the entry for {n} tokens: {exc}") from exc
    return table


def parse_entry(raw: dict) -> dict:
    """A tuned entry as the lookup uses it: the tiles as ints (and "down" when present,
    validated by `check_config`), "backend" (default "triton"), "ms"/"grouped_mm_ms" as floats."""
    missing = [k for k in CONFIG_KEYS if k not in raw]
    if missing:
        raise ValueError(f"tuned MoE entry lacks {missing}: {raw}")
    entry: dict = {k: _as_int(raw[k], k) for k in CONFIG_KEYS}
    entry.update({k: _as_int(raw[k], k) for k in OPTION_KEYS if k in raw})
    if "down" in raw:
        down = raw["down"]
        if isinstance(down, dict):  # else check_config names it
            down = {k: _as_int(v, f"'down' {k}") for k, v in down.items()}
        entry["down"] = down
    check_config(entry, "tuned MoE entry")
    backend = raw.get("backend", "triton")
    if backend not in BACKENDS:
        raise ValueError(f"tuned MoE entry names backend {backend!r}, not one of {BACKENDS}")
    entry["backend"] = backend
    for key in ("ms", "grouped_mm_ms"):
        if key in raw:
            entry[key] = float(raw[key])
    return entry


def _as_int(value: object, key: str) -> int:
    """A JSON tile value as an int (64, 64.0 or "64", as int() reads it); 64.5, "x" or a bool
    are refused, naming the key."""
    try:
        as_int = int(value)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        as_int = None
    if as_int is None or isinstance(value, bool) or (isinstance(value, float)
                                                     and value != as_int):
        raise ValueError(f"tuned MoE entry {key} must be an integer, got {value!r}")
    return as_int


_CACHE_CLEARERS: list[Callable[[], None]] = [_load_tuned.cache_clear]


