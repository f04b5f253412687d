"""Weights: HF safetensors checkpoints into our packed parameters, or random dummy weights.

`load_weights` reads `model.safetensors`, or the shards listed by `model.safetensors.index.json`,
one tensor at a time (safe_open + get_tensor, copied and dtype-converted into the preallocated
parameters, so peak memory stays about 1x the model). The name map is strict: every expected
tensor must be present with its exact shape, and nothing else may be there; any mismatch raises
WeightLoadError naming the tensor, before anything is copied.

The name map (every family's HF names -> our packed parameters) is runner/weights/names.py.
A checkpoint's multi-token-prediction layers are recognised by name and left out
(`load_weights` counts them, for the capacity report), as are the layers an `hf_overrides`
slice of num_hidden_layers cuts off.

Quantized checkpoints (ModelConfig.quantization: FP8 block-scaled, NVFP4, INT4; each linear's
tensors as runner/weights/quant.py lists them): `checkpoint_plan` says which of the model's
weights are held quantized (those whose every checkpoint part is quantized: quant/plan.py); those
copy their packed tensors and scales as they are, the others are dequantized into the engine's
dtype as they are copied. A tensor that does not fit its format, a tensor-parallel cut through a
scale group, or quantized tensors under a config that declares none raise WeightLoadError
naming the tensor. Dummy weights in a quantized layout are drawn in the engine's dtype and
quantized by the format's rule, one matrix at a time.
"""

from __future__ import annotations

import itertools
import json
import os
from collections import defaultdict
from typing import NamedTuple

import torch
from safetensors import safe_open

from moeserve.layers.attention import Attention
from moeserve.layers.mla import MLAttention
from moeserve.layers.mlp import MLP
from moeserve.layers.moe import SparseMoeBlock
from moeserve.layers.norm import LayerNorm, RMSNorm
from moeserve.model_config import ModelConfig
from moeserve.models.decoder import CausalLM
from moeserve.parallel.layout import RankLayout, quantized_split_breaks
from moeserve.quant.packed import QuantView, QuantWeight, quantize_into, rows_of
from moeserve.quant.plan import QuantPlan
from moeserve.runner.weights.names import Target, left_out_layer_names, weight_targets
from moeserve.runner.weights.quant import (
    QuantizedTensors,
    QuantLoadError,
    check_cut,
    copy_part,
    part_of,
)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)  # buffers some old checkpoints carry
_DUMMY_STD = 0.02


class WeightLoadError(ValueError):
    """A checkpoint whose tensors do not match the model (names the tensor or file)."""


class LoadedWeights(NamedTuple):
    left_out: int  # tensors of layers not run (MTP layers, layers cut by a slice)
    dequantized: int  # quantized checkpoint weights dequantized into the engine's dtype
    kept: int = 0  # quantized checkpoint weights copied as they are (held quantized)


def checkpoint_plan(model_config: ModelConfig, folder: str,
                    checkpoint_layers: int | None = None,
                    layout: RankLayout | None = None) -> QuantPlan | None:
    """The weights to hold quantized for the checkpoint in `folder` (module doc); None when it
    is not quantized. Works on the model built on the meta device (no memory). Under `layout`
    the row-parallel weights whose rank's columns cut the scale groups are held dequantized
    (parallel/layout.py's quantized_split_breaks)."""
    spec = model_config.quantization
    if spec is None:
        return None
    from moeserve.models import build_model

    files = _checkpoint_files(folder)
    left_out = left_out_layer_names(model_config, set(files), checkpoint_layers)
    try:
        quant = QuantizedTensors(model_config, files, left_out, folder)
    except QuantLoadError as e:
        raise WeightLoadError(str(e)) from None
    every = QuantPlan.from_spec(spec)  # the meta model declares each quantizable weight so
    meta = build_model(model_config, "bfloat16", "meta", "torch", "torch", quant=every)
    path_of = {id(m.qweight): name for name, m in meta.named_modules()
               if isinstance(m, QuantWeight)}
    tensors = (set(files) - quant.consumed) | set(quant.weights)
    parts: dict[str, list[bool]] = defaultdict(list)  # weight path -> its parts quantized?
    for name, target in weight_targets(meta, model_config, tensors).items():
        for dest, _ in target.parts:
            if isinstance(dest, QuantView | QuantWeight):
                q = dest.qweight
                parts[path_of[id(q._base if q._base is not None else q)]].append(
                    name in quant.weights)
    broken = tuple(b.suffix for b in quantized_split_breaks(model_config,
                                                            layout or RankLayout()))
    held = {p for p, q in parts.items() if all(q) and not p.endswith(broken)}
    # a MoE block's w13 and w2 run in one op: both quantized, or both in the engine's dtype
    pairs = {p.removesuffix(".w13"): p for p in held if p.endswith(".mlp.w13")}
    held -= {w13 for block, w13 in pairs.items() if block + ".w2" not in held}
    held -= {p for p in held if p.endswith(".mlp.w2") and p[:-3] + ".w13" not in held}
    return QuantPlan.from_spec(spec, frozenset(held))


