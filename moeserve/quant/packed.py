"""A weight kept quantized in memory: the layout the layers hold and the kernels read.

One layout per format for a logical weight [..., N, K] (leading dims: the experts of a MoE
block), every tensor laid out row by row along N, so that a slice of rows (a fused part, a
tensor-parallel shard, one expert) is the same slice of each tensor, whatever the checkpoint's
blocks:

    fp8    qweight  float8_e4m3fn [..., N, K]
           scale    fp32 [..., ceil(N / scale_rows), ceil(K / 128)]
                    W = q * scale[n // scale_rows, k // 128]
                    (scale_rows 1 while loading; `compact_fp8_scales` folds it to 128, the
                    checkpoint's blocks, when every 128 rows share their scales)
    nvfp4  qweight  uint8 [..., N, K / 2], element 2j in the low nibble (ModelOpt's)
           scale    float8_e4m3fn [..., N, K / 16]
           global_scale fp32 [..., N]: the checkpoint's weight_scale_2 of the tensor each row
                    came from (gate and up, q / k / v differ)   W = e2m1 * (scale * global_scale[n])
    int4   qweight  int32 [..., N, ceil(K / 8)], element k at bits 4 (k % 8) of word k // 8,
                    stored as q + 8 (compressed-tensors' pack-quantized)
           scale    the engine's dtype [..., N, ceil(K / group)]
                    W = (nibble - 8) * scale[n, k // group]

`group` is K per scale column (128 / 16 / the checkpoint's group, 32 for Kimi K2). The
activations: FP8 quantizes them per token and 128-group at run time (W8A8); NVFP4 and INT4 keep
them in the engine's dtype (W4A16: Hopper has no FP4 tensor cores).

`QuantWeight` is the nn.Module a layer holds in place of a weight parameter. Its `shape` is the
logical one; `qweight[...]` indexing the rows and `QuantWeight.rows(index)` give a `QuantView`
of the same rows of every tensor, which the weight loader copies a checkpoint's tensors into.
`dequantize` is the reference every kernel is tested against.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from moeserve.quant import int4_pack, nvfp4
from moeserve.quant.fp8_block import E4M3, quantize_blockwise

FP8_GROUP = 128


def group_size(fmt: str, int4_group: int | None = None) -> int:
    """K per scale column of `fmt`."""
    if fmt == "fp8":
        return FP8_GROUP
    if fmt == "nvfp4":
        return nvfp4.GROUP
    if fmt == "int4":
        if not int4_group or int4_group % int4_pack.PER_WORD:
            raise ValueError(f"an INT4 group must be a positive multiple of "
                             f"{int4_pack.PER_WORD}, got {int4_group}")
        return int4_group
    raise ValueError(f"unknown quantized format {fmt!r}")


def packed_columns(fmt: str, k: int) -> int:
    """qweight's last dim for K logical columns."""
    if fmt == "fp8":
        return k
    if fmt == "nvfp4":
        return k // 2
    return math.ceil(k / int4_pack.PER_WORD)


@dataclass
class QuantView:
    """The same rows of a QuantWeight's tensors (views: copying into them fills the weight)."""

    format: str
    qweight: torch.Tensor
    scale: torch.Tensor
    global_scale: torch.Tensor | None
    shape: tuple[int, ...]  # logical
    group: int  # K per scale column


class QuantWeight(nn.Module):
    """A quantized weight of logical shape [..., N, K] (module docstring)."""

    def __init__(self, fmt: str, *shape: int, scale_dtype: torch.dtype,
                 device: torch.device | str | None, int4_group: int | None = None) -> None:
        super().__init__()
        *lead, n, k = shape
        self.format = fmt
        self.group = group_size(fmt, int4_group)
        self.scale_rows = 1
        self.micro_tiled = False  # packed columns in micro-tiles (kernels/moe/quant/micro_tiles)
        self.logical_shape = tuple(shape)
        if fmt == "nvfp4" and k % nvfp4.GROUP:
            raise ValueError(f"NVFP4 needs in_features a multiple of {nvfp4.GROUP}, got {k}")
        data_dtype = {"fp8": E4M3, "nvfp4": torch.uint8, "int4": torch.int32}[fmt]
        sdtype = {"fp8": torch.float32, "nvfp4": E4M3, "int4": scale_dtype}[fmt]
        self.qweight = _param(*lead, n, packed_columns(fmt, k), dtype=data_dtype, device=device)
        self.scale = _param(*lead, n, math.ceil(k / self.group), dtype=sdtype, device=device)
        self.global_scale = (_param(*lead, n, dtype=torch.float32, device=device)
                             if fmt == "nvfp4" else None)

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self.logical_shape)

    @property
    def device(self) -> torch.device:
        return self.qweight.device

    def extra_repr(self) -> str:
        return f"{self.format}, shape={list(self.logical_shape)}, group={self.group}"

    def view_of(self) -> QuantView:
        if self.scale_rows != 1:
            raise ValueError("a QuantWeight with compacted FP8 scales has no row views")
        if self.micro_tiled:
            raise ValueError("a micro-tiled QuantWeight has no row views")
        return QuantView(self.format, self.qweight, self.scale, self.global_scale,
                         self.logical_shape, self.group)

    def __getitem__(self, index) -> QuantView:
        """Rows of the weight (an index over the dims before K), as a QuantView."""
        return rows_of(self.view_of(), index)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self.format, self.qweight, self.scale, self.global_scale, self.group,
                          self.logical_shape[-1], dtype, self.scale_rows)

    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.parameters())


