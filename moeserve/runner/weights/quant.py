"""A quantized checkpoint's tensors, read as the weights the model loads: kept quantized where
the model holds the weight quantized (quant/plan.py; `source` gives them in quant/packed.py's
row layout), dequantized into the engine's dtype where it does not (a fused weight with a part
the checkpoint left unquantized).

Per linear `X` (the model loads `X.weight`), each format's tensors (quant/spec.py's formats):

    fp8     X.weight float8_e4m3fn [N, K], X.weight_scale_inv fp32 [ceil(N/128), ceil(K/128)]
    nvfp4   X.weight uint8 [N, K/2], X.weight_scale float8_e4m3fn [N, K/16],
            X.weight_scale_2 fp32 [] (X.input_scale fp32 [], for FP4 activations: read, unused)
    int4    X.weight_packed int32 [N, ceil(K/8)], X.weight_scale [N, ceil(K/g)],
            X.weight_shape int [2]: no X.weight tensor at all

`QuantizedTensors` finds them by name, checks each against its format (a wrong dtype or shape
raises WeightLoadError naming the tensor) and dequantizes one weight at a time. Tensors that
look quantized without the config that says so (an e4m3, a packed or scale tensor) are refused.
"""

from __future__ import annotations

import torch
from safetensors import safe_open

from moeserve.model_config import ModelConfig
from moeserve.quant import fp8_block, int4_pack, nvfp4
from moeserve.quant.packed import QuantView, QuantWeight, packed_columns, rows_of

# the companion tensors of X.weight in each format, by suffix of X
COMPANIONS = {"fp8": (".weight_scale_inv",),
              "nvfp4": (".weight_scale", ".weight_scale_2", ".input_scale"),
              "int4": (".weight_packed", ".weight_scale", ".weight_shape")}
# suffixes that only quantized checkpoints carry
_QUANT_SUFFIXES = {s for suffixes in COMPANIONS.values() for s in suffixes} - {".input_scale"}


class QuantLoadError(ValueError):
    """A quantized tensor that does not fit its format (the loader re-raises it as
    WeightLoadError)."""


class QuantizedTensors:
    """The checkpoint's quantized weights: `weights` maps each X.weight the model loads to the
    tensor names it is made of."""

    def __init__(self, cfg: ModelConfig, files: dict[str, str], left_out: set[str],
                 folder: str):
        self.files = files
        self.spec = cfg.quantization
        names = {n for n in files if n not in left_out}
        marked = sorted(n for n in names if any(n.endswith(s) for s in _QUANT_SUFFIXES))
        fmt = self.spec.format if self.spec is not None else None
        if marked and fmt is None:
            raise QuantLoadError(f"the checkpoint {folder} holds quantized tensors ({marked[0]}, "
                                 f"{len(marked)} in all) but its config declares no "
                                 "quantization_config")
        self.weights: dict[str, dict[str, str]] = {}
        self.consumed: set[str] = set()
        if fmt is None:
            return
        key = COMPANIONS[fmt][0]  # the tensor every quantized linear of the format has
        for n in sorted(names):
            if n.endswith(key):
                base = n[:-len(key)]
                self.weights[base + ".weight"] = {
                    s: base + s for s in COMPANIONS[fmt] if base + s in names}
        self.consumed = {t for parts in self.weights.values() for t in parts.values()}
        stray = sorted(set(marked) - self.consumed)
        if stray:
            raise QuantLoadError(f"tensor {stray[0]} in {folder} belongs to no {fmt} weight "
                                 "(its companion tensors are missing)")

    def data_name(self, weight: str) -> str:
        """The tensor that holds weight's values (int4: X.weight_packed)."""
        parts = self.weights[weight]
        return parts.get(".weight_packed", weight)

    def check(self, weight: str, shape: tuple[int, ...]) -> None:
        """weight's tensors against its format and the model's [N, K] `shape` (the data tensor
        from its header alone: the checks read no weight bytes)."""
        t = self._tensors(weight, data_header_only=True)
        try:
            if self.spec.format == "fp8":
                fp8_block.check_weight(weight, t["data"], t[".weight_scale_inv"],
                                       self.spec.block)
                got = tuple(t["data"].shape)
            elif self.spec.format == "nvfp4":
                for s in (".weight_scale", ".weight_scale_2"):
                    if s not in t:
                        raise ValueError(f"{weight}: NVFP4 weight without its "
                                         f"{weight[:-len('.weight')]}{s}")
                nvfp4.check_weight(weight, t["data"], t[".weight_scale"], t[".weight_scale_2"])
                got = (t["data"].shape[0], 2 * t["data"].shape[1])
            else:
                for s in (".weight_scale", ".weight_shape"):
                    if s not in t:
                        raise ValueError(f"{weight}: INT4 weight without its "
                                         f"{weight[:-len('.weight')]}{s}")
                got = int4_pack.check_weight(weight[:-len(".weight")] + ".weight", t["data"],
                                             t[".weight_scale"], t[".weight_shape"],
                                             self.spec.group_size)
        except ValueError as e:
            raise QuantLoadError(str(e)) from None
        if tuple(got) != tuple(shape):
            raise QuantLoadError(f"{weight} is [{', '.join(map(str, got))}] once dequantized; "
                                 f"the model expects {list(shape)}")

    def dequantize(self, weight: str, dtype: torch.dtype) -> torch.Tensor:
        t = self._tensors(weight)
        if self.spec.format == "fp8":
            return fp8_block.dequantize_blockwise(t["data"], t[".weight_scale_inv"],
                                                  self.spec.block, dtype)
        if self.spec.format == "nvfp4":
            return nvfp4.dequantize(t["data"], t[".weight_scale"], t[".weight_scale_2"], dtype)
        return int4_pack.dequantize(t["data"], t[".weight_scale"], t[".weight_shape"],
                                    self.spec.group_size, dtype)

    def source(self, weight: str) -> QuantView:
        """weight's tensors in the in-memory layout (quant/packed.py): FP8's block scales
        repeated per row, NVFP4's global scale as one value per row."""
        t = self._tensors(weight)
        data = t["data"]
        if self.spec.format == "fp8":
            n, k = data.shape
            scale = t[".weight_scale_inv"].float().repeat_interleave(self.spec.block[0], 0)[:n]
            return QuantView("fp8", data, scale, None, (n, k), self.spec.block[1])
        if self.spec.format == "nvfp4":
            n = data.shape[0]
            g = t[".weight_scale_2"].float().reshape(1).expand(n)
            return QuantView("nvfp4", data, t[".weight_scale"], g, (n, 2 * data.shape[1]),
                             nvfp4.GROUP)
        n, k = (int(v) for v in t[".weight_shape"].tolist())
        return QuantView("int4", data, t[".weight_scale"], None, (n, k), self.spec.group_size)

    def _tensors(self, weight: str, data_header_only: bool = False) -> dict[str, torch.Tensor]:
        """weight's tensors by role ("data", then its companions' suffixes); the data tensor as
        an empty meta tensor of its header's shape and dtype when `data_header_only`."""
        names = {"data": self.data_name(weight)}
        names |= {s: n for s, n in self.weights[weight].items() if n != names["data"]}
        out = {}
        for key, name in names.items():
            with safe_open(self.files[name], framework="pt", device="cpu") as f:
                if key == "data" and data_header_only:
                    header = f.get_slice(name)
                    dtype = _DTYPES.get(header.get_dtype())
                    if dtype is None:
                        raise QuantLoadError(f"{name}: dtype {header.get_dtype()} is not one "
                                             f"a {self.spec.format} weight is stored in")
                    out[key] = torch.empty(header.get_shape(), dtype=dtype, device="meta")
                else:
                    out[key] = f.get_tensor(name)
        return out


