"""Tile configs of the Triton fused-MoE kernel: lookup in tuned JSON files, defaults, the tuner.

A config is a dict BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages, used by both GEMMs
of `moe_triton` (BLOCK_M must be shared: it sets the expert-sorted padding). Tuned configs live in
one JSON file per (device, dtype, E, H, I, Triton version), named by `config_file_name`:

    {"meta":    {"device_name", "dtype", "E", "H", "I", "top_k", "triton", "torch"},
     "configs": {"<num_tokens>": {BLOCK_M.., "ms": best time}},      <- what the lookup reads
     "trials":  {"<num_tokens>": {"<candidate key>": ms | "error: ..."}}}  <- the tuner's ledger

`get_moe_config` looks in $MOESERVE_MOE_CONFIG_DIR (if set), then in the package's
`kernels/configs/moe/`, takes the entry whose token count is nearest, and else falls back to
in-code defaults chosen by tokens per expert; the result says which (for the capacity report).

`tune_moe` times every candidate at every token count, writes the file after each candidate
(atomically), and on a rerun skips what the ledger already holds, so a killed tune resumes where
it stopped. A candidate that fails to compile or run is recorded as an error and skipped.
"""

from __future__ import annotations

import functools
import itertools
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

Timer = Callable[[dict, int], float]  # (config, num_tokens) -> ms; raises if the config fails


@dataclass(frozen=True)
class MoeConfigChoice:
    """The tile config for one call, whether it came from a tuned file, and which."""

    config: dict[str, int]
    tuned: bool
    source: str  # the JSON path, or "default"


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


def default_moe_config(num_experts: int, top_k: int, num_tokens: int) -> dict[str, int]:
    """In-code fallback: small tiles while few tokens reach each expert, larger ones after."""
    per_expert = num_tokens * top_k / max(num_experts, 1)
    if per_expert <= 16:  # decode: each expert reads its weights for a handful of rows
        return _config(16, 64, 128, 1, 4, 4)
    if per_expert <= 48:
        return _config(32, 64, 128, 8, 4, 4)
    if per_expert <= 192:
        return _config(64, 128, 64, 8, 8, 4)
    return _config(128, 128, 64, 8, 8, 3)


def get_moe_config(num_experts: int, hidden: int, inter: int, top_k: int, dtype: torch.dtype,
                   num_tokens: int, device_name: str) -> MoeConfigChoice:
    """The tuned config nearest `num_tokens` for this shape and device, else the default."""
    name = config_file_name(num_experts, hidden, inter, dtype, device_name)
    for directory in _config_dirs():
        table = _load_tuned(str(directory / name))
        if table:
            nearest = min(table, key=lambda n: (abs(n - num_tokens), n))
            return MoeConfigChoice(dict(table[nearest]), True, str(directory / name))
    return MoeConfigChoice(default_moe_config(num_experts, top_k, num_tokens), False, "default")


def moe_tune_candidates(num_experts: int, top_k: int, num_tokens: int) -> list[dict[str, int]]:
    """The search grid at one token count (~50-150 configs): BLOCK_M limited by tokens/expert."""
    per_expert = num_tokens * top_k / max(num_experts, 1)
    block_ms = [m for m in (16, 32, 64, 128) if m <= max(16, 2 * per_expert)
                and m >= min(64, per_expert / 4)]
    grid = []
    for block_m, block_n, block_k, warps, stages in itertools.product(
            block_ms, (64, 128), (64, 128), (4, 8), (3, 4, 5)):
        group_ms = (1, 8) if per_expert > block_m else (1,)
        grid += [_config(block_m, block_n, block_k, g, warps, stages) for g in group_ms]
    return grid


def candidate_key(config: dict[str, int]) -> str:
    """M16_N64_K128_G1_w4_s4: the ledger key of a config."""
    return "M{BLOCK_M}_N{BLOCK_N}_K{BLOCK_K}_G{GROUP_M}_w{num_warps}_s{num_stages}".format(**config)


