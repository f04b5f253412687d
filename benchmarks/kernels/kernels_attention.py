"""Paged attention on the GPU: the Triton kernels against the torch reference, decode and prefill.

Shape: preset qwen3-30b-a3b's attention (32 query heads, 4 KV heads of 128, bf16, blocks of 16
scattered over one pool). Each case is first checked against `paged_attention_ref` (decode: on a
subset of rows for the big batches), then timed with triton.testing.do_bench (L2 flushed before
each call): Triton decode replayed from a CUDA graph (as the engine runs it), the reference and
prefill eager. Reports ms per layer, achieved KV-read bandwidth (context K/V bytes of the batch /
time) and its share of the device copy rate (4.27 TB/s on the H200), and a small sweep of decode
tile configs and split counts at three cases.

Prefill ("prefill"): W1's mixed step, eight 2k chunks after 2k, and the long prompts at 8k
context (one and four fresh 8,192-token prompts, four last 2k chunks of 8k prompts), each at
its achieved TFLOP/s of the unmasked causal FLOPs against the 787 TFLOP/s bf16 peak.

Prefill tile sweep ("prefill_sweep"): three prefill steps, W1's mixed step (64 fresh prompts of
128 tokens), 8 fresh prompts of 1,024 and 8 chunks of 512 after 512 cached tokens. Each
TileConfig of PREFILL_GRID (the default first; those whose shared memory or accumulator
registers obviously overflow are skipped, named) is checked against `paged_attention_ref`, then
timed replayed from a CUDA graph (kernel time, no host launch cost; the default is also timed
eager). Reports ms per layer, achieved TFLOP/s of the causal attention FLOPs (4 * D per query,
visible key and head: QK^T and PV) and its share of 787 TFLOP/s, and the best config per case. A
config that fails (compile, launch, accuracy) is recorded with its error; configs left when
--prefill-sweep-s has passed are recorded as skipped. `--prefill-cases long` sweeps issue 14's
8k prompts instead (one fresh 8,192-token prompt, four last 2k chunks of 8k prompts). Writes
kernels_attention.json to --out after each section.

    python -m benchmarks.kernels.kernels_attention --out DIR [--batches 256 512] [--no-sweep]
    python -m benchmarks.kernels.kernels_attention --out DIR --prefill-cases long --no-decode-sweep
    python -m benchmarks.kernels.kernels_attention --out DIR --kv-cache-dtype fp8 --no-sweep

`--kv-cache-dtype fp8` keeps the pool in float8 e4m3 (the engine's kv_cache_dtype="fp8"): the
bandwidth then counts its 1-byte values, the queries stay bf16.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from benchmarks.engine.w1_offline import environment
from moeserve.kernels.attention.metadata import AttentionMetadata, build_attention_metadata
from moeserve.kernels.attention.paged import (
    FP8_CACHE_DTYPES,
    paged_attention_ref,
    to_cache_dtype,
)
from moeserve.kernels.attention.paged_triton import (
    TileConfig,
    decode_num_splits,
    default_config,
    paged_attention_triton,
)

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 4, 128, 16
DTYPE = torch.bfloat16
KV_BYTES_PER_TOKEN = 2 * KV_HEADS * HEAD_DIM * 2  # K and V of one layer, bf16
COPY_TBPS = 4.27  # device copy rate measured on the H200 (reference/ANCHORS.md)
DENSE_TFLOPS = 787.0
TOL = 2e-2
REF_MAX_TOKENS = 1024 * 2048  # time the reference only up to this many context tokens
CHECK_ROWS = 128  # decode rows checked against the reference in big batches
SWEEP_CASES = ((1024, 192), (256, 4096), (2048, 1024))
SWEEP_CONFIGS = [TileConfig(16, n, w, s) for n in (32, 64, 128) for w in (2, 4, 8)
                 for s in (2, 3)]
SWEEP_SPLITS = (1, 2, 4, 8)
# (name, computed tokens per row, new tokens per row): W1's mixed step is the first
PREFILL_CASES = (("w1_64x128_fresh", [0] * 64, [128] * 64),
                 ("8x1024_fresh", [0] * 8, [1024] * 8),
                 ("8x512_after_512", [512] * 8, [512] * 8))
# issue 14's long prompts: a fresh 8k prompt taken in whole, and four last 2k chunks of 8k
LONG_PREFILL_CASES = (("1x8192_fresh", [0], [8192]),
                      ("4x2048_after_6144", [6144] * 4, [2048] * 4))
PREFILL_CASE_SETS = {"w1": PREFILL_CASES, "long": LONG_PREFILL_CASES}
PREFILL_GRID = [TileConfig(m, n, w, s) for m in (64, 128, 256) for n in (32, 64, 128)
                for w in (4, 8) for s in (1, 2, 3)]
SMEM_LIMIT = 227 * 1024  # bytes of shared memory per block on the H200
MAX_REGS = 255  # per thread


def make_pool(num_tokens: int, kv_dtype: torch.dtype = DTYPE) -> torch.Tensor:
    """A KV pool (bf16, or float8 e4m3: the engine's kv_cache_dtype="fp8") with room for
    num_tokens (+ null block and 5% spare), random contents."""
    num_blocks = 1 + int(num_tokens * 1.05) // BLOCK + 1
    pool = torch.empty(2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM, dtype=kv_dtype, device="cuda")
    if kv_dtype == DTYPE:
        return pool.normal_()
    for half in pool:  # normal_ has no float8 kernel: one bf16 half at a time
        half.copy_(to_cache_dtype(torch.randn(half.shape, dtype=DTYPE, device="cuda"), kv_dtype))
    return pool


def query_dtype(pool: torch.Tensor) -> torch.dtype:
    """The queries' dtype over this pool: the pool's, bf16 over a float8 one."""
    return DTYPE if pool.dtype in FP8_CACHE_DTYPES else pool.dtype


def decode_step(pool: torch.Tensor, batch: int, context: int,
                seed: int) -> tuple[torch.Tensor, AttentionMetadata, list[list[int]]]:
    """q and metadata of one decode step: every row at `context` keys, blocks scattered."""
    per_row = -(-context // BLOCK)
    gen = torch.Generator().manual_seed(seed)
    ids = (torch.randperm(pool.shape[1] - 1, generator=gen)[:batch * per_row] + 1).view(
        batch, per_row).tolist()
    meta = build_attention_metadata([context - 1] * batch, [1] * batch, ids, BLOCK, "cuda")
    q = torch.randn(batch, HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
    return q, meta, ids


def check_decode(q: torch.Tensor, pool: torch.Tensor, meta: AttentionMetadata,
                 tables: list[list[int]], out: torch.Tensor) -> float:
    """Max |triton - reference| over (a subset of) the rows; raises past the tolerance."""
    rows = np.arange(len(tables))
    if len(rows) > CHECK_ROWS:
        rows = np.random.default_rng(0).choice(rows, CHECK_ROWS, replace=False)
    sub = build_attention_metadata((meta.seq_lens_np[rows] - 1).tolist(), [1] * len(rows),
                                   [tables[r] for r in rows], BLOCK, "cuda")
    idx = torch.from_numpy(rows).cuda()
    ref = paged_attention_ref(q[idx], pool, sub, HEAD_DIM ** -0.5)
    torch.testing.assert_close(out[idx].float(), ref.float(), atol=TOL, rtol=TOL)
    return float((out[idx].float() - ref.float()).abs().max())


def time_ms(fn: Callable[[], object]) -> float:
    from triton.testing import do_bench
    return float(do_bench(fn, warmup=10, rep=40, return_mode="median"))


def time_graph_ms(fn: Callable[[], object]) -> float:
    """Capture fn (already compiled) in a CUDA graph and time its replay."""
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    ms = time_ms(graph.replay)
    del graph
    return ms


def bandwidth(batch: int, context: int, ms: float, elem_bytes: int = 2) -> dict:
    """The K/V bytes read a second (elem_bytes a value: 1 for a float8 pool)."""
    gbps = batch * context * KV_BYTES_PER_TOKEN * elem_bytes / 2 / ms / 1e6
    return {"kv_gb_per_s": round(gbps, 1), "pct_of_copy": round(100 * gbps / (COPY_TBPS * 1e3), 1)}


def bench_decode(pool: torch.Tensor, batch: int, context: int) -> dict:
    q, meta, tables = decode_step(pool, batch, context, seed=batch + context)
    scale = HEAD_DIM ** -0.5
    out = paged_attention_triton(q, pool, meta, scale)
    row: dict = {"batch": batch, "context": context,
                 "splits": decode_num_splits(batch, KV_HEADS, context),
                 "max_abs_err": check_decode(q, pool, meta, tables, out)}
    ms = time_graph_ms(lambda: paged_attention_triton(q, pool, meta, scale))
    row |= {"triton_ms": round(ms, 4), "triton_ms_48_layers": round(48 * ms, 2),
            **bandwidth(batch, context, ms, pool.element_size())}
    if batch * context <= REF_MAX_TOKENS:
        ref_ms = time_ms(lambda: paged_attention_ref(q, pool, meta, scale))
        row |= {"ref_ms": round(ref_ms, 4), "speedup": round(ref_ms / ms, 2)}
    return row


def sweep_decode(pool: torch.Tensor) -> list[dict]:
    """Decode tile configs (default split count), then split counts (default tiles)."""
    trials = [({"decode_config": c}, c.__dict__) for c in SWEEP_CONFIGS]
    trials += [({"decode_splits": s}, {"splits": s}) for s in SWEEP_SPLITS]
    rows = []
    for batch, context in SWEEP_CASES:
        q, meta, tables = decode_step(pool, batch, context, seed=7)
        for kwargs, label in trials:
            run = functools.partial(paged_attention_triton, q, pool, meta, HEAD_DIM ** -0.5,
                                    **kwargs)
            row = {"batch": batch, "context": context, **label}
            try:
                check_decode(q, pool, meta, tables, run())
                ms = time_graph_ms(run)
                row |= {"triton_ms": round(ms, 4),
                        **bandwidth(batch, context, ms, pool.element_size())}
            except Exception as exc:  # a failing candidate is data, not the end of the run
                row["error"] = f"{type(exc).__name__}: {exc}"[:300]
            rows.append(row)
    return rows


def prefill_step(pool: torch.Tensor, computed: Sequence[int], scheduled: Sequence[int],
                 seed: int = 0) -> tuple[torch.Tensor, AttentionMetadata]:
    """q [sum(scheduled), HEADS, HEAD_DIM] and metadata of one prefill step (new prompts or
    chunks after a prefix) whose rows' blocks are scattered over the pool, on the pool's
    device and dtype."""
    seq = [c + s for c, s in zip(computed, scheduled, strict=True)]
    per_row = [-(-n // BLOCK) for n in seq]
    ids = (torch.randperm(pool.shape[1] - 1, generator=torch.Generator().manual_seed(seed))
           [:sum(per_row)] + 1).tolist()
    if len(ids) < sum(per_row):
        raise ValueError(f"pool of {pool.shape[1]} blocks too small for {sum(per_row)}")
    firsts = np.cumsum([0, *per_row]).tolist()
    tables = [ids[a:b] for a, b in zip(firsts[:-1], firsts[1:])]
    meta = build_attention_metadata(list(computed), list(scheduled), tables, BLOCK,
                                    str(pool.device))
    gen = torch.Generator(device=pool.device).manual_seed(seed)
    q = torch.randn(sum(scheduled), HEADS, HEAD_DIM, generator=gen, device=pool.device,
                    dtype=query_dtype(pool))
    return q, meta


def causal_flops(computed: Sequence[int], scheduled: Sequence[int]) -> int:
    """FLOPs of causal prefill attention: query i of a row sees computed + i + 1 keys; 4 * D per
    (query, visible key, head) pair (QK^T and PV, a multiply-add each)."""
    pairs = sum(s * c + s * (s + 1) // 2 for c, s in zip(computed, scheduled, strict=True))
    return 4 * pairs * HEADS * HEAD_DIM


def flop_rate(flops: int, ms: float) -> dict:
    tflops = flops / ms / 1e9
    return {"tflops": round(tflops, 1), "pct_of_dense": round(100 * tflops / DENSE_TFLOPS, 1)}


def bench_prefill(pool: torch.Tensor, computed: list[int], scheduled: list[int]) -> dict:
    """One prefill step (new prompts or chunks after a prefix), eager with its host work."""
    q, meta = prefill_step(pool, computed, scheduled)
    scale = HEAD_DIM ** -0.5
    out = paged_attention_triton(q, pool, meta, scale)
    ref = paged_attention_ref(q, pool, meta, scale)
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL, rtol=TOL)
    ms = time_ms(lambda: paged_attention_triton(q, pool, meta, scale))
    ref_ms = time_ms(lambda: paged_attention_ref(q, pool, meta, scale))
    return {"rows": len(computed), "tokens": sum(scheduled), "computed": computed[0],
            "chunk": scheduled[0], "max_abs_err": float((out.float() - ref.float()).abs().max()),
            "triton_ms": round(ms, 4), "ref_ms": round(ref_ms, 4),
            "speedup": round(ref_ms / ms, 2), **flop_rate(causal_flops(computed, scheduled), ms)}


def prefill_skip_reason(cfg: TileConfig) -> str | None:
    """Why a bf16 prefill tile config is not worth compiling, or None: its shared memory (the Q
    tile plus a K and a V tile per stage) past SMEM_LIMIT, or its fp32 accumulator alone past
    a thread's registers (certain spills)."""
    smem = 2 * HEAD_DIM * (cfg.block_m + 2 * cfg.block_n * cfg.num_stages)
    if smem > SMEM_LIMIT:
        return f"shared memory ~{smem // 1024} KB > {SMEM_LIMIT // 1024} KB"
    regs = cfg.block_m * HEAD_DIM // (32 * cfg.num_warps)
    if regs > MAX_REGS:
        return f"accumulator alone {regs} registers per thread > {MAX_REGS}"
    return None


def sweep_prefill_configs(cases: list[dict], trial: Callable[[int, TileConfig], dict],
                          configs: Sequence[TileConfig], default: TileConfig, deadline_s: float,
                          clock: Callable[[], float] = time.monotonic,
                          log: Callable[[str], object] = print) -> list[dict]:
    """Every config (the default first) on every case: trial(case index, config) -> {"ms",
    "max_abs_err"} or raises. Adds to each case (a dict with "flops") its "trials" rows (timed,
    "error" or "skipped"), "default" and "best" (None when nothing ran). Configs outer: each
    compiles once for all cases, and the deadline cuts whole configs."""
    start = clock()
    order = [default, *[c for c in configs if c != default]]
    for case in cases:
        case["trials"] = []
    for cfg in order:
        reason = None if cfg == default else prefill_skip_reason(cfg)
        if reason is None and cfg != default and clock() - start > deadline_s:
            reason = f"deadline {deadline_s:.0f} s"
        for i, case in enumerate(cases):
            row: dict = {**cfg.__dict__}
            if reason is not None:
                row["skipped"] = reason
            else:
                try:
                    got = trial(i, cfg)
                    ms = float(got["ms"])
                    row |= {"max_abs_err": got["max_abs_err"], "ms": round(ms, 4),
                            "ms_48_layers": round(48 * ms, 2), **flop_rate(case["flops"], ms)}
                except Exception as exc:  # a failing candidate is data, not the end of the run
                    row["error"] = f"{type(exc).__name__}: {exc}"[:300]
                log(f"prefill-sweep {case['case']} {row}")
            case["trials"].append(row)
    for case in cases:
        timed = [t for t in case["trials"] if "ms" in t]
        case["default"] = case["trials"][0]
        case["best"] = min(timed, key=lambda t: t["ms"]) if timed else None
    return cases


def summary_line(case: dict) -> str:
    d, b = case["default"], case["best"]
    if b is None:
        return f"prefill-sweep {case['case']}: nothing ran ({d.get('error', d.get('skipped'))})"
    dflt = f"{d['ms']:.4f} ms" if "ms" in d else f"failed ({d.get('error')})"
    cfg = TileConfig(b["block_m"], b["block_n"], b["num_warps"], b["num_stages"])
    return (f"prefill-sweep {case['case']}: default {dflt}, best {b['ms']:.4f} ms "
            f"({b['tflops']} TFLOP/s, {b['pct_of_dense']}% of {DENSE_TFLOPS:.0f}) {cfg}")


def sweep_prefill(pool: torch.Tensor, deadline_s: float,
                  cases: Sequence[tuple[str, list[int], list[int]]] = PREFILL_CASES,
                  configs: Sequence[TileConfig] = PREFILL_GRID,
                  timer: Callable[[Callable[[], object]], float] = time_graph_ms,
                  eager_timer: Callable[[Callable[[], object]], float] = time_ms) -> list[dict]:
    """Prefill cases x tile configs: each checked against the reference, then timed by `timer`
    (CUDA-graph replay; the default config also by `eager_timer`)."""
    scale = HEAD_DIM ** -0.5
    default = default_config("prefill", HEAD_DIM, query_dtype(pool))
    steps, refs, rows = [], [], []
    for k, (name, computed, scheduled) in enumerate(cases):
        q, meta = prefill_step(pool, computed, scheduled, seed=100 + k)
        steps.append((q, meta))
        refs.append(paged_attention_ref(q, pool, meta, scale).float())
        rows.append({"case": name, "rows": len(computed), "tokens": sum(scheduled),
                     "computed": computed[0], "chunk": scheduled[0],
                     "flops": causal_flops(computed, scheduled)})

    def trial(i: int, cfg: TileConfig) -> dict:
        q, meta = steps[i]
        run = functools.partial(paged_attention_triton, q, pool, meta, scale,
                                prefill_config=cfg)
        out = run().float()  # compiles the config, splits the rows once (cached on meta)
        torch.testing.assert_close(out, refs[i], atol=TOL, rtol=TOL)
        return {"max_abs_err": float((out - refs[i]).abs().max()), "ms": timer(run)}

    sweep_prefill_configs(rows, trial, configs, default, deadline_s)
    for row, (q, meta) in zip(rows, steps):
        if "ms" in row["default"]:
            eager = eager_timer(functools.partial(paged_attention_triton, q, pool, meta, scale,
                                                  prefill_config=default))
            row["default_eager_ms"] = round(eager, 4)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory for kernels_attention.json")
    parser.add_argument("--batches", type=int, nargs="+", default=[256, 512, 1024, 2048])
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 192, 1024, 2048, 4096])
    parser.add_argument("--no-sweep", action="store_true",
                        help="skip the decode and the prefill config sweeps")
    parser.add_argument("--prefill-cases", choices=sorted(PREFILL_CASE_SETS), default="w1",
                        help="the prefill sweep's cases: W1's short prompts or 8k prompts")
    parser.add_argument("--no-decode-sweep", action="store_true",
                        help="sweep the prefill configs only")
    parser.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto",
                        help="the pool's element type: bf16, or float8 e4m3 (read back in bf16)")
    parser.add_argument("--prefill-sweep-s", type=float, default=100.0,
                        help="start no new prefill config past this many seconds of the sweep")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("kernels_attention needs a CUDA GPU")
    os.makedirs(args.out, exist_ok=True)
    prefill_tokens = 256 * 128 + 8 * 4096
    sweep_tokens = 0 if args.no_sweep else max(
        *(b * c for b, c in SWEEP_CASES),
        *(sum(c) + sum(n) for _, c, n in PREFILL_CASE_SETS[args.prefill_cases]))
    kv_dtype = FP8_CACHE_DTYPES[0] if args.kv_cache_dtype == "fp8" else DTYPE
    pool = make_pool(max(max(args.batches) * max(args.contexts), prefill_tokens, sweep_tokens),
                     kv_dtype)
    result: dict = {"environment": environment(), "copy_tb_per_s": COPY_TBPS,
                    "shape": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
                              "block_size": BLOCK, "dtype": str(DTYPE),
                              "kv_dtype": str(pool.dtype),
                              "decode_config": default_config("decode", HEAD_DIM, DTYPE).__dict__,
                              "prefill_config": default_config("prefill", HEAD_DIM,
                                                               DTYPE).__dict__},
                    "decode": [], "sweep": [], "prefill": [], "prefill_sweep": []}
    path = os.path.join(args.out, "kernels_attention.json")

    def write() -> None:  # after each section: a run cut short keeps what it measured
        with open(path, "w") as f:
            json.dump(result, f, indent=1)

    print(f"{'batch':>6} {'ctx':>5} {'splits':>6} {'triton ms':>10} {'GB/s':>7} {'% copy':>6} "
          f"{'ref ms':>8} {'x':>6}")
    for batch in args.batches:
        for context in args.contexts:
            row = bench_decode(pool, batch, context)
            result["decode"].append(row)
            ref_ms, speedup = row.get("ref_ms", float("nan")), row.get("speedup", float("nan"))
            print(f"{batch:>6} {context:>5} {row['splits']:>6} {row['triton_ms']:>10.4f} "
                  f"{row['kv_gb_per_s']:>7.0f} {row['pct_of_copy']:>6.1f} {ref_ms:>8.4f} "
                  f"{speedup:>6.2f}")
    # W1's mixed step, 2k chunks, and issue 14's long prompts at 8k context: one and four fresh
    # 8,192-token prompts, and four last 2,048-token chunks of 8k prompts (unmasked FLOPs only)
    for computed, scheduled in (([0] * 256, [128] * 256), ([2048] * 8, [2048] * 8),
                                ([0], [8192]), ([0] * 4, [8192] * 4), ([6144] * 4, [2048] * 4)):
        row = bench_prefill(pool, computed, scheduled)
        result["prefill"].append(row)
        print(f"prefill {row}")
    write()
    if not args.no_sweep:
        result["prefill_sweep"] = sweep_prefill(pool, args.prefill_sweep_s,
                                                PREFILL_CASE_SETS[args.prefill_cases])
        for case in result["prefill_sweep"]:
            print(summary_line(case))
        write()
        if not args.no_decode_sweep:
            result["sweep"] = sweep_decode(pool)
        for row in result["sweep"]:
            print(f"sweep {row}")
    write()
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