# safetensors' dtype names of the quantized formats' data tensors (and of plain weights, which
# the formats' checks then name as the wrong dtype)
_DTYPES = {"F8_E4M3": torch.float8_e4m3fn, "U8": torch.uint8, "I32": torch.int32,
           "I8": torch.int8, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def part_of(view: QuantView, index: tuple, group: int, name: str) -> QuantView:
    """view[index], where index may also cut the columns (K): a row-parallel shard's. The cut
    must fall on the format's groups (QuantLoadError naming the tensor otherwise)."""
    index = tuple(index)
    if len(index) < len(view.shape):
        return _rows(view, index)
    *lead, cols = index
    start, stop = check_cut(cols, view.shape[-1], group, view.format, name)
    first = {"fp8": start, "nvfp4": start // 2, "int4": start // int4_pack.PER_WORD}
    q = view.qweight[(*lead, slice(first[view.format],
                                   first[view.format] + packed_columns(view.format,
                                                                       stop - start)))]
    scale = view.scale[(*lead, slice(start // group, -(-stop // group)))]
    glob = None if view.global_scale is None else view.global_scale[tuple(lead)]
    rows = torch.empty(view.shape[:-1], device="meta")[tuple(lead)].shape
    return QuantView(view.format, q, scale, glob, (*rows, stop - start), group)


def check_cut(cols: slice, k: int, group: int, fmt: str, name: str) -> tuple[int, int]:
    """A shard's column range of a K-wide quantized weight, on its groups: (start, stop)."""
    start, stop, step = cols.indices(k)
    if step != 1 or start % group or (stop != k and stop % group):
        raise QuantLoadError(f"{name}: its shard's columns [{start}, {stop}) of {k} cut the "
                             f"{fmt} groups of {group} (choose a parallel layout whose split "
                             "falls on them)")
    return start, stop


def copy_part(dest: QuantView | QuantWeight, src: QuantView) -> None:
    """Copy a checkpoint's quantized part into the model's (same format, same shape)."""
    if isinstance(dest, QuantWeight):
        dest = dest.view_of()
    if dest.format != src.format or tuple(dest.shape) != tuple(src.shape):
        raise QuantLoadError(f"a {src.format} part {list(src.shape)} does not fit the model's "
                             f"{dest.format} {list(dest.shape)}")
    dest.qweight.copy_(src.qweight)
    dest.scale.copy_(src.scale)
    if dest.global_scale is not None:
        dest.global_scale.copy_(src.global_scale)


def _rows(view: QuantView, index: tuple) -> QuantView:
    return rows_of(view, index) if index else view
