"""The search space of the fused-MoE tuner: which tiles and launch options it times, and how
it picks from the ledger. `moe_tune` runs the search (timing, ledger, budget); this module owns
what is searched.

Candidate grids per token count: `moe_tune_candidates` (the full grid, ~50-150 tiles) and
`quick_moe_candidates` (<= 18 tiles, the start-up tune). Per BLOCK_M (`tiles_by_block_m`) each
launch is timed apart in two rounds: `part_candidates` (the tiles; for the gated launch each also
with ONE_DOT from ONE_DOT_MIN_PER_EXPERT pairs per expert) and `refine_candidates` (the first
round's best with the other GROUP_M, with SUB_M and, from PERSISTENT_MIN_PER_EXPERT, with
PERSISTENT 1 and 2; `search_options` says which). `best_split` joins the best gated and the best
down pick of the BLOCK_M with the least align + gated + down. `trial_key` names a timing in the
ledger ("<part>:<config key>").
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import NamedTuple

from moeserve.kernels.moe.tile_configs import CONFIG_KEYS, config_key, split_config, tile_config
from moeserve.kernels.moe.timer import PARTS


def moe_tune_candidates(num_experts: int, top_k: int, num_tokens: int) -> list[dict[str, int]]:
    """The full search grid at one token count (~50-150 tiles, each timed for both launches):
    BLOCK_M limited by tokens/expert."""
    per_expert = num_tokens * top_k / max(num_experts, 1)
    block_ms = [m for m in (16, 32, 64, 128) if m <= max(16, 2 * per_expert)
                and m >= min(64, per_expert / 4)]
    grid = []
    for block_m, block_n, block_k, warps, stages in itertools.product(
            block_ms, (64, 128), (64, 128), (4, 8), (3, 4, 5)):
        group_ms = (1, 8) if per_expert > block_m else (1,)
        grid += [tile_config(block_m, block_n, block_k, g, warps, stages) for g in group_ms]
    return grid


# Quick grid: per BLOCK_M a fixed list (best guesses first), shared by every token count so that
# each tile compiles once per launch per tune; the gated and the down launch each try the whole
# list and keep their own best. (BLOCK_N, BLOCK_K, num_warps, num_stages); GROUP_M is 1 at
# BLOCK_M 16 (about one block per expert) and 8 above. Shared memory per stage of the gated
# launch is (BLOCK_M + 2 * BLOCK_N) * BLOCK_K * 2 bytes: every entry fits the H100/H200's 227 KB.
_QUICK = {
    16: [(64, 128, 4, 4), (32, 128, 4, 4), (128, 128, 4, 3), (64, 256, 4, 3), (128, 64, 4, 4),
         (32, 256, 4, 3), (64, 64, 4, 5), (64, 128, 4, 3), (128, 128, 8, 3), (32, 64, 4, 5)],
    32: [(64, 128, 4, 4), (64, 64, 4, 5), (128, 64, 4, 4), (128, 128, 4, 3), (64, 128, 4, 3),
         (128, 64, 8, 4)],
    64: [(128, 64, 8, 4), (64, 64, 4, 4), (128, 64, 4, 4), (128, 128, 8, 2), (64, 128, 4, 3),
         (128, 64, 8, 3)],
    128: [(128, 64, 8, 3), (128, 64, 8, 4), (64, 64, 4, 4), (64, 128, 8, 3), (128, 128, 8, 2),
          (64, 64, 8, 5)],
}
QUICK_PER_BLOCK_M = 6  # tiles per BLOCK_M when several BLOCK_M values are tried


def quick_moe_candidates(num_experts: int, top_k: int, num_tokens: int) -> list[dict[str, int]]:
    """The quick grid at one token count: <= 18 tiles (each timed for both launches) over the
    BLOCK_M values that fit the tokens per expert (<= 2x it): the two largest, and any down to
    half of it (16 alone while <= 8 reach an expert; 32, 64 and 128 at 64 per expert)."""
    per_expert = num_tokens * top_k / max(num_experts, 1)
    fitting = [m for m in _QUICK if m <= max(16, 2 * per_expert)]
    block_ms = [m for i, m in enumerate(fitting) if i >= len(fitting) - 2 or m >= per_expert / 2]
    per_block_m = QUICK_PER_BLOCK_M if len(block_ms) > 1 else len(_QUICK[block_ms[0]])
    return [tile_config(m, n, k, 1 if m == 16 else 8, warps, stages)
            for m in block_ms for n, k, warps, stages in _QUICK[m][:per_block_m]]


def candidate_key(config: dict) -> str:
    """M16_N64_K128_G1_w4_s4 (then _1dot / _p1 for its options): the name of a candidate's
    top-level tiles (any "down" ignored)."""
    return config_key({k: v for k, v in config.items() if k != "down"})


# Launch options (moe_configs.OPTION_KEYS) the search adds to the tiles, each from a number of
# pairs per expert on. ONE_DOT: every gated tile is tried with and without. PERSISTENT: the
# second round (`refine_candidates`) tries each launch's best tile of a BLOCK_M with
# PERSISTENT_TRIES. On the H200 at 0f157b4 (qwen3-30b-a3b, the tuned tiles of the two-dot
# launch), ONE_DOT was the same at 64 and 256 tokens (4 and 16 per expert) and 1-4% faster at
# 1,024 and 2,048 (64, 128); one program per SM was slower at 64-2,048 tokens and faster only
# at 8,192 (512 per expert) with ONE_DOT. The second round also tries the best tile with the
# other GROUP_M (1 <-> 8; the quick grid has 8 above BLOCK_M 16): the full grid at 8,192 tokens
# found the down launch 11% faster with GROUP_M 1, and with about one row block per expert a
# group of 8 blocks spans 8 experts, whose weight tiles it cannot share. And with SUB_M (the
# last, mostly padding, block of an expert computed as a half or quarter tile).
ONE_DOT_MIN_PER_EXPERT = 32
PERSISTENT_MIN_PER_EXPERT = 128
PERSISTENT_TRIES = (1, 2)


class SearchOptions(NamedTuple):
    """Which launch options the search at one token count tries (`search_options`)."""

    one_dot: bool = False
    persistent: bool = False


NO_OPTIONS = SearchOptions()


def search_options(num_experts: int, top_k: int, num_tokens: int) -> SearchOptions:
    """The options worth trying at num_tokens (ONE_/PERSISTENT_MIN_PER_EXPERT)."""
    pairs = num_tokens * top_k
    return SearchOptions(pairs >= ONE_DOT_MIN_PER_EXPERT * num_experts,
                         pairs >= PERSISTENT_MIN_PER_EXPERT * num_experts)


def part_candidates(part: str, tiles: Sequence[dict],
                    options: SearchOptions = NO_OPTIONS) -> list[dict]:
    """The first round of one launch at one BLOCK_M: the tiles, and for the gated launch (with
    options.one_dot) each again with ONE_DOT."""
    if part == "gated" and options.one_dot:
        return [*tiles, *({**t, "ONE_DOT": 1} for t in tiles)]
    return list(tiles)


def refine_candidates(part: str, tiles: Sequence[dict], trials: dict[str, float | str],
                      options: SearchOptions = NO_OPTIONS) -> list[dict]:
    """The second round: the first round's best timed tile of `part` with the other GROUP_M
    and with SUB_M (above BLOCK_M 16), then (with options.persistent) with each
    PERSISTENT_TRIES; none before the first round has a timing."""
    best = _best_timed(part, part_candidates(part, tiles, options), trials)
    if best is None:
        return []
    tile = best[2]
    refined = []
    if tile["BLOCK_M"] > 16:
        refined.append({**tile, "GROUP_M": 8 if tile["GROUP_M"] == 1 else 1})
        refined.append({**tile, "SUB_M": 1})  # half tiles (>= 16 rows) exist from BLOCK_M 32
    if options.persistent:
        refined += [{**tile, "PERSISTENT": n} for n in PERSISTENT_TRIES]
    return refined


def _refine_count(block_m: int, options: SearchOptions) -> int:
    """How many tiles `refine_candidates` gives at this BLOCK_M (once the first round ran)."""
    return 2 * (block_m > 16) + (len(PERSISTENT_TRIES) if options.persistent else 0)


def _best_timed(part: str, configs: Sequence[dict],
                trials: dict[str, float | str]) -> tuple[float, int, dict] | None:
    """(ms, position, config) of the fastest timed config of `part` (ties: the first)."""
    timed = [(trials[trial_key(part, c)], i, c) for i, c in enumerate(configs)
             if isinstance(trials.get(trial_key(part, c)), float)]
    return min(timed, key=lambda t: t[:2]) if timed else None


def tiles_by_block_m(configs: Sequence[dict]) -> dict[int, list[dict[str, int]]]:
    """{BLOCK_M: [tile configs]} in first-seen order, without repeats (by `candidate_key`);
    a "down" entry in a candidate is dropped (each tile is tried for both launches)."""
    grid: dict[int, dict[str, dict[str, int]]] = {}
    for config in configs:
        tiles = {k: config[k] for k in CONFIG_KEYS}
        grid.setdefault(tiles["BLOCK_M"], {}).setdefault(candidate_key(tiles), tiles)
    return {m: list(tiles.values()) for m, tiles in grid.items()}


def best_split(grid: dict[int, list[dict[str, int]]], trials: dict[str, float | str],
               options: SearchOptions = NO_OPTIONS) -> tuple[dict, float] | None:
    """(config, align + gated + down ms) of the BLOCK_M whose align plus best gated tile plus
    best down tile is the least (ties: the first), from the ledger (both rounds: the tiles with
    their options, then PERSISTENT on the best); None if no BLOCK_M has all three timed. The
    config has "down" when the two launches' best tiles differ."""
    best: tuple[dict, float] | None = None
    for block_m, tiles in grid.items():
        align = trials.get(trial_key("align", {"BLOCK_M": block_m}))
        picks = []
        for part in ("gated", "down"):
            pick = _best_timed(part, part_candidates(part, tiles, options)
                               + refine_candidates(part, tiles, trials, options), trials)
            if pick is not None:
                picks.append(pick)
        if not isinstance(align, float) or len(picks) < 2:
            continue
        (gated_ms, _, gated), (down_ms, _, down) = picks
        total = align + gated_ms + down_ms
        if best is None or total < best[1]:
            best = split_config(gated, down), total
    return best


