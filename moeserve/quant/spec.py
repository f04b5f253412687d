"""The quantization format a checkpoint declares, parsed and checked (torch-free: the API process
reads configs too).

Three formats (../shared/reference/MODELS.md, "Checkpoint formats"):

    fp8     config.json quantization_config {quant_method: "fp8", fmt: "e4m3",
            activation_scheme: "dynamic", weight_block_size: [128, 128]}: e4m3 weights with one
            fp32 `weight_scale_inv` per 128 x 128 block, activations quantized at run time per
            token and 128-wide group
    nvfp4   ModelOpt: hf_quant_config.json {"quantization": {"quant_algo": "NVFP4",
            "group_size": 16, "exclude_modules": [...]}} and/or quantization_config
            {quant_method: "modelopt", quant_algo: "NVFP4", ...}
    int4    compressed-tensors "pack-quantized": quantization_config {quant_method:
            "compressed-tensors", format: "pack-quantized", config_groups: {...: {weights:
            {num_bits: 4, symmetric: true, group_size: 32, strategy: "group"}}}, ignore: [...]}

`--quantization` takes these names and vLLM's (`modelopt_fp4` for nvfp4, `compressed-tensors` for
int4); over an unquantized checkpoint it asks for the weights to be quantized as they load (the
engine's plan, quant/plan.py); a flag that contradicts a quantized checkpoint is an error, as
is a checkpoint field outside what each format's arithmetic implements (named in the message).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from moeserve.model_config import ConfigError

FORMATS = ("fp8", "nvfp4", "int4")
ALIASES = {"fp8": "fp8", "nvfp4": "nvfp4", "modelopt_fp4": "nvfp4", "int4": "int4",
           "compressed-tensors": "int4"}


@dataclass(frozen=True, slots=True)
class QuantSpec:
    """One checkpoint's quantization: the format and what its arithmetic needs."""

    format: str  # "fp8" | "nvfp4" | "int4"
    block: tuple[int, int] | None = None  # fp8: the weight scale's block (rows, columns)
    group_size: int | None = None  # nvfp4 / int4: weights sharing one scale along K
    kept_modules: tuple[str, ...] = field(default=())  # left unquantized (names or patterns)
    kv_cache: str | None = None  # nvfp4: the checkpoint's KV cache format (e.g. "FP8")


def flag_format(name: str) -> str:
    """`--quantization NAME` -> the format, vLLM's names accepted."""
    if name not in ALIASES:
        vllm_names = ", ".join(sorted(set(ALIASES) - set(FORMATS)))
        raise ConfigError(f"--quantization {name!r} is not a format moeserve knows "
                          f"(use {', '.join(FORMATS)}; vLLM's names {vllm_names} are accepted)")
    return ALIASES[name]


def parse(config: dict[str, Any], hf_quant_config: dict[str, Any] | None = None,
          flag: str | None = None) -> QuantSpec | None:
    """The checkpoint's QuantSpec (None: not quantized), checked against `--quantization`."""
    quant = config.get("quantization_config")
    spec: QuantSpec | None = None
    if hf_quant_config is not None:
        spec = _modelopt(hf_quant_config.get("quantization"), "hf_quant_config.json quantization")
    if quant is not None:
        if not isinstance(quant, dict):
            raise ConfigError(f"quantization_config must be an object, got {quant!r}")
        from_config = _from_quantization_config(quant)
        if spec is not None and from_config.format != spec.format:
            raise ConfigError(f"hf_quant_config.json says {spec.format} but config.json's "
                              f"quantization_config says {from_config.format}")
        spec = spec or from_config
    if flag is not None:
        wanted = flag_format(flag)
        if spec is None:  # unquantized weights: the engine quantizes them as they load
            return None
        if wanted != spec.format:
            raise ConfigError(f"--quantization {flag} contradicts the checkpoint, which holds "
                              f"{spec.format} weights")
    return spec


def _from_quantization_config(q: dict[str, Any]) -> QuantSpec:
    method = q.get("quant_method")
    if method == "fp8":
        return _fp8(q)
    if method == "modelopt":
        return _modelopt(q, "quantization_config")
    if method == "compressed-tensors":
        return _compressed_tensors(q)
    raise ConfigError(f"quantization_config.quant_method {method!r} is not implemented "
                      "(fp8, modelopt NVFP4 and compressed-tensors INT4 are)")