def rows_of(view: QuantView, index) -> QuantView:
    """view[index] for an index over the dims before K (ints and slices)."""
    index = index if isinstance(index, tuple) else (index,)
    if len(index) >= len(view.shape):
        raise ValueError(f"a quantized weight is indexed by its rows only (shape "
                         f"{list(view.shape)}, index {index})")
    q = view.qweight[index]
    probe = torch.empty(view.shape[:-1], device="meta")[index]
    return QuantView(view.format, q, view.scale[index],
                     None if view.global_scale is None else view.global_scale[index],
                     (*probe.shape, view.shape[-1]), view.group)


def dequantize(fmt: str, qweight: torch.Tensor, scale: torch.Tensor,
               global_scale: torch.Tensor | None, group: int, k: int,
               dtype: torch.dtype = torch.float32, scale_rows: int = 1) -> torch.Tensor:
    """The reference: the [..., N, K] weight in `dtype` (fp32 products, one rounding)."""
    if fmt == "fp8":
        n = qweight.shape[-2]
        s = scale.float().repeat_interleave(scale_rows, -2)[..., :n, :]
        s = s.repeat_interleave(group, -1)[..., :k]
        return (qweight.float() * s).to(dtype)
    if fmt == "nvfp4":
        values = nvfp4.unpack_e2m1(qweight)  # [..., N, K]
        step = scale.float().repeat_interleave(group, -1) * global_scale.float()[..., None]
        return (values * step).to(dtype)
    if fmt == "int4":
        q = int4_pack.unpack(qweight, k).float()
        return (q * scale.float().repeat_interleave(group, -1)[..., :k]).to(dtype)
    raise ValueError(f"unknown quantized format {fmt!r}")


def quantize_into(view: QuantView, w: torch.Tensor, group: int | None = None) -> None:
    """Quantize w [..., N, K] (float) by the format's rule into view's tensors (dummy weights,
    tests): fp8 per row and 128-group (scale_rows 1), nvfp4 with one global scale per
    leading index, int4 symmetric per group. `group`, if given, must be view's."""
    if group is not None and group != view.group:
        raise ValueError(f"group {group} is not the weight's {view.group}")
    flat = w.reshape(-1, w.shape[-2], w.shape[-1])
    q_out = view.qweight.reshape(-1, *view.qweight.shape[-2:])
    s_out = view.scale.reshape(-1, *view.scale.shape[-2:])
    g_out = (view.global_scale.reshape(-1, view.global_scale.shape[-1])
             if view.global_scale is not None else None)
    for i, m in enumerate(flat):
        if view.format == "fp8":  # in the checkpoints' 128 x 128 blocks, a scale row per row
            q, s = quantize_blockwise(m, (FP8_GROUP, view.group))
            s = s.repeat_interleave(FP8_GROUP, 0)[:m.shape[0]]
        elif view.format == "nvfp4":
            q, s, g = nvfp4.quantize(m)
            g_out[i].copy_(g.expand(m.shape[0]))
        else:
            q, s = int4_pack.quantize(m, view.group)
        q_out[i].copy_(q)
        s_out[i].copy_(s)


def compact_fp8_scales(w: QuantWeight) -> bool:
    """Fold an FP8 weight's per-row scales to one row per 128 rows (scale_rows 128) when every
    128 rows share them, as a checkpoint's 128 x 128 blocks do: the kernels then read 1/128 of
    the scale bytes (1.03 bytes a weight become 1.0002). A fused weight whose parts end off the
    blocks (or a row shard that starts off them) keeps its rows. True when folded."""
    if w.format != "fp8" or w.scale_rows != 1:
        return False
    n = w.shape[-2]
    first = w.scale[..., ::FP8_GROUP, :]  # [..., ceil(N / 128), K / 128]
    if not torch.equal(first.repeat_interleave(FP8_GROUP, -2)[..., :n, :], w.scale):
        return False
    w.scale = _param(*first.shape, dtype=first.dtype, device=first.device)
    w.scale.copy_(first)
    w.scale_rows = FP8_GROUP
    return True


def _param(*shape: int, dtype: torch.dtype, device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)
