"""Tile configs of the quantized fused MoE (`quant.fused_triton.moe_quant_triton`): the in-code
defaults, the rules a config must keep per format, the tuner's candidate grid and the lookup of
tuned files.

A config is tile_configs.CONFIG_KEYS (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps,
num_stages) for both launches, or with a "down" entry (tile_configs.DOWN_KEYS) the down
launch's own, and of the launch options only SUB_M (QUANT_OPTIONS). Per format
(`check_quant_config`): fp8 needs BLOCK_K 128 (one activation / weight scale column a K step);
nvfp4 and int4 a BLOCK_K that is a multiple of the group (16, or the checkpoint's int4 group),
for nvfp4 at least 32.

Tuned configs live beside the bf16 ones (tile_configs.config_dirs: $MOESERVE_MOE_CONFIG_DIR, the
package's configs/, the user cache), one JSON file per (format, E, H, I, top_k, group, device,
activation dtype, Triton version), named by `quant_config_file_name`:

    quant=fp8,E=128,H=2048,I=768,k=8,group=128,device_name=NVIDIA_H200,dtype=bfloat16,
    triton=3.6.0.json   (one name; wrapped here)

    {"meta":    {"device_name", "dtype", "format", "E", "H", "I", "top_k", "group", "triton",
                 "torch"},
     "configs": {"<num_tokens>": {CONFIG_KEYS.., "ms": the op's time with these tiles,
                                  "default_ms": with default_quant_config's}},
     "trials":  {"<num_tokens>": {"moe:<config key>": ms | "error: ..."}}}   <- the ledger

`get_quant_config` takes the entry whose token count is nearest (ties: the smaller,
tile_configs.nearest_token_count), else `default_quant_config`; with tiles "default" the default
at once, no file read. `quant_tune_candidates` is the grid `quant/tune.py` times.
"""

from __future__ import annotations

import functools

import torch

from moeserve.kernels.linear.int4_tile import MIN_BLOCK_K as INT4_MIN_BLOCK_K
from moeserve.kernels.linear.nvfp4_tile import MIN_BLOCK_K as NVFP4_MIN_BLOCK_K
from moeserve.kernels.moe.tile_configs import (
    CONFIG_KEYS,
    DOWN_KEYS,
    OPTION_KEYS,
    MoeConfigChoice,
    check_config,
    check_tile_source,
    config_key,
    find_config_file,
    nearest_token_count,
    read_tuned_table,
    register_cache,
    tile_config,
    triton_version,
)
from moeserve.quant.packed import FP8_GROUP

QUANT_FORMATS = ("fp8", "nvfp4", "int4")
WEIGHT_LAYOUTS = ("rows", "micro")  # the 4-bit experts' packed layouts a tune timed
# A gated tile holds two accumulators (gate and up), the down tile one: from SPLIT_MIN_M rows
# the grid tries the gated launch at BLOCK_N SPLIT_N[0] beside the down launch at SPLIT_N[1],
# the same registers a launch (sm90, NVFP4 micro-tiles, 64 rows, 128-K: the 64 x 128 gated
# tile 255 registers and 36 bytes spilled, 64 x 64 gated 229 and 64 x 128 down 237, no spill).
SPLIT_MIN_M, SPLIT_N = 64, (64, 128)
# The launch options (tile_configs.OPTION_KEYS) the quantized kernel takes: SUB_M, a block's
# tile of its real rows' height (a half or a quarter of BLOCK_M, >= 16 rows) where they fit.
QUANT_OPTIONS = ("SUB_M",)
MAX_QUANT_CANDIDATES = 24  # per token count, the default included
# Budgets the grid keeps to (per program): shared memory of the gated launch's pipeline stages,
# and the fp32 values of one dequantized [BLOCK_K, BLOCK_N] weight tile per thread (W4A16: the
# nibbles are decoded in registers; past ~128 a thread the tile spills).
SHARED_MEMORY_BUDGET = 200 * 1024
DEQUANT_VALUES_PER_THREAD = 128
# The 4-bit formats' long K step (default_quant_config: where both K dims reach WIDE_K_MIN)
WIDE_K, WIDE_K_MIN = 256, 2048
# nvfp4 tiles of fewer rows than this take 4 warps: in the H200 tunes of five expert shapes
# (2 to 256 experts a rank, 1 to 8,192 tokens; benchmarks/results/gpu_4705423/call3-4 and the
# committed files) no 8-warp tile under 128 rows was ever the fastest: 1.04-3.4x the best at 16
# and 32 rows, 2.2-5x at 64 (sm90 offline: 64 barriers a K step in the 64-row tile's loop
# against 4, the decoded tile's layout change split into pieces). 128 rows with 8 warps stays:
# GLM-5's pick at 8,192 tokens, within 1-5% of the best at 256-4,096 tokens of other shapes.
NVFP4_8_WARPS_MIN_M = 128