def trial_key(part: str, config: dict) -> str:
    """The ledger key of one timing: "align:M64", "gated:M64_N64_K64_G8_w4_s4",
    "down:M64_N128_K64_G8_w8_s3", "moe:M64_N64_K64_G8_w4_s4+down_N128_K64_G8_w8_s3"."""
    if part == "align":
        return f"align:M{config['BLOCK_M']}"
    if part not in PARTS:
        raise ValueError(f"part must be one of {PARTS}, got {part!r}")
    return f"{part}:{config_key(config) if part == 'moe' else candidate_key(config)}"


def plan_keys(grid: dict[int, list[dict[str, int]]], options: SearchOptions = NO_OPTIONS,
               trials: dict[str, float | str] | None = None) -> list[str]:
    """Every timing key of one token count's search (the whole-op one excepted): the second
    round's from the ledger's best so far, or placeholders before the first round has a timing
    (the count is right, the names are not)."""
    keys = []
    for block_m, tiles in grid.items():
        keys.append(trial_key("align", {"BLOCK_M": block_m}))
        for part in ("gated", "down"):
            keys += [trial_key(part, c) for c in part_candidates(part, tiles, options)]
            second = refine_candidates(part, tiles, trials or {}, options)
            keys += ([trial_key(part, c) for c in second] if second else
                     [f"{part}:M{block_m}:refine{i}"
                      for i in range(_refine_count(block_m, options))])
    return keys