def tune_moe(num_experts: int, hidden: int, inter: int, top_k: int, dtype: torch.dtype,
             token_counts: Sequence[int], out_path: str | Path, *,
             candidates: Callable[[int], list[dict[str, int]]] | None = None,
             timer: Timer | None = None, device_name: str | None = None,
             log: Callable[[str], None] = print) -> dict[int, dict]:
    """Time the candidates at each token count; write the JSON after every one; resumable.

    The default timer builds random inputs on the current CUDA device and times `moe_triton`
    (alignment, both GEMMs, combine) inside a CUDA graph (triton.testing.do_bench_cudagraph).
    `timer` is the seam for tests.
    Returns {num_tokens: best config with its "ms"}.
    """
    if timer is None:
        if not torch.cuda.is_available():
            raise RuntimeError("tune_moe times kernels on a CUDA GPU; none is available")
        timer = _CudaTimer(num_experts, hidden, inter, top_k, dtype)
        device_name = device_name or torch.cuda.get_device_name()
    meta = {"device_name": device_name or "unknown", "dtype": str(dtype).removeprefix("torch."),
            "E": num_experts, "H": hidden, "I": inter, "top_k": top_k,
            "triton": triton_version(), "torch": torch.__version__}
    out_path = Path(out_path)
    doc = _load_ledger(out_path, meta)
    get_candidates = candidates or functools.partial(moe_tune_candidates, num_experts, top_k)
    for num_tokens in token_counts:
        trials = doc["trials"].setdefault(str(num_tokens), {})
        for config in get_candidates(num_tokens):
            key = candidate_key(config)
            if key in trials:
                continue  # done in an earlier (possibly killed) run
            try:
                trials[key] = float(timer(config, num_tokens))
            except Exception as exc:  # compile failure, out of shared memory, bad launch...
                trials[key] = f"error: {type(exc).__name__}: {str(exc)[:200]}"
                log(f"tune_moe T={num_tokens} {key}: skipped ({trials[key]})")
            _write_atomic(out_path, doc)
        timed = {k: v for k, v in trials.items() if isinstance(v, float)}
        if not timed:
            raise RuntimeError(f"tune_moe: every candidate failed at {num_tokens} tokens")
        best = min(timed, key=timed.__getitem__)
        doc["configs"][str(num_tokens)] = {**_parse_key(best), "ms": timed[best]}
        _write_atomic(out_path, doc)
        log(f"tune_moe T={num_tokens}: best {best} {timed[best]:.4f} ms "
            f"({len(timed)} timed, {len(trials) - len(timed)} failed)")
    _load_tuned.cache_clear()
    return {int(n): cfg for n, cfg in doc["configs"].items()}


def _config(block_m: int, block_n: int, block_k: int, group_m: int, warps: int,
            stages: int) -> dict[str, int]:
    return dict(zip(CONFIG_KEYS, (block_m, block_n, block_k, group_m, warps, stages)))


def _parse_key(key: str) -> dict[str, int]:
    values = [int(part[1:]) for part in key.split("_")]
    return dict(zip(CONFIG_KEYS, values))


def _config_dirs() -> list[Path]:
    extra = envs.moe_config_dir()
    return ([Path(extra)] if extra else []) + [PACKAGE_CONFIG_DIR]


@functools.lru_cache(maxsize=64)
def _load_tuned(path: str) -> dict[int, dict[str, int]]:
    """{num_tokens: config} of a tuned file; empty if absent or holding no finished entry."""
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        doc = json.load(f)
    return {int(n): {k: int(cfg[k]) for k in CONFIG_KEYS}
            for n, cfg in doc.get("configs", {}).items()}


def _load_ledger(path: Path, meta: dict) -> dict:
    if not path.exists():
        return {"meta": meta, "configs": {}, "trials": {}}
    with open(path) as f:
        doc = json.load(f)
    same = ("device_name", "dtype", "E", "H", "I", "top_k", "triton")
    theirs = {k: doc.get("meta", {}).get(k) for k in same}
    if theirs != {k: meta[k] for k in same}:
        raise ValueError(f"{path} holds a tune of {theirs}, not {dict((k, meta[k]) for k in same)};"
                         " pick another out_path")
    doc.setdefault("configs", {})
    doc.setdefault("trials", {})
    return doc


def _write_atomic(path: Path, doc: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


class _CudaTimer:
    """Times moe_triton with one config on random inputs, in a CUDA graph (weights built once)."""

    def __init__(self, num_experts: int, hidden: int, inter: int, top_k: int,
                 dtype: torch.dtype) -> None:
        gen = torch.Generator(device="cuda").manual_seed(0)
        self.w13 = (torch.randn(num_experts, 2 * inter, hidden, device="cuda", generator=gen)
                    * hidden ** -0.5).to(dtype)
        self.w2 = (torch.randn(num_experts, hidden, inter, device="cuda", generator=gen)
                   * inter ** -0.5).to(dtype)
        self.top_k, self.dtype, self.gen = top_k, dtype, gen

    def __call__(self, config: dict, num_tokens: int) -> float:
        import triton.testing

        from moeserve.kernels.moe_triton import moe_triton
        from moeserve.kernels.routing import select_experts

        num_experts, hidden = self.w13.shape[0], self.w13.shape[2]
        x = torch.randn(num_tokens, hidden, device="cuda", generator=self.gen).to(self.dtype)
        logits = torch.randn(num_tokens, num_experts, device="cuda", generator=self.gen)
        weights, ids = select_experts(logits, self.top_k, renormalize=True)

        def run() -> torch.Tensor:
            return moe_triton(x, self.w13, self.w2, weights, ids, config=config)

        run()  # compile outside the graph
        torch.cuda.synchronize()
        return float(triton.testing.do_bench_cudagraph(run, rep=20, return_mode="median"))
