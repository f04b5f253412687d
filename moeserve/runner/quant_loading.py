"""A quantized checkpoint's tensors, read as the weights the model loads (dequantized into the
engine's dtype as they are copied; the quantized kernels come later in issue 18).

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