@torch.no_grad()
def load_weights(model: CausalLM, model_config: ModelConfig, folder: str,
                 checkpoint_layers: int | None = None,
                 layout: RankLayout | None = None) -> LoadedWeights:
    """Copy the checkpoint in `folder` into `model`'s parameters (strict; see module doc).
    checkpoint_layers: the checkpoint's own num_hidden_layers when hf_overrides served fewer;
    layout: the rank whose shard `model` holds (each tensor's part read, names.Target)."""
    files = _checkpoint_files(folder)  # tensor name -> file path
    left_out = left_out_layer_names(model_config, set(files), checkpoint_layers)
    try:
        quant = QuantizedTensors(model_config, files, left_out, folder)
    except QuantLoadError as e:
        raise WeightLoadError(str(e)) from None
    tensors = (set(files) - quant.consumed) | set(quant.weights)  # int4: X.weight is virtual
    targets = weight_targets(model, model_config, tensors, layout)  # name -> Target
    skipped = {n for n in tensors if n.endswith(_IGNORED_SUFFIXES)} | left_out
    if model_config.tie_word_embeddings:
        skipped.add("lm_head.weight")
    _check_names(set(targets), tensors - skipped, folder)
    if quant.weights.keys() - targets.keys():
        name = sorted(quant.weights.keys() - targets.keys())[0]
        raise WeightLoadError(f"quantized weight {name} in {folder} is not one the model loads")
    by_file: dict[str, list[str]] = defaultdict(list)
    for name in targets:
        by_file[files[quant.data_name(name) if name in quant.weights else name]].append(name)
    for path, names in by_file.items():  # pass 1: headers only, fail before copying anything
        with safe_open(path, framework="pt", device="cpu") as f:
            present = set(f.keys())
            for name in names:
                if name in quant.weights:
                    try:
                        quant.check(name, tuple(targets[name].shape))
                        _check_quantized_parts(name, targets[name], quant)
                    except QuantLoadError as e:
                        raise WeightLoadError(f"{e} (in {path})") from None
                    continue
                if (quant.spec is not None and any(
                        isinstance(d, QuantView | QuantWeight) for d, _ in targets[name].parts)):
                    raise WeightLoadError(f"tensor {name} in {path} is not quantized, but the "
                                          "model holds its weight quantized")
                if name not in present:
                    raise WeightLoadError(f"{INDEX_FILE} puts tensor {name} in {path}, "
                                          "which does not contain it")
                header = f.get_slice(name)
                shape = tuple(header.get_shape())
                if shape != tuple(targets[name].shape):
                    raise WeightLoadError(
                        f"tensor {name} has shape {list(shape)} in {path}; the model expects "
                        f"{list(targets[name].shape)}")
                if header.get_dtype().startswith("F8"):
                    raise WeightLoadError(f"tensor {name} is float8_e4m3fn ({header.get_dtype()}) "
                                          f"in {path} but has no {name}_scale_inv")
    kept = dequantized = 0
    for path, names in by_file.items():  # pass 2: copy, one tensor at a time
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in names:
                if name in quant.weights:
                    parts = targets[name].parts
                    if parts and isinstance(parts[0][0], QuantView | QuantWeight):
                        src = quant.source(name)
                        for dest, index in parts:
                            copy_part(dest, part_of(src, index, dest.group, name))
                        kept += 1
                    elif parts:
                        full = quant.dequantize(name, parts[0][0].dtype)
                        for dest, index in parts:
                            dest.copy_(full[index])
                        dequantized += 1
                    continue
                for dest, index in targets[name].parts:  # none: another rank's tensor
                    src = f.get_slice(name)[index] if index else f.get_tensor(name)
                    if isinstance(dest, QuantView | QuantWeight):  # an unquantized checkpoint
                        view = dest.view_of() if isinstance(dest, QuantWeight) else dest
                        quantize_into(view, src.float())  # under --quantization
                    else:
                        dest.copy_(src)
    return LoadedWeights(len(left_out), dequantized, kept)