def default_quant_config(fmt: str, num_tokens: int, top_k: int, num_experts: int,
                         group: int, k_dims: tuple[int, int] | None = None,
                         micro: bool = False) -> dict[str, int]:
    """In-code tiles by the pairs per expert: BLOCK_M 16 / 32 / 64, BLOCK_N 64 then 128,
    BLOCK_K 128 for fp8 (one scale column a step) and nvfp4, 128 and at least the group for int4.
    nvfp4's 128: the H200 tunes of three expert shapes (qwen3-30b-a3b's, GLM-5's per rank under
    TP 8 and EP 8; benchmarks/results/gpu_04e1157/) picked BLOCK_K 128 at every token count, 8-30%
    faster than 64, whose [BK/16, BN] group-scale tile still needs synchronous loads. int4's 128
    (int4_tile.MIN_BLOCK_K) takes the nibble-plane decode: Triton 3.6's sm90 SASS of the 16 x 64
    gated tile 404 loop instructions a 128-K step in bf16 ("planes-asm") against 1,068 with the
    reshape decode (543 a 64-K step, the earlier default).

    k_dims: the two launches' K (the hidden size, the expert width). Where both are at least
    WIDE_K_MIN, the 4-bit decode tile takes 256-K steps (16 x 64 x 256, 4 warps, 3 stages): on
    an H100 GLM-5's experts (6,144 / 2,048) took 2.001 against 2.248 ms in INT4 and 2.107
    against 2.237 in NVFP4 at 64 tokens, 2.595 against 2.710 in NVFP4 at 256 (a 128-K step
    reads half of each packed row's 128-byte line); qwen3-30b-a3b's (2,048 / 768) 0.206 against
    0.187 in NVFP4 (gpu_b547afb/call8). micro: the weights are micro-tiled (micro_tiles.py),
    whose 128-K step already reads whole lines: 128-K steps there (GLM-5's experts at 64 tokens
    1.843 / 1.806 ms in NVFP4 / INT4 against 2.165 / 2.089 at 256, gpu_4da0855/call1).

    The 4-bit formats' 32- and 64-row tiles take SUB_M (a block whose real rows fit a half or a
    quarter computes that tile), the 32-row one from 16 rows an expert (at 16 the 16-row tile
    decodes the weights of the ~43% of experts past 16 rows twice: GLM-5's experts at 512 tokens
    2.91 ms against 3.16, qwen3-30b-a3b's at 256 0.214 against 0.230, NVFP4, H100, micro-tiled,
    gpu_306980f/call1): on an H100, micro-tiled, 5-22% faster wherever an expert's
    rows fit its block (GLM-5's experts at 512 / 1,024 tokens 2.91 / 3.71 ms against 3.14 /
    4.12 in NVFP4, 1,024 INT4 4.05 against 4.58; qwen3-30b-a3b's at 256 / 512 / 1,024 0.214 /
    0.299 / 0.415 against 0.234 / 0.310 / 0.463; level at 2,048 on GLM-5's:
    benchmarks/results/gpu_306980f/call1). fp8's tiles are untimed with it."""
    per_expert = num_tokens * top_k / max(num_experts, 1)
    block_k = FP8_GROUP if fmt in ("fp8", "nvfp4") else max(INT4_MIN_BLOCK_K, group)
    # decode, a handful of rows an expert; the 4-bit formats from 16 rows take the 32-row
    # SUB_M tile below (the docstring)
    if per_expert < 16 or (fmt == "fp8" and per_expert == 16):
        if (fmt != "fp8" and not micro and k_dims is not None and min(k_dims) >= WIDE_K_MIN
                and WIDE_K % group == 0):
            return tile_config(16, 64, WIDE_K, 1, 4, 3)
        return tile_config(16, 64, block_k, 1, 4, 3)
    sub_m = {"SUB_M": 1} if fmt != "fp8" else {}  # fp8: untimed with it
    if per_expert <= 48:
        return tile_config(32, 64, block_k, 8, 4, 3) | sub_m
    return tile_config(64, 128, block_k, 8, 4, 3) | sub_m


