"""MoE experts over quantized expert weights, torch reference: the contract the Triton kernel
(`quant.fused_triton.moe_quant_triton`) is tested against.

Owns `moe_quant_ref` and the small helpers both modules share to read a quantized weight
(`weight_layout`: format, group and scale_rows of a `quant.packed.QuantWeight` or `QuantView`).
The weights are laid out as quant/packed.py says (rows along N); w13 [E, 2I, H] (gate rows, then
up rows) and w2 [E, H, I] are their logical shapes. Per expert e and its pairs (token t, slot i):

    nvfp4 / int4 (W4A16, x stays in its dtype):
        w13_e, w2_e = packed.dequantize(...) cast to x's dtype
        gate_up = x[t] @ w13_e.T                          fp32 products
        act = (silu(gate) * up) rounded to x's dtype      [n_e, I]
        part[t, i] = w[t, i] * (act @ w2_e.T)             fp32, then x's dtype
    fp8 (W8A8, activations quantized at run time, per row and 128-group of K):
        x_q, s_x = quantize_activations(x)                per token: the same rows for every
                                                          expert the token goes to
        gate_up = dequant(x_q, s_x)[t] @ dequant(w13_e).T  fp32 (e4m3 values times both scales)
        act = (silu(gate) * up) rounded to x's dtype, then quantized per pair row the same way
        part[t, i] = w[t, i] * (dequant(act_q, s_act) @ dequant(w2_e).T)

An id of -1 (the expert is on another rank) gives a zero part. The result is the sum of the
k parts in x's dtype (reduce=False returns the parts [T, k, H]), as `moe_triton` adds them.
The loop reads the routed experts on the host (a sync): a reference, not a serving path.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from moeserve.kernels.moe.quant.micro_tiles import is_micro
from moeserve.quant import nvfp4
from moeserve.quant.fp8_block import quantize_activations
from moeserve.quant.packed import FP8_GROUP, dequantize

FORMATS = ("fp8", "nvfp4", "int4")


def weight_layout(name: str, w: Any) -> tuple[str, int, int]:
    """(format, group, scale_rows) of a quantized weight (a QuantWeight or a QuantView).

    A QuantView carries neither group nor scale_rows: scale_rows is then 1 and the group is
    the format's (fp8 128, nvfp4 16) or, for int4, the one group that gives the scale's
    column count (ValueError naming `name` when no single group does).
    """
    fmt = getattr(w, "format", None)
    if fmt not in FORMATS:
        raise ValueError(f"{name}: format must be one of {FORMATS}, got {fmt!r}")
    scale_rows = getattr(w, "scale_rows", 1)
    group = getattr(w, "group", None)
    if group is None:
        group = _infer_group(name, fmt, w.shape[-1], w.scale.shape[-1])
    return fmt, int(group), int(scale_rows)


def _infer_group(name: str, fmt: str, k: int, columns: int) -> int:
    if fmt == "fp8":
        return FP8_GROUP
    if fmt == "nvfp4":
        return nvfp4.GROUP
    fits = [g for g in (1 << p for p in range(3, 13)) if math.ceil(k / g) == columns]
    if len(fits) != 1:
        raise ValueError(f"{name}: cannot tell the INT4 group from K {k} and {columns} scale "
                         f"columns (candidates {fits}): pass a QuantWeight, which knows it")
    return fits[0]


def dequantize_expert(w: Any, expert: int, dtype: torch.dtype) -> torch.Tensor:
    """Expert `expert` of a quantized [E, N, K] weight, dequantized: [N, K] in `dtype`."""
    fmt, group, scale_rows = weight_layout("weight", w)
    gs = None if w.global_scale is None else w.global_scale[expert]
    return dequantize(fmt, w.qweight[expert], w.scale[expert], gs, group, w.shape[-1], dtype,
                      scale_rows)


def fp8_dequant_activations(x: torch.Tensor) -> torch.Tensor:
    """x [R, K] -> its run-time FP8 quantization, dequantized: e4m3 values times their
    per-(row, 128-group) scales, fp32 [R, K]."""
    q, s = quantize_activations(x, FP8_GROUP)
    return q.float() * s.repeat_interleave(FP8_GROUP, 1)[:, :x.shape[1]]


def moe_quant_ref(x: torch.Tensor, w13: Any, w2: Any, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, reduce: bool = True) -> torch.Tensor:
    """Routed experts over quantized weights, per expert (the module docstring's arithmetic).

    Args:
        x: [T, H] fp32 / fp16 / bf16.
        w13: quantized, logical [E, 2I, H] (gate rows, then up rows).
        w2: quantized, logical [E, H, I], the same format.
        topk_weights: [T, k] float32.
        topk_ids: [T, k] integer expert ids in [0, E), or -1: not on this rank (a zero part).
        reduce: False returns the k parts [T, k, H] instead of their sum.
    Returns:
        [T, H] in x's dtype ([T, k, H] with reduce False).
    """
    fmt, _, _ = weight_layout("w13", w13)
    if weight_layout("w2", w2)[0] != fmt:
        raise ValueError(f"w13 is {fmt}, w2 is {w2.format}: one format for both")
    for name, w in (("w13", w13), ("w2", w2)):
        if is_micro(w):
            raise ValueError(f"{name} is micro-tiled (kernels/moe/quant/micro_tiles.py): the "
                             "reference reads the row layout (from_micro gives it)")
    inter = w2.shape[-1]
    num_tokens, top_k = topk_ids.shape
    parts = torch.zeros(num_tokens, top_k, x.shape[1], dtype=x.dtype, device=x.device)
    w8a8 = fmt == "fp8"
    w_dtype = torch.float32 if w8a8 else x.dtype  # fp8: the e4m3 values times scales, in fp32
    x_rows = fp8_dequant_activations(x) if w8a8 else x.float()  # [T, H] fp32
    for e in torch.unique(topk_ids).tolist():
        if e < 0:  # -1: the pair's expert is on another rank
            continue
        token_idx, slot = torch.where(topk_ids == e)  # [n_e] each
        gate_up = x_rows[token_idx] @ dequantize_expert(w13, e, w_dtype).float().T  # [n_e, 2I]
        act = (F.silu(gate_up[:, :inter]) * gate_up[:, inter:]).to(x.dtype)  # [n_e, I]
        act_rows = fp8_dequant_activations(act) if w8a8 else act.float()
        y = act_rows @ dequantize_expert(w2, e, w_dtype).float().T  # [n_e, H]
        parts[token_idx, slot] = (y * topk_weights[token_idx, slot, None]).to(x.dtype)
    return parts.sum(dim=1) if reduce else parts

