"""The FP8 block-scaled linear's two backends on one GPU: kernels/linear/fp8_cublas.py's
`fp8_linear` with backend "triton" (fp8_block_triton.py) and "cublas" (cuBLASLt's blockwise
scaled_mm), beside bf16 F.linear, at kernels_quant.py's linear shapes (qwen3 qkv 5120 x 2048,
o_proj 2048 x 4096, GLM-5 q_b 16384 x 2048, o_proj 6144 x 16384; 128 x 128 weight blocks)
and 1 / 16 / 64 / 256 / 1,024 / 4,096 tokens. Each backend's error against w8a8_linear_ref
(max of |out - ref| / (|ref| + mean |ref|), and sum |out - ref| / sum |ref| with ref rounded to
bf16: tests/kernels/linear/test_fp8_linear_triton.py's bounds, 2^-5 and 1e-3); times from the MoE
tuner's `time_in_graph` (10 calls in one CUDA graph, the median of 5 replays, as
kernels_quant.py). Also `quantize_activations_triton` alone on [65,536, 768] (the fused MoE's
activations at 8,192 tokens) and [8,192, 7,168], plain and in cuBLAS's layout.

The `suggested_auto_cublas_min_tokens` it writes is the smallest token count from which
cuBLAS is at least as fast as Triton at every shape: the value for fp8_cublas.py's
AUTO_CUBLAS_MIN_TOKENS.

On the H200 (about 30-60 s, most of it Triton compiles):

    source benchmarks/gpu_env.sh; python -m benchmarks.quant.fp8_linear_backends --out $OUT

Writes DIR/fp8_linear_backends.json (environment: git commit, device, torch / triton; the
config; the probe's verdict; the rows) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F

from benchmarks.quant.kernels_quant import LINEAR_SHAPES
from moeserve.kernels.linear import fp8_cublas
from moeserve.kernels.linear.fp8_block_triton import quantize_activations_triton
from moeserve.kernels.moe.timer import time_in_graph
from moeserve.quant.fp8_block import quantize_blockwise, w8a8_linear_ref

TOKENS = (1, 16, 64, 256, 1024, 4096)
QUANT_SHAPES = ((65536, 768), (8192, 7168))
CALLS, REPLAYS = 10, 5


def errors(out: torch.Tensor, ref: torch.Tensor) -> dict:
    """The test's two measures (module doc) of out against the fp32 reference."""
    rounded = ref.to(out.dtype).float()
    mean = (out.float() - rounded).abs().sum() / rounded.abs().sum()
    err = (out.float() - ref).abs() / (ref.abs() + ref.abs().mean())
    return {"max_err": float(err.max()), "mean_rel_diff": float(mean)}


def bench_shape(name: str, n: int, k: int, tokens: list[int], cublas_ok: bool,
                gen: torch.Generator) -> list[dict]:
    w = torch.randn(n, k, device="cuda", generator=gen) * k ** -0.5
    w_q, w_s = quantize_blockwise(w)  # [N, K] e4m3, [N / 128, K / 128] fp32
    w_bf16 = w.to(torch.bfloat16)
    del w
    unfit = fp8_cublas.cublas_unfit(n, k, 128)
    rows = []
    for t in tokens:
        x = torch.randn(t, k, device="cuda", generator=gen).to(torch.bfloat16)
        ref = w8a8_linear_ref(x.float(), w_q, w_s)
        ops = {"bf16": lambda x=x: F.linear(x, w_bf16),
               "triton": lambda x=x: fp8_cublas.fp8_linear(x, w_q, w_s, backend="triton")}
        if cublas_ok and unfit is None:
            ops["cublas"] = lambda x=x: fp8_cublas.fp8_linear(x, w_q, w_s, backend="cublas")
        row: dict = {"shape": name, "N": n, "K": k, "tokens": t,
                     "auto": fp8_cublas.choose_fp8_backend(t, n, k, 128, x.device)}
        for backend, fn in ops.items():
            out = fn()
            if backend != "bf16":
                row[backend] = errors(out, ref)
            ms = time_in_graph(fn, CALLS, REPLAYS)
            row.setdefault(backend, {}).update(
                {"ms": round(ms, 5), "tflops": round(2 * t * n * k / (ms * 1e-3) / 1e12, 1)})
        rows.append(row)
        del ref
    return rows