def _check(q: dict[str, Any], where: str, key: str, allowed: tuple[Any, ...],
           required: bool = False) -> None:
    if key not in q:
        if required:
            raise ConfigError(f"{where}.{key} is missing (expected one of {allowed})")
        return
    if q[key] not in allowed:
        raise ConfigError(f"{where}.{key}={q[key]!r} is not implemented (only {allowed})")


# quantization_config fields of the FP8 format: read below, or inert (why)
FP8_FIELDS = {"quant_method", "fmt", "activation_scheme", "weight_block_size",
              "modules_to_not_convert", "ignored_layers",
              "scale_fmt"}  # "ue8m0" (DeepSeek-V3.1+): the fp32 scales are powers of two; the
#                            dequantization is the same product


def _fp8(q: dict[str, Any]) -> QuantSpec:
    where = "quantization_config"
    unknown = sorted(set(q) - FP8_FIELDS)
    if unknown:
        raise ConfigError(f"{where} field(s) not implemented for fp8: {', '.join(unknown)}")
    _check(q, where, "scale_fmt", ("ue8m0",))
    _check(q, where, "fmt", ("e4m3",))
    _check(q, where, "activation_scheme", ("dynamic",))
    block = q.get("weight_block_size")
    if block is None:
        raise ConfigError(f"{where}.weight_block_size is missing: per-tensor FP8 is not "
                          "implemented (only block-scaled, [128, 128])")
    if list(block) != [128, 128]:
        raise ConfigError(f"{where}.weight_block_size={block!r} is not implemented "
                          "(only [128, 128])")
    kept = tuple(q.get("modules_to_not_convert") or q.get("ignored_layers") or ())
    return QuantSpec("fp8", block=(128, 128), kept_modules=kept)


def _modelopt(q: Any, where: str) -> QuantSpec:
    if not isinstance(q, dict):
        raise ConfigError(f"{where} must be an object, got {q!r}")
    _check(q, where, "quant_algo", ("NVFP4",), required=True)
    group = q.get("group_size", 16)
    if group != 16:
        raise ConfigError(f"{where}.group_size={group!r} is not implemented (NVFP4 is 16)")
    kv = q.get("kv_cache_quant_algo")
    if kv not in (None, "FP8"):
        raise ConfigError(f"{where}.kv_cache_quant_algo={kv!r} is not implemented "
                          "(null or FP8)")
    kept = tuple(q.get("exclude_modules") or q.get("ignore") or ())
    return QuantSpec("nvfp4", group_size=16, kept_modules=kept, kv_cache=kv)


def _compressed_tensors(q: dict[str, Any]) -> QuantSpec:
    where = "quantization_config"
    _check(q, where, "format", ("pack-quantized",))
    groups = q.get("config_groups")
    if not isinstance(groups, dict) or len(groups) != 1:
        raise ConfigError(f"{where}.config_groups must hold exactly one group (got "
                          f"{groups!r}): mixed schemes are not implemented")
    (name, group), = groups.items()
    gwhere = f"{where}.config_groups.{name}"
    weights = group.get("weights") if isinstance(group, dict) else None
    if not isinstance(weights, dict):
        raise ConfigError(f"{gwhere}.weights is missing")
    wwhere = f"{gwhere}.weights"
    _check(weights, wwhere, "num_bits", (4,), required=True)
    _check(weights, wwhere, "symmetric", (True,))
    _check(weights, wwhere, "strategy", ("group",))
    _check(weights, wwhere, "type", ("int",))
    _check(weights, wwhere, "dynamic", (False,))
    if group.get("input_activations") is not None:
        raise ConfigError(f"{gwhere}.input_activations is set: only weight-only INT4 "
                          "(W4A16) is implemented")
    size = weights.get("group_size")
    if not isinstance(size, int) or size <= 0:
        raise ConfigError(f"{wwhere}.group_size={size!r}: a positive group size is required")
    return QuantSpec("int4", group_size=size, kept_modules=tuple(q.get("ignore") or ()))
