"""The input checks of `quant.fused_triton.moe_quant_triton`: shapes, dtypes, devices and
strides of the tokens, the routing and the two quantized weights, each failure a ValueError
naming the tensor, with no device sync (the op stays graph-capturable)."""

from __future__ import annotations

import math
from typing import Any

import torch

from moeserve.kernels.moe.quant.ref import weight_layout
from moeserve.kernels.triton_common import require_triton_device
from moeserve.quant.fp8_block import E4M3
from moeserve.quant.packed import FP8_GROUP, packed_columns

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_QWEIGHT_DTYPES = {"fp8": E4M3, "nvfp4": torch.uint8, "int4": torch.int32}


def check_inputs(x: torch.Tensor, w13: Any, w2: Any, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> tuple[str, tuple[int, int], tuple[int, int]]:
    """Shapes, dtypes, devices and strides, with a ValueError naming the tensor (no sync).
    Returns the format and each weight's (group, scale_rows)."""
    if x.dim() != 2 or x.dtype not in _DTYPES or x.stride(-1) != 1:
        raise ValueError(f"x must be [T, H] of {_DTYPES} with a contiguous last dim, got "
                         f"{x.dtype} {tuple(x.shape)} strides {x.stride()}")
    require_triton_device(x.device, "moe_quant_triton")
    if x.device.type == "cpu" and x.dtype == torch.bfloat16:
        raise ValueError("moe_quant_triton: x in bf16 needs CUDA (Triton's interpreter loads "
                         "bf16 wrongly); use fp32 / fp16 on CPU")
    fmt = weight_layout("w13", w13)[0]
    if len(w13.shape) != 3 or w13.shape[1] % 2 or w13.shape[2] != x.shape[1]:
        raise ValueError(f"w13: logical shape must be [E, 2I, H] with H = {x.shape[1]} (x's), "
                         f"got {list(w13.shape)}")
    num_experts, two_inter, hidden = w13.shape
    layout13 = check_weight("w13", w13, fmt, (num_experts, two_inter, hidden), x.device)
    layout2 = check_weight("w2", w2, fmt, (num_experts, hidden, two_inter // 2), x.device)
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"topk_ids must be [T, k] with T = {x.shape[0]}, got "
                         f"{tuple(topk_ids.shape)}")
    if topk_ids.dtype.is_floating_point or topk_ids.dtype == torch.bool:
        raise ValueError(f"topk_ids must be integer, got {topk_ids.dtype}")
    if (topk_weights.shape != topk_ids.shape or topk_weights.dtype != torch.float32
            or not topk_weights.is_contiguous()):
        raise ValueError(f"topk_weights must be contiguous float32 {tuple(topk_ids.shape)}, got "
                         f"{topk_weights.dtype} {tuple(topk_weights.shape)}")
    for name, t in (("topk_weights", topk_weights), ("topk_ids", topk_ids)):
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x on {x.device}")
    return fmt, layout13, layout2


def check_weight(name: str, w: Any, fmt: str, shape: tuple[int, int, int],
                  device: torch.device) -> tuple[int, int]:
    """One quantized weight of logical `shape` [E, N, K] in format `fmt`, as quant/packed.py
    lays it out; returns its (group, scale_rows)."""
    wfmt, group, scale_rows = weight_layout(name, w)
    if wfmt != fmt:
        raise ValueError(f"{name}: format {wfmt!r}, w13's is {fmt!r}: one format for both")
    if tuple(w.shape) != shape:
        raise ValueError(f"{name}: logical shape must be {list(shape)}, got {list(w.shape)}")
    num_experts, n, k = shape
    want = _QWEIGHT_DTYPES[fmt]
    if w.qweight.dtype != want:
        raise ValueError(f"{name}.qweight must be {want} for {fmt}, got {w.qweight.dtype}")
    if tuple(w.qweight.shape) != (num_experts, n, packed_columns(fmt, k)):
        raise ValueError(f"{name}.qweight must be {[num_experts, n, packed_columns(fmt, k)]} for "
                         f"{fmt} {list(shape)}, got {list(w.qweight.shape)}")
    if fmt == "fp8" and (group != FP8_GROUP or scale_rows < 1):
        raise ValueError(f"{name}: fp8 needs group {FP8_GROUP} and scale_rows >= 1, got {group} "
                         f"and {scale_rows}")
    if fmt != "fp8" and (scale_rows != 1 or group < 8 or group & (group - 1)):
        raise ValueError(f"{name}: {fmt} needs scale_rows 1 and a power-of-two group >= 8, got "
                         f"{scale_rows} and {group}")
    want_s = (num_experts, math.ceil(n / scale_rows), math.ceil(k / group))
    if tuple(w.scale.shape) != want_s:
        raise ValueError(f"{name}.scale must be {list(want_s)}, got {list(w.scale.shape)}")
    s_ok = {"fp8": w.scale.dtype == torch.float32, "nvfp4": w.scale.dtype == E4M3,
            "int4": w.scale.dtype in _DTYPES}[fmt]
    if not s_ok or (device.type == "cpu" and w.scale.dtype == torch.bfloat16):
        raise ValueError(f"{name}.scale: {w.scale.dtype} is not {fmt}'s scale dtype (fp8 "
                         "float32, nvfp4 float8_e4m3fn, int4 fp32 / fp16 / bf16, bf16 on CUDA)")
    tensors = [("qweight", w.qweight), ("scale", w.scale)]
    if fmt == "nvfp4":
        gs = w.global_scale
        if gs is None or gs.dtype != torch.float32 or tuple(gs.shape) != (num_experts, n):
            raise ValueError(f"{name}.global_scale must be float32 [{num_experts}, {n}], got "
                             f"{None if gs is None else (gs.dtype, list(gs.shape))}")
        tensors.append(("global_scale", gs))
    for part, t in tensors:
        if t.device != device:
            raise ValueError(f"{name}.{part} is on {t.device}, x on {device}")
    return group, scale_rows
