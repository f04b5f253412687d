"""The weights benchmarks/quant/kernels_quant.py times (and moe_quant_once.py profiles): each
format drawn as the server's dummy weights are, with two layout switches of the 4-bit experts
(quant_switches.py: --scale-layout, --weight-layout), their bytes, and the references an op's
output is checked against."""

from __future__ import annotations

import contextlib

import torch

INT4_GROUP = 32  # the server's dummy INT4 group (quant/plan.py DUMMY_INT4_GROUP)
# The 4-bit weights' group scales in memory (a switch, --scale-layout): "rows" as loaded, each
# weight row's scales contiguous (a K step reads BK / G bytes a row: 8 at BK 128), or
# "k-major", each group column's N scales contiguous (the same [.., N, K / G] view, other
# strides: the kernel reads either; a step then reads BK / G runs of BLOCK_N).
scale_layout = "rows"
# The 4-bit experts' packed weights (a switch, --weight-layout): "rows" as loaded, or "micro"
# (kernels/moe/quant/micro_tiles.py: 16 rows x 64 bytes contiguous; where the shape allows it)
packed_layout = "rows"


def bytes_a_weight(fmt: str) -> float:
    from moeserve.diagnose.bounds.roofline import QUANT_BYTES

    return 2.0 if fmt == "bf16" else QUANT_BYTES[fmt]


def make_weight(fmt: str, shape: tuple[int, ...], dtype: torch.dtype, device: str,
                gen: torch.Generator):
    """A [..., N, K] weight as the server's dummy weights: dtype floats for bf16, else a
    QuantWeight drawn and quantized by runner/weights/loader.py's `_dummy_quantized` (FP8
    scales folded)."""
    from moeserve.quant.packed import QuantWeight, compact_fp8_scales
    from moeserve.runner.weights.loader import _dummy_quantized

    std = shape[-1] ** -0.5
    if fmt == "bf16":
        return torch.randn(shape, device=device, generator=gen, dtype=dtype) * std
    w = QuantWeight(fmt, *shape, scale_dtype=dtype, device=device, int4_group=INT4_GROUP)
    _dummy_quantized(w, std, gen)
    compact_fp8_scales(w)
    if scale_layout == "k-major" and fmt in ("nvfp4", "int4"):
        w.scale.data = w.scale.data.mT.contiguous().mT  # same [.., N, K / G] view, N fastest
    if packed_layout == "micro" and fmt in ("nvfp4", "int4") and len(shape) == 3:
        from moeserve.kernels.moe.quant.micro_tiles import to_micro

        try:
            w.qweight.data = to_micro(w.qweight.data)
            w.micro_tiled = True
        except ValueError:  # a shape micro-tiles do not divide: the row layout, said in the row
            pass
    return w


@contextlib.contextmanager
def row_layout(*weights):
    """Micro-tiled weights in the row layout for the duration (the references read only it)."""
    from moeserve.kernels.moe.quant.micro_tiles import from_micro, is_micro, to_micro

    tiled = [w for w in weights if is_micro(w)]
    for w in tiled:
        w.qweight.data, w.micro_tiled = from_micro(w.qweight.data), False
    try:
        yield
    finally:
        for w in tiled:
            w.qweight.data, w.micro_tiled = to_micro(w.qweight.data), True


def held_bytes(w) -> int:
    return w.numel() * w.element_size() if isinstance(w, torch.Tensor) else w.bytes()


def check_output(out: torch.Tensor, ref: torch.Tensor | None) -> dict:
    """finite, and max |out - ref| / max |ref| when a reference is given."""
    row: dict = {"finite": bool(torch.isfinite(out).all())}
    if ref is not None:
        row["rel_err"] = float((out.float() - ref.float()).abs().max()
                               / ref.float().abs().max().clamp_min(1e-30))
    return row


def moe_ref(fmt: str, x: torch.Tensor, w13, w2, weights: torch.Tensor,
            ids: torch.Tensor) -> torch.Tensor:
    from moeserve.kernels.moe.quant.ref import moe_quant_ref
    from moeserve.kernels.moe.ref import moe_loop_ref

    if fmt == "bf16":
        return moe_loop_ref(x, w13, w2, weights, ids)
    return moe_quant_ref(x, w13, w2, weights, ids)


def linear_ref(fmt: str, x: torch.Tensor, w) -> torch.Tensor:
    """fp32: x (fp8: its run-time quantization, dequantized) @ the dequantized weight.T."""
    from moeserve.kernels.moe.quant.ref import fp8_dequant_activations

    if fmt == "bf16":
        return x.float() @ w.float().T
    rows = fp8_dequant_activations(x) if fmt == "fp8" else x.float()
    return rows @ w.dequantize(torch.float32).T
