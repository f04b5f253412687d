"""kernels_quant's linear section and dense peaks: the attention projections' GEMMs in each
format (F.linear for bf16, the engine's `fp8_linear` and `w4a16_linear`) beside their bounds,
and torch's dense bf16 / FP8 matmul rates at a cube size (kernels_quant.py's docstring says
what each figure is against)."""

from __future__ import annotations

import json
from collections.abc import Callable

import torch
import torch.nn.functional as F

from benchmarks.quant.quant_weights import (
    bytes_a_weight,
    check_output,
    held_bytes,
    linear_ref,
    make_weight,
)

LINEAR_SHAPES = (("qwen3_qkv", 5120, 2048), ("qwen3_o_proj", 2048, 4096),
                 ("glm5_q_b", 16384, 2048), ("glm5_o_proj", 6144, 16384))  # (name, N, K)
SMALL_LINEAR = (("small_qkv", 320, 256), ("small_o", 256, 384))


def linear_op(fmt: str, x: torch.Tensor, w) -> Callable[[], torch.Tensor]:
    from moeserve.kernels.linear.fp8_cublas import fp8_linear
    from moeserve.kernels.linear.w4a16_dequant import w4a16_linear

    if fmt == "bf16":
        return lambda: F.linear(x, w)
    if fmt == "fp8":  # the engine's choice of backend (fp8_cublas.fp8_linear, "auto")
        return lambda: fp8_linear(x, w.qweight, w.scale, scale_rows=w.scale_rows)
    return lambda: w4a16_linear(x, w.format, w.qweight, w.scale, w.global_scale, w.group,
                                w.shape[-1])


def bench_linear(shapes: tuple, tokens: list[int], ctx: dict) -> list[dict]:
    device, dtype, timer = ctx["device"], ctx["dtype"], ctx["timer"]
    gen = torch.Generator(device=device).manual_seed(1)
    rows = []
    for name, n, k in shapes:
        for fmt in ctx["formats"]:
            w = make_weight(fmt, (n, k), dtype, device, gen)
            per_weight = bytes_a_weight(fmt)
            for num_tokens in tokens:
                x = torch.randn(num_tokens, k, device=device, generator=gen).to(dtype)
                fn = linear_op(fmt, x, w)
                ref = linear_ref(fmt, x, w) if num_tokens == min(tokens) else None
                row = {"shape": name, "N": n, "K": k, "format": fmt, "tokens": num_tokens,
                       **check_output(fn(), ref)}
                ms = timer(fn)
                read_ms = n * k * per_weight / (ctx["copy_tbps"] * 1e12) * 1e3
                io_ms = read_ms + num_tokens * (n + k) * 2 / (ctx["copy_tbps"] * 1e12) * 1e3
                flop_ms = 2 * num_tokens * n * k / (ctx["dense_tflops"] * 1e12) * 1e3
                bound_ms = max(io_ms, flop_ms)
                row.update({"ms": round(ms, 4), "bytes_per_weight": round(per_weight, 6),
                            "held_bytes_per_weight": round(held_bytes(w) / (n * k), 6),
                            "read_bound_ms": round(read_ms, 4),
                            "pct_of_read_bound": round(100 * read_ms / ms, 1),
                            "bound_ms": round(bound_ms, 4),
                            "bound": "memory" if io_ms >= flop_ms else "compute",
                            "pct_of_bound": round(100 * bound_ms / ms, 1),
                            "tflops": round(2 * num_tokens * n * k / (ms * 1e-3) / 1e12, 1)})
                rows.append(row)
                print(json.dumps(row), flush=True)
            del w
    return rows


def dense_peaks(size: int, ctx: dict) -> dict:
    """bf16 torch.mm and FP8 torch._scaled_mm (e4m3, per-tensor scales, bf16 out; fp32 and
    fast accumulation) at size^3: TFLOP/s each; `fp8_peak_tflops` the faster FP8."""
    from moeserve.quant.fp8_block import E4M3

    device, timer = ctx["device"], ctx["timer"]
    gen = torch.Generator(device=device).manual_seed(2)
    a = torch.randn(size, size, device=device, generator=gen)
    b = torch.randn(size, size, device=device, generator=gen)  # [N, K]
    a16, b16 = a.to(torch.bfloat16), b.to(torch.bfloat16)
    a8, b8 = a.to(E4M3), b.to(E4M3)
    one = torch.ones((), device=device)
    flop = 2 * size ** 3
    out: dict = {"size": size}
    fns = {"bf16_mm": lambda: a16 @ b16.T,
           "fp8_scaled_mm": lambda: torch._scaled_mm(a8, b8.T, one, one,
                                                     out_dtype=torch.bfloat16),
           "fp8_scaled_mm_fast_accum": lambda: torch._scaled_mm(
               a8, b8.T, one, one, out_dtype=torch.bfloat16, use_fast_accum=True)}
    for name, fn in fns.items():
        try:
            finite = bool(torch.isfinite(fn()).all())
            ms = timer(fn)
        except (RuntimeError, NotImplementedError) as exc:  # fast accum: CUDA only
            out[name] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
            continue
        out[name] = {"ms": round(ms, 4), "tflops": round(flop / (ms * 1e-3) / 1e12, 1),
                     "finite": finite}
    fp8 = [out[n]["tflops"] for n in fns if n.startswith("fp8") and "tflops" in out[n]]
    out["fp8_peak_tflops"] = max(fp8) if fp8 else None
    print(json.dumps(out), flush=True)
    return out