def check_quant_config(config: dict, fmt: str, groups: tuple[int, ...],
                       what: str = "moe_quant_triton config") -> None:
    """tile_configs.check_config's rules (an optional "down" entry: the down launch's own
    tiles), of the launch options only QUANT_OPTIONS, and each launch's BLOCK_K: 128 for fp8
    (one scale column a K step), a multiple of both weights' groups for nvfp4 / int4."""
    check_config(config, what)
    for part, tiles in (("", config), (" 'down'", config.get("down") or {})):
        extra = sorted(k for k in OPTION_KEYS if tiles.get(k) and k not in QUANT_OPTIONS)
        if extra:
            raise ValueError(f"{what}{part}: {extra} are not supported (the quantized kernel's "
                             f"options: {list(QUANT_OPTIONS)}): {config!r}")
    _check_block_k(config["BLOCK_K"], fmt, groups, what)
    if "down" in config:
        _check_block_k(config["down"]["BLOCK_K"], fmt, groups, f"{what} 'down'")


def _check_block_k(block_k: int, fmt: str, groups: tuple[int, ...], what: str) -> None:
    """One launch's BLOCK_K for the format (check_quant_config's rule)."""
    if fmt == "fp8" and block_k != FP8_GROUP:
        raise ValueError(f"{what}: fp8 needs BLOCK_K {FP8_GROUP} (one scale column a step), "
                         f"got {block_k}")
    if fmt != "fp8" and any(block_k % g for g in groups):
        raise ValueError(f"{what}: BLOCK_K {block_k} must be a multiple of the {fmt} groups "
                         f"{sorted(set(groups))}")
    if fmt == "nvfp4" and block_k < NVFP4_MIN_BLOCK_K:
        raise ValueError(f"{what}: nvfp4 needs BLOCK_K >= {NVFP4_MIN_BLOCK_K} (each nibble's "
                         f"dot spans half of it), got {block_k}")


def quant_block_ks(fmt: str, group: int) -> list[int]:
    """The BLOCK_K values the grid tries: 128 for fp8; for nvfp4 / int4 128 and WIDE_K where
    they are multiples of the group, else the group itself (a group past WIDE_K). No 64: the
    H200 tunes never picked it for nvfp4 (8-30% slower than 128), and int4 below 128 takes
    the reshape decode (int4_tile)."""
    if fmt == "fp8":
        return [FP8_GROUP]
    return [k for k in (128, WIDE_K) if k % group == 0] or [group]


# Per BLOCK_M, (BLOCK_N, num_warps, num_stages), best guesses first: the same lists at every
# token count, so that each variant compiles once per tune. `quant_tune_candidates` keeps those
# that fit the budgets above for the format and BLOCK_K.
_GRID = {
    16: [(64, 4, 3), (128, 4, 3), (32, 4, 4), (64, 4, 4), (128, 4, 4), (256, 8, 3),
         (64, 4, 2), (128, 8, 3), (32, 4, 3), (256, 4, 3), (64, 8, 4), (128, 4, 2)],
    32: [(64, 4, 3), (128, 4, 3), (64, 4, 4), (128, 8, 3), (256, 8, 3), (32, 4, 4),
         (128, 4, 4), (64, 8, 3), (256, 4, 3), (64, 4, 2), (128, 8, 4), (32, 4, 3)],
    64: [(128, 4, 3), (64, 4, 3), (128, 8, 3), (256, 8, 3), (64, 4, 4), (128, 4, 4),
         (256, 8, 2), (64, 8, 3), (128, 8, 4), (32, 4, 4), (128, 4, 2), (64, 4, 2)],
    128: [(128, 8, 3), (64, 4, 3), (128, 8, 2), (256, 8, 2), (64, 8, 3), (128, 4, 3),
          (64, 4, 4), (128, 8, 4), (256, 8, 3), (32, 4, 3), (64, 8, 4), (128, 4, 2)],
}