def bench_quantize() -> list[dict]:
    rows = []
    for t, k in QUANT_SHAPES:
        x = torch.randn(t, k, device="cuda").to(torch.bfloat16)
        for layout, kw in (("plain", {}), ("cublas", {"pad_rows_to": fp8_cublas.M_ALIGN,
                                                       "mn_major_scales": True})):
            ms = time_in_graph(lambda x=x, kw=kw: quantize_activations_triton(x, **kw), CALLS,
                               REPLAYS)
            moved = t * k * 3 + t * (k // 128) * 4  # bf16 in, e4m3 out, fp32 scales
            rows.append({"tokens": t, "K": k, "layout": layout, "ms": round(ms, 5),
                         "programs": -(-t // (16 if t < 2048 else 64)) * -(-k // 128),
                         "tb_per_s": round(moved / (ms * 1e-3) / 1e12, 2)})
    return rows


def suggest_min_tokens(rows: list[dict], tokens: list[int]) -> int | None:
    """The smallest token count from which cuBLAS beats Triton (or ties) at every shape and
    every larger count; None when it never does (or did not run)."""
    best = None
    for t in sorted(tokens, reverse=True):
        at = [r for r in rows if r["tokens"] == t and "cublas" in r]
        if not at or any(r["cublas"]["ms"] > r["triton"]["ms"] for r in at):
            break
        best = t
    return best


def print_table(rows: list[dict]) -> None:
    print(f"{'shape':14} {'T':>5} {'bf16 ms':>9} {'triton ms':>10} {'cublas ms':>10} "
          f"{'tri TF':>7} {'cub TF':>7} {'tri max':>8} {'cub max':>8} {'auto':>7}")
    for r in rows:
        cub = r.get("cublas", {})
        print(f"{r['shape']:14} {r['tokens']:5d} {r['bf16']['ms']:9.4f} "
              f"{r['triton']['ms']:10.4f} {cub.get('ms', float('nan')):10.4f} "
              f"{r['triton']['tflops']:7.1f} {cub.get('tflops', float('nan')):7.1f} "
              f"{r['triton']['max_err']:8.2g} {cub.get('max_err', float('nan')):8.2g} "
              f"{r['auto']:>7}")


def main() -> None:
    from benchmarks.engine.w1_offline import environment

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder for fp8_linear_backends.json")
    parser.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("fp8_linear_backends: needs a CUDA GPU")
    os.makedirs(args.out, exist_ok=True)
    t0 = time.perf_counter()
    ok, why = fp8_cublas.cublas_support(torch.device("cuda", torch.cuda.current_device()))
    print(f"cuBLAS blockwise: {'supported' if ok else 'unsupported'} ({why})", flush=True)
    result: dict = {
        "environment": environment(),
        "config": {"tokens": args.tokens, "shapes": [dict(zip(("name", "N", "K"), s))
                                                     for s in LINEAR_SHAPES],
                   "weight_blocks": [128, 128], "dtype": "bfloat16",
                   "auto_cublas_min_tokens": fp8_cublas.AUTO_CUBLAS_MIN_TOKENS,
                   "scaled_mm_api": ("F.scaled_mm" if fp8_cublas.has_scaled_mm_v2()
                                     else "torch._scaled_mm"),
                   "timer": f"time_in_graph: {CALLS} calls in one CUDA graph, median of "
                            f"{REPLAYS} replays"},
        "cublas_supported": ok, "cublas_reason": why, "linear": [], "quantize": []}
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, n, k in LINEAR_SHAPES:
        result["linear"] += bench_shape(name, n, k, args.tokens, ok, gen)
    result["quantize"] = bench_quantize()
    result["suggested_auto_cublas_min_tokens"] = suggest_min_tokens(result["linear"],
                                                                    args.tokens)
    result["seconds"] = round(time.perf_counter() - t0, 1)
    with open(os.path.join(args.out, "fp8_linear_backends.json"), "w") as f:
        json.dump(result, f, indent=1)
    print_table(result["linear"])
    for r in result["quantize"]:
        print(json.dumps(r))
    print(f"suggested AUTO_CUBLAS_MIN_TOKENS: {result['suggested_auto_cublas_min_tokens']}; "
          f"{result['seconds']} s")


if __name__ == "__main__":
    main()
