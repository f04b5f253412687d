"""The linear projections, in the engine's dtype or quantized: how a layer declares one
(`WeightFactory.linear`) and runs it (`linear`).

    WeightFactory(plan, prefix)  the model's QuantPlan seen from one module: `linear(name, N, K)`
                                 is an nn.Parameter [N, K] (the engine's dtype), or a
                                 quant.packed.QuantWeight when the plan holds prefix + name
                                 quantized; `child(name)` scopes it to a submodule
    linear(x, w, bias)           x [..., K] -> [..., N]: F.linear, or the format's kernel:
        fp8    W8A8: x quantized per token and 128-group at run time; on CUDA
               kernels/linear/fp8_cublas.py's `fp8_linear` (cuBLASLt's blockwise scaled_mm
               where the device and shape allow, else the Triton block GEMM of
               fp8_block_triton.py), elsewhere its torch reference
        nvfp4, int4  W4A16: on CUDA kernels/linear/w4a16_dequant.py's `w4a16_linear` (the
               Triton GEMM that dequantizes in its loads, w4a16_triton.py, for few tokens; from
               AUTO_DEQUANT_MIN_TOKENS the weight dequantized once, then cuBLAS), elsewhere the
               dequantized weight's matmul in fp32 (the reference)

Leading dims before [N, K] (the experts of a MoE block) go to `linear_stack`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moeserve.layers.params import empty_param
from moeserve.model_config import ConfigError
from moeserve.quant import fp8_block
from moeserve.quant.packed import QuantWeight
from moeserve.quant.plan import QuantPlan

Weight = nn.Parameter | QuantWeight


class WeightFactory:
    """Declares a module's weights under the model's quantization plan (module doc)."""

    def __init__(self, plan: QuantPlan | None = None, prefix: str = "") -> None:
        self.plan = plan
        self.prefix = prefix

    def child(self, name: str) -> WeightFactory:
        return WeightFactory(self.plan, f"{self.prefix}{name}.")

    def linear(self, name: str, *shape: int, dtype: torch.dtype | None,
               device: torch.device | str | None) -> Weight:
        """A projection weight [..., N, K] named `name` in its module."""
        if self.plan is not None and self.plan.holds(self.prefix + name, len(shape) > 2):
            try:
                return QuantWeight(self.plan.format, *shape, scale_dtype=dtype or torch.float32,
                                   device=device, int4_group=self.plan.int4_group)
            except ValueError as e:
                raise ConfigError(f"{self.prefix}{name} {list(shape)}: {e}") from None
        return empty_param(*shape, dtype=dtype, device=device)


def linear(x: torch.Tensor, w: Weight | torch.Tensor,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] through w [N, K] -> [..., N] in x's dtype (module doc)."""
    if not isinstance(w, QuantWeight):
        return F.linear(x, w, bias)
    if x.shape[-1] != w.shape[-1]:
        raise ValueError(f"input has {x.shape[-1]} features, the {w.format} weight "
                         f"{w.shape[-1]}")
    if x.is_cuda:
        return _linear_cuda(x, w, bias)
    rows = x.reshape(-1, x.shape[-1])
    if w.format == "fp8":
        x_q, x_scale = fp8_block.quantize_activations(rows)
        a = x_q.float() * x_scale.repeat_interleave(fp8_block.BLOCK[1], 1)[:, :rows.shape[1]]
    else:
        a = rows.float()
    out = a @ w.dequantize(torch.float32).t()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*x.shape[:-1], w.shape[0])


def _linear_cuda(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None) -> torch.Tensor:
    if w.format == "fp8":
        from moeserve.kernels.linear.fp8_cublas import fp8_linear

        return fp8_linear(x, w.qweight, w.scale, bias, scale_rows=w.scale_rows)
    from moeserve.kernels.linear.w4a16_dequant import w4a16_linear

    return w4a16_linear(x, w.format, w.qweight, w.scale, w.global_scale, w.group, w.shape[-1],
                        bias)
