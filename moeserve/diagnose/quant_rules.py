"""The doctor's rule on quantized weights (doctor.py's RULES holds it):

    w4a16_linears   (CUDA engines) projections outside the routed experts held in NVFP4 or
                    INT4 (the capacity report's weights_by_class) without --dequantize-linears:
                    every such GEMM dequantizes its weight in its loads at bf16's FLOPs (no
                    FP4 / INT4 tensor cores are used), which on an H100 took 1.0-3x bf16's time
                    at 64-1,024 tokens (benchmarks/results/gpu_6b1031a/call3), while the
                    weights it saves are small beside the routed experts'; info, with the GiB
                    the bf16 copies would add
                    settings: dequantize_linears True

Measured: W1 on qwen3-30b-a3b at 256 on an H100, NVFP4 10,830 output tok/s with every
projection packed against 12,179 with --dequantize-linears (+12.5%; +10.4% at 1,024), the
attention's 0.48 GiB becoming 1.69 (benchmarks/results/gpu_cc68d51/call2).
"""

from __future__ import annotations

from typing import Any

from moeserve.diagnose import figures
from moeserve.diagnose.bounds.roofline import QUANT_BYTES
from moeserve.diagnose.verdict import Verdict

W4A16 = ("nvfp4", "int4")
ROUTED = "routed experts"  # capacity._module_class's name for the routed experts


def w4a16_linears(run: dict[str, Any]) -> Verdict | None:
    if figures.device_kind(run) != "cuda":
        return None
    cfg = figures.engine_config(run)
    text = figures.capacity_report(run).get("weights_by_class")
    if cfg.get("dequantize_linears") or not isinstance(text, str):
        return None
    try:
        classes = parse_weights_by_class(text)
    except ValueError:  # not this engine's report: the rule has no figures
        return None
    packed = [(cls, fmt, gib) for cls, fmt, gib in classes if cls != ROUTED and fmt in W4A16]
    if not packed:
        return None
    extra = sum(gib * (2 / QUANT_BYTES[fmt] - 1) for _, fmt, gib in packed)
    names = ", ".join(f"{cls} ({fmt}, {gib:.2f} GiB)" for cls, fmt, gib in packed)
    ev = {"packed_linears": [{"class": c, "format": f, "gib": round(g, 3)} for c, f, g in packed],
          "extra_gib_in_bf16": round(extra, 2), "quantization": cfg.get("quantization")}
    return Verdict("w4a16_linears", "info",
                   f"projections outside the routed experts run weight-only 4-bit GEMMs: "
                   f"{names}; on an H100 those took 1.0-3x bf16's time, and W1 on "
                   f"qwen3-30b-a3b at 256 ran 12.5% faster with them in bf16",
                   f"--dequantize-linears (the routed experts stay packed; about "
                   f"{extra:.2f} GiB more weights, taken from the KV cache)", ev,
                   {"dequantize_linears": True})


def parse_weights_by_class(text: str) -> list[tuple[str, str, float]]:
    """runner/capacity.py weights_by_class's text back as (class, format, GiB), in its order
    (parsed here: the doctor imports no torch); ValueError naming an entry that is not
    "<class> <format> <size> GiB|MiB"."""
    out = []
    for entry in filter(None, (e.strip() for e in text.split(", "))):
        parts = entry.rsplit(" ", 3)
        if len(parts) != 4 or parts[3] not in ("GiB", "MiB"):
            raise ValueError(f"weights_by_class: {entry!r} is not '<class> <format> <size> "
                             "GiB|MiB'")
        cls, fmt, size, unit = parts
        try:
            gib = float(size) / (1 if unit == "GiB" else 1024)
        except ValueError:
            raise ValueError(f"weights_by_class: {entry!r} has no size") from None
        out.append((cls, fmt, gib))
    return out