def _check_quantized_parts(name: str, target: Target, quant: QuantizedTensors) -> None:
    """Each quantized part of a checkpoint weight: a shard's column cut on the groups."""
    for dest, index in target.parts:
        if isinstance(dest, QuantView | QuantWeight) and len(index) == len(target.shape):
            check_cut(index[-1], target.shape[-1], dest.group, quant.spec.format, name)


def _checkpoint_files(folder: str) -> dict[str, str]:
    """Map every tensor name in the checkpoint to the file holding it."""
    index_path = os.path.join(folder, INDEX_FILE)
    single_path = os.path.join(folder, SINGLE_FILE)
    if os.path.exists(index_path):
        with open(index_path) as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        for shard in sorted(set(weight_map.values())):
            if not os.path.exists(os.path.join(folder, shard)):
                raise WeightLoadError(f"shard file {shard} listed in {index_path} is missing")
        return {name: os.path.join(folder, shard) for name, shard in weight_map.items()}
    if os.path.exists(single_path):
        with safe_open(single_path, framework="pt", device="cpu") as f:
            return dict.fromkeys(f.keys(), single_path)
    raise WeightLoadError(f"no {SINGLE_FILE} or {INDEX_FILE} in {folder}")


def _check_names(expected: set[str], found: set[str], folder: str) -> None:
    for what, names in (("missing", expected - found), ("unexpected", found - expected)):
        if names:
            shown = sorted(names)
            more = f" (and {len(shown) - 8} more)" if len(shown) > 8 else ""
            raise WeightLoadError(f"{what} tensor(s) in the checkpoint {folder}: "
                                  f"{', '.join(shown[:8])}{more}")


@torch.no_grad()
def init_dummy_weights(model: CausalLM, seed: int) -> None:
    """Random weights on the model's own device (no CPU round trip), finite through deep stacks,
    with hidden states that stay distinct per token, so routing spreads as in a trained model.

        embed_tokens ~ N(0, 1)       the token's identity dominates the residual stream
        o_proj, down_proj, w2 ~ N(0, 0.002)   small residual writes: 48 layers add ~rms 1, so
                                      attention's averaging over the context cannot make all
                                      tokens alike (at 0.02 everywhere, 40 of 128 experts get
                                      the tokens of the last layers)
        routers ~ N(0, 1/sqrt(hidden))  unit-RMS input -> logits of std ~1
        norms = 1 (LayerNorm biases 0); everything else ~ N(0, 0.02)
    """
    device = next(model.parameters()).device
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    std: dict[int, float] = {id(model.model.embed_tokens): 1.0}
    const: dict[int, float] = {}  # filled with a value, not drawn
    for module in model.modules():
        if isinstance(module, RMSNorm | LayerNorm):
            const[id(module.weight)] = 1.0
            if isinstance(module, LayerNorm):
                const[id(module.bias)] = 0.0
        elif isinstance(module, SparseMoeBlock):
            std[id(module.gate)] = module.gate.shape[1] ** -0.5
            std[id(module.w2)] = _DUMMY_STD / 10
        elif isinstance(module, MLP):
            std[id(module.down_proj)] = _DUMMY_STD / 10
        elif isinstance(module, Attention | MLAttention):
            std[id(module.o_proj)] = _DUMMY_STD / 10
    packed: set[int] = set()
    for module in model.modules():
        if isinstance(module, QuantWeight):
            packed.update(id(p) for p in module.parameters())
            _dummy_quantized(module, std.get(id(module), _DUMMY_STD), gen)
    for param in model.parameters():
        if id(param) in packed:
            continue
        if id(param) in const:
            param.fill_(const[id(param)])
        else:
            param.normal_(0.0, std.get(id(param), _DUMMY_STD), generator=gen)


def _dummy_quantized(w: QuantWeight, std: float, gen: torch.Generator) -> None:
    """N(0, std) weights in the engine's precision, quantized into w one matrix at a time (an
    expert's, for a MoE block: the float copy stays one matrix)."""
    n, k = w.shape[-2:]
    view = w.view_of()
    dtype = w.scale.dtype if w.scale.dtype.is_floating_point and w.scale.element_size() > 1 \
        else torch.float32
    for lead in itertools.product(*(range(d) for d in w.shape[:-2])):
        m = torch.empty(n, k, dtype=torch.float32, device=w.device).normal_(0.0, std,
                                                                         generator=gen)
        quantize_into(rows_of(view, lead) if lead else view, m.to(dtype))


def model_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes held by the model's parameters (a tied embedding counted once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())