def quant_tune_candidates(fmt: str, num_experts: int, top_k: int, num_tokens: int,
                          group: int, k_dims: tuple[int, int] | None = None,
                          micro: bool = False) -> list[dict[str, int]]:
    """The grid at one token count: `default_quant_config` first, then <= 23 more (at most
    MAX_QUANT_CANDIDATES in all). BLOCK_M: the one or two of 16 / 32 / 64 / 128 that fit the
    pairs per expert (<= 2x it; 16 alone in decode), as the bf16 quick grid picks them; BLOCK_K
    by `quant_block_ks`; GROUP_M 8 when an expert holds more than one row block, else 1; from
    BLOCK_M 32 each BLOCK_M's first tile with SUB_M as well (an expert's rows in one block,
    those of a half or a quarter of it computed at that height), from SPLIT_MIN_M its first
    BLOCK_N 64 tile with a down launch of BLOCK_N 128 ("down"). Every
    candidate keeps `check_quant_config` for the format and the group. micro: the default's
    (the weights micro-tiled); the grid is the same."""
    if fmt not in QUANT_FORMATS:
        raise ValueError(f"unknown quantized format {fmt!r}; one of {QUANT_FORMATS}")
    per_expert = num_tokens * top_k / max(num_experts, 1)
    fitting = [m for m in _GRID if m <= max(16, 2 * per_expert)]
    block_ms = fitting[-2:]
    block_ks = quant_block_ks(fmt, group)
    grid = [default_quant_config(fmt, num_tokens, top_k, num_experts, group, k_dims, micro)]
    tiles = []
    for block_m in block_ms:
        for block_k in block_ks:
            fits = [c for c in (tile_config(block_m, n, block_k, 8 if per_expert > block_m else 1,
                                            warps, stages)
                                for n, warps, stages in _GRID[block_m])
                    if _fits(fmt, c, group)]
            tiles.append(fits)
            if block_m >= 32 and fits and block_k == block_ks[0]:  # its first guess, SUB_M
                grid.append(fits[0] | {"SUB_M": 1})
            narrow = [c for c in fits if c["BLOCK_N"] == SPLIT_N[0]]
            if block_m >= SPLIT_MIN_M and narrow and block_k == block_ks[0]:
                grid.append(narrow[0] | {"down": {k: narrow[0][k] for k in DOWN_KEYS}
                                         | {"BLOCK_N": SPLIT_N[1]}})
    per_block = -(-(MAX_QUANT_CANDIDATES - len(grid)) // max(len(tiles), 1))
    grid += [c for fits in tiles for c in fits[:per_block]]
    unique = list({config_key(c): c for c in grid}.values())
    return unique[:MAX_QUANT_CANDIDATES]


def _fits(fmt: str, config: dict[str, int], group: int) -> bool:
    """The gated launch's pipeline (A tile, gate and up weight tiles and their scales, per stage)
    within SHARED_MEMORY_BUDGET; W4A16 also its dequantized tile within
    DEQUANT_VALUES_PER_THREAD fp32 values a thread; nvfp4 8 warps only from NVFP4_8_WARPS_MIN_M
    rows."""
    m, n, k = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]
    if fmt == "nvfp4" and config["num_warps"] == 8 and m < NVFP4_8_WARPS_MIN_M:
        return False
    if fmt == "fp8":  # e4m3 A and B
        stage = m * k + 2 * n * k
    else:  # 2-byte A; B half a byte a weight, a scale (<= 4 bytes) per group
        stage = 2 * m * k + 2 * (n * k // 2 + n * max(1, k // group) * 4)
        if n * k > DEQUANT_VALUES_PER_THREAD * 32 * config["num_warps"]:
            return False
    return stage * config["num_stages"] <= SHARED_MEMORY_BUDGET


def quant_config_file_name(fmt: str, num_experts: int, hidden: int, inter: int, top_k: int,
                           group: int, dtype: torch.dtype, device_name: str,
                           triton: str | None = None, layout: str = "rows") -> str:
    """quant=fp8,E=128,H=2048,I=768,k=8,group=128,device_name=NVIDIA_H200,dtype=bfloat16,
    triton=3.6.0.json (tile_configs.config_file_name's style; dtype: the activations'); a tune
    of micro-tiled weights (layout "micro") is quant=nvfp4,layout=micro,E=...: the same tiles
    time differently in the two layouts, so each has its own file (a rows file keeps the name
    it had before micro-tiles)."""
    if layout not in WEIGHT_LAYOUTS:
        raise ValueError(f"weight layout must be one of {WEIGHT_LAYOUTS}, got {layout!r}")
    device = device_name.replace(" ", "_").replace("/", "_")
    dtype_name = str(dtype).removeprefix("torch.")
    tag = ",layout=micro" if layout == "micro" else ""
    return (f"quant={fmt}{tag},E={num_experts},H={hidden},I={inter},k={top_k},group={group},"
            f"device_name={device},dtype={dtype_name},triton={triton or triton_version()}.json")


def find_quant_tuned(fmt: str, num_experts: int, hidden: int, inter: int, top_k: int,
                     group: int, dtype: torch.dtype, device_name: str,
                     layout: str = "rows") -> tuple[str, dict[int, dict]] | None:
    """(path, {num_tokens: entry}) of the first config folder with a finished entry for this
    shape, format and weight layout ("rows" / "micro": the file's name says which), or None
    (tile_configs.find_config_file: a same-chip device's committed file too)."""
    return find_config_file(
        lambda device: quant_config_file_name(fmt, num_experts, hidden, inter, top_k, group,
                                              dtype, device, layout=layout),
        lambda path: _load_quant_tuned(path, fmt, group), device_name)


def get_quant_config(fmt: str, num_experts: int, hidden: int, inter: int, top_k: int,
                     group: int, dtype: torch.dtype, num_tokens: int, device_name: str,
                     tiles: str = "tuned", micro: bool = False) -> MoeConfigChoice:
    """The tuned entry nearest `num_tokens` for this shape, format and device, of a file that
    timed the weights' layout (micro: micro-tiled, else rows), else `default_quant_config` (a
    tune of the other layout times other tiles best: on an H100 the rows-era GLM-5 / qwen3
    entries ran micro-tiled weights 0-22% slower than the micro defaults from 16 rows an
    expert, gpu_306980f/call1); tiles "default": the default at once, no file read. (backend
    is always "triton": the quantized experts have no other.)"""
    check_tile_source(tiles)
    found = (find_quant_tuned(fmt, num_experts, hidden, inter, top_k, group, dtype, device_name,
                              layout="micro" if micro else "rows") if tiles == "tuned" else None)
    if found is not None:
        path, table = found
        nearest = nearest_token_count(table, num_tokens)
        config = {k: table[nearest][k] for k in (*CONFIG_KEYS, *QUANT_OPTIONS, "down")
                  if k in table[nearest]}
        return MoeConfigChoice(config, True, path, "triton", nearest)
    return MoeConfigChoice(default_quant_config(fmt, num_tokens, top_k, num_experts, group,
                                                (hidden, inter), micro), False, "default")


def parse_quant_entry(raw: dict, fmt: str, group: int) -> dict:
    """A tuned entry as the lookup uses it: the tiles as ints, checked for the format
    (`check_quant_config`), "ms" / "default_ms" as floats when recorded."""
    missing = [k for k in CONFIG_KEYS if k not in raw]
    if missing:
        raise ValueError(f"tuned quantized MoE entry lacks {missing}: {raw}")
    entry: dict = {}
    for key in CONFIG_KEYS:
        value = raw[key]
        if isinstance(value, bool) or not isinstance(value, int | float) or value != int(value):
            raise ValueError(f"tuned quantized MoE entry {key} must be an integer, got {value!r}")
        entry[key] = int(value)
    entry |= {k: raw[k] for k in QUANT_OPTIONS if raw.get(k)}
    if "down" in raw:  # the down launch's own tiles (ints; check_config names a bad one)
        down = raw["down"]
        entry["down"] = ({k: int(v) if isinstance(v, float) and v == int(v) else v
                          for k, v in down.items()} if isinstance(down, dict) else down)
    # the options it may not carry are named too (they would not be read)
    check_quant_config(entry | {k: raw[k] for k in OPTION_KEYS if raw.get(k)}, fmt,
                       (group,), "tuned quantized MoE entry")
    for key in ("ms", "default_ms"):
        if key in raw:
            entry[key] = float(raw[key])
    return entry


@functools.lru_cache(maxsize=64)
def _load_quant_tuned(path: str, fmt: str, group: int) -> dict[int, dict]:
    """{num_tokens: entry} of a tuned file; empty if absent or holding no finished entry."""
    return read_tuned_table(path, functools.partial(parse_quant_entry, fmt=fmt, group=group))


register_cache(_load_quant_tuned.cache_clear)  # tile_configs.clear_caches forgets these too
