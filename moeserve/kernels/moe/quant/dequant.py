"""The 4-bit routed experts for large steps: every expert dequantized once into x's dtype, then
the bf16 fused MoE (kernels/moe/fused_triton.py's `moe_triton`, with its own tuned tiles).

Why: the W4A16 fused MoE (quant/fused_triton.py) decodes an expert's weights again for every
BLOCK_M rows routed to it, so at a prefill-sized step it falls behind the bf16 kernel it was to
beat: on the H200 at qwen3-30b-a3b's experts, 2.78 ms at 8,192 tokens against bf16's 1.39 ms
(benchmarks/results/gpu_04e1157, gpu_ae4c492). Dequantizing the whole stack costs a write and a
read of it in x's dtype, about 1.2 GB there (~0.4 ms), after which the bf16 kernel runs at its
own rate. Below `DEQUANT_MIN_TOKENS` (decode, small prefills) the fused kernel reads each
weight's 0.5625 bytes once and wins; above `DEQUANT_MAX_BYTES` of transient bf16 weights (a
whole GLM-5 layer's experts would be 19 GiB) the fused kernel runs whatever the step.

    choose_moe_dequant(fmt, num_tokens, experts_bytes, device)  -> bool (module switch `mode`)
    moe_dequant(x, w13, w2, topk_weights, topk_ids, ...)        the op: MoeFn's contract

NVFP4's global scale (per expert and row) is multiplied into the weight in fp32 before its one
rounding to x's dtype: unlike the fused kernel's tile (exact, the global scale in the fp32
epilogue), a weight here carries one bf16 rounding, as a bf16 checkpoint's does. INT4's tile is
the fused kernel's, bit for bit.
"""

from __future__ import annotations

import torch

from moeserve.kernels.linear.w4a16_dequant import dequant_unfit, dequantize_w4a16
from moeserve.kernels.moe.quant.micro_tiles import micro_arg
from moeserve.quant.packed import QuantWeight

MODES = ("auto", "on", "off")
# "auto" dequantizes from this many tokens a step, by format: where the two lines cross
# (kernels_quant --moe-dequant off on, qwen3-30b-a3b's experts on an H100, gpu_6b1031a/call3):
# NVFP4 fused 0.457 / 2.31 ms at 1,024 / 8,192 tokens against dequantized 1.19 / 2.01 (crossing
# near 6,000); INT4 0.635 / 3.20 against 1.17 / 2.00 (near 3,200). GLM-5's experts stay fused
# (DEQUANT_MAX_BYTES).
DEQUANT_MIN_TOKENS = {"nvfp4": 6144, "int4": 3072}
DEQUANT_MAX_BYTES = 2 << 30  # the transient bf16 experts of one layer, at most
# "auto" (above), "on" (wherever the format and size allow), "off"; benchmarks set it
mode = "auto"


def dequant_bytes(w13: QuantWeight, w2: QuantWeight, dtype: torch.dtype) -> int:
    """Bytes of the two stacks dequantized into dtype."""
    size = torch.empty((), dtype=dtype).element_size()
    return (w13.shape.numel() + w2.shape.numel()) * size


def choose_moe_dequant(w13: QuantWeight, w2: QuantWeight, num_tokens: int,
                       x: torch.Tensor) -> bool:
    """Whether this call runs `moe_dequant` (module doc): a 4-bit format the dequant kernel
    takes, x on CUDA (the fused MoE takes fp32, fp16 and bf16), at most DEQUANT_MAX_BYTES,
    and, with mode "auto", at least the format's DEQUANT_MIN_TOKENS tokens."""
    if mode not in MODES:
        raise ValueError(f"moe dequant mode must be one of {MODES}, got {mode!r}")
    if mode == "off" or w13.format not in ("nvfp4", "int4") or not x.is_cuda:
        return False
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16) or dequant_unfit(w13.group):
        return False
    if dequant_bytes(w13, w2, x.dtype) > DEQUANT_MAX_BYTES:
        return False
    return mode == "on" or num_tokens >= DEQUANT_MIN_TOKENS[w13.format]


def moe_dequant(x: torch.Tensor, w13: QuantWeight, w2: QuantWeight,
                topk_weights: torch.Tensor, topk_ids: torch.Tensor, reduce: bool = True,
                tiles: str = "tuned", routed_experts: int | None = None) -> torch.Tensor:
    """The routed experts with every expert dequantized into x's dtype first, then
    `moe_triton` (its tiles from `tiles`, at `routed_experts`' density under EP); the MoeFn
    contract (ids -1 add nothing; reduce False: [T, S, hidden] parts)."""
    from moeserve.kernels.moe.fused_triton import moe_triton

    w13_x = _dequantized(w13, x.dtype)  # [E, 2I, H]
    w2_x = _dequantized(w2, x.dtype)  # [E, H, I]
    return moe_triton(x, w13_x, w2_x, topk_weights, topk_ids, tiles=tiles, reduce=reduce,
                      routed_experts=routed_experts)


def _dequantized(w: QuantWeight, dtype: torch.dtype) -> torch.Tensor:
    """The stack in `dtype` (micro-tiled packed weights read as such: micro_tiles.py)."""
    return dequantize_w4a16(w.format, w.qweight, w.scale, w.group, w.shape[-1], dtype,
                            w.global_scale, micro_arg(w.format, w, w.qweight))
