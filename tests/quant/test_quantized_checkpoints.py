"""Quantized checkpoints in their real layouts, loaded and served.

The checkpoints are tiny random models written by transformers (qwen3_moe at widths of 320 and
192: two full 128-blocks and a partial one, or one and a half; deepseek_v3 with MLA, shared
experts and a dense first layer), then every projection, expert and shared-expert weight is
quantized as the published releases hold it, some modules left unquantized by the format's own
list: FP8 block-scaled (e4m3 `weight` + fp32 `weight_scale_inv` per 128 x 128 block,
`quantization_config` in config.json), ModelOpt NVFP4 (declared in hf_quant_config.json only),
compressed-tensors INT4 (its own compressor writes the tensors). The reference is transformers
on the dequantized weights, computed independently of moeserve's code (block by block, e2m1 by
its formula, compressed-tensors' decompressor): in fp32, moeserve's greedy output must equal it
token for token.

moeserve serves these weights dequantized at load (the quantized kernels come later in issue
18), so this pins the loader: names, per-expert slices, the kept modules, the checks.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from moeserve import LLM, SamplingParams
from moeserve.quant import int4_pack, nvfp4
from moeserve.quant.fp8_block import quantize_blockwise
from moeserve.runner.weight_loader import WeightLoadError
from tests.engine.test_generate_vs_hf import _prompts, hf_greedy
from tests.models.checkpoints import write_tiny_checkpoint

FP8_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
              "weight_block_size": [128, 128]}
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
WIDE = {"qwen3_moe": {"hidden_size": 320, "intermediate_size": 320, "moe_intermediate_size": 192,
                      "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 80},
        "deepseek_v3": {"hidden_size": 320, "intermediate_size": 320,
                        "moe_intermediate_size": 192}}
KEPT = {"qwen3_moe": ["model.layers.0.self_attn.o_proj"],
        "deepseek_v3": ["model.layers.1.mlp.shared_experts"]}


def _quantizable(name: str, shape: tuple[int, ...], kept: list[str]) -> bool:
    if len(shape) != 2 or not name.endswith(".weight"):
        return False
    if any(name.startswith(k + ".") for k in kept):
        return False
    skip = ("embed_tokens", "lm_head", "norm", "mlp.gate.weight")  # the router stays
    return not any(s in name for s in skip)


def _dequantized_by_blocks(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    out = q.float()
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            out[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] *= float(scale[i, j])
    return out


def _fp8(name: str, w: torch.Tensor) -> tuple[dict, torch.Tensor]:
    q, s = quantize_blockwise(w)
    return {name: q, name + "_scale_inv": s}, _dequantized_by_blocks(q, s)


def _nvfp4(name: str, w: torch.Tensor) -> tuple[dict, torch.Tensor]:
    """ModelOpt's tensors; the reference decodes the nibbles by e2m1's formula, vectorised."""
    packed, scale, scale_2 = nvfp4.quantize(w)
    nib = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2).long()  # low first
    exp, man = (nib >> 1) & 3, (nib & 1).float()
    mag = torch.where(exp == 0, 0.5 * man, 2.0 ** (exp - 1).float() * (1 + man / 2))
    values = torch.where(nib >= 8, -mag, mag)
    ref = values * scale.float().repeat_interleave(16, 1) * scale_2
    base = name[:-len(".weight")]
    return {name: packed, base + ".weight_scale": scale, base + ".weight_scale_2": scale_2,
            base + ".input_scale": torch.tensor(1.0)}, ref


def _int4(name: str, w: torch.Tensor) -> tuple[dict, torch.Tensor]:
    """compressed-tensors' own compressor writes the tensors; its decompressor the reference
    (fp32 scales, so the product is exact there as here)."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    _, scale = int4_pack.quantize(w, 32)
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=4, type="int", symmetric=True, strategy="group", group_size=32))
    made = PackedQuantizationCompressor.compress({"weight": w, "weight_scale": scale}, scheme)
    ref = PackedQuantizationCompressor.decompress(dict(made), scheme)["weight"].float()
    base = name[:-len(".weight")]
    return {base + "." + k: v for k, v in made.items()}, ref


QUANTIZE = {"fp8": _fp8, "nvfp4": _nvfp4, "int4": _int4}
INT4_CONFIG = {"quant_method": "compressed-tensors", "format": "pack-quantized",
               "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                   "num_bits": 4, "type": "int", "symmetric": True, "group_size": 32,
                   "strategy": "group", "dynamic": False}}}}


def write_quantized_pair(arch: str, root: str, fmt: str = "fp8") -> tuple[str, str, int]:
    """(the quantized checkpoint in `fmt`'s layout, the reference with its dequantized weights,
    tensors quantized)."""
    src = write_tiny_checkpoint(arch, os.path.join(root, "src"), **WIDE[arch])
    quant, ref = os.path.join(root, fmt), os.path.join(root, "ref")
    for out in (quant, ref):
        shutil.copytree(src, out)
    files = [f for f in os.listdir(src) if f.endswith(".safetensors")]
    count = 0
    for fname in files:
        q_tensors, ref_tensors = {}, {}
        with safe_open(os.path.join(src, fname), framework="pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                if _quantizable(name, tuple(t.shape), KEPT[arch]):
                    made, ref_tensors[name] = QUANTIZE[fmt](name, t)
                    q_tensors |= made
                    count += 1
                else:
                    q_tensors[name] = ref_tensors[name] = t
        save_file(q_tensors, os.path.join(quant, fname), metadata={"format": "pt"})
        save_file(ref_tensors, os.path.join(ref, fname), metadata={"format": "pt"})
    path = os.path.join(quant, "config.json")
    with open(path) as f:
        config = json.load(f)
    if fmt == "fp8":
        config["quantization_config"] = {**FP8_CONFIG, "modules_to_not_convert": KEPT[arch]}
    elif fmt == "int4":
        config["quantization_config"] = {**INT4_CONFIG, "ignore": KEPT[arch]}
    else:  # ModelOpt: declared only in hf_quant_config.json
        with open(os.path.join(quant, "hf_quant_config.json"), "w") as f:
            json.dump({"producer": {"name": "modelopt"}, "quantization": {
                "quant_algo": "NVFP4", "group_size": 16, "exclude_modules": KEPT[arch]}}, f)
    with open(path, "w") as f:
        json.dump(config, f)
    return quant, ref, count


@pytest.fixture(scope="module", params=["qwen3_moe", "deepseek_v3"])
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple:
    folder = str(tmp_path_factory.mktemp(request.param))
    fp8, ref, count = write_quantized_pair(request.param, folder)
    prompts = _prompts(256, (5, 17, 9))
    return fp8, ref, count, prompts, hf_greedy(ref, prompts, GREEDY.max_tokens)


def test_fp8_checkpoint_matches_transformers_on_its_dequantized_weights(pair: tuple) -> None:
    fp8, _, count, prompts, expected = pair
    assert count >= 8
    llm = LLM(fp8, device="cpu", dtype="float32")
    assert [r.token_ids for r in llm.generate(prompts, GREEDY)] == expected
    report = llm.report.format()
    assert "fp8 block-scaled (128x128)" in report and "dequantized" in report
    assert f"{count} weights" in report


def _rewrite(folder: str, edit) -> None:
    for fname in [f for f in os.listdir(folder) if f.endswith(".safetensors")]:
        path = os.path.join(folder, fname)
        with safe_open(path, framework="pt") as f:
            tensors = {n: f.get_tensor(n) for n in f.keys()}
        edit(tensors)
        save_file(tensors, path, metadata={"format": "pt"})


def test_bad_fp8_tensors_are_named(tmp_path: str) -> None:
    fp8, _, _ = write_quantized_pair("qwen3_moe", str(tmp_path))
    name = "model.layers.0.self_attn.k_proj.weight"  # [160, 320]: scales [2, 3]

    def transpose_scale(t: dict) -> None:
        t[name + "_scale_inv"] = t[name + "_scale_inv"].t().contiguous()

    _rewrite(fp8, transpose_scale)
    with pytest.raises(WeightLoadError, match=rf"{name}_scale_inv: shape \(3, 2\) does not "
                                              rf"match {name}'s \(160, 320\) in 128x128 "
                                              rf"blocks \(expected \(2, 3\)\)"):
        LLM(fp8, device="cpu", dtype="float32")

    def drop_scale(t: dict) -> None:
        del t[name + "_scale_inv"]

    _rewrite(fp8, drop_scale)
    with pytest.raises(WeightLoadError, match=rf"tensor {name} is float8_e4m3fn .* has no "
                                              rf"{name}_scale_inv"):
        LLM(fp8, device="cpu", dtype="float32")


def test_fp8_tensors_without_the_config_are_refused(tmp_path: str) -> None:
    fp8, _, _ = write_quantized_pair("qwen3_moe", str(tmp_path))
    path = os.path.join(fp8, "config.json")
    with open(path) as f:
        config = json.load(f)
    del config["quantization_config"]
    with open(path, "w") as f:
        json.dump(config, f)
    with pytest.raises(WeightLoadError, match=r"holds quantized tensors \(.*weight_scale_inv, "
                                              r"\d+ in all\) but its config declares no "
                                              "quantization_config"):
        LLM(fp8, device="cpu", dtype="float32")


def test_dummy_weights_in_a_quantized_layout_are_refused() -> None:
    from moeserve.config import ConfigError

    with pytest.raises(ConfigError, match="dummy weights in a quantized layout are not "
                                          "implemented"):
        LLM("tiny-moe", device="cpu", hf_overrides={"quantization_config": FP8_CONFIG})


def test_the_quantization_flag_is_checked_against_the_checkpoint(pair: tuple) -> None:
    from moeserve.config import ConfigError

    fp8, ref, _, prompts, expected = pair
    llm = LLM(fp8, device="cpu", dtype="float32", quantization="fp8")
    assert [r.token_ids for r in llm.generate(prompts[:1], GREEDY)] == expected[:1]
    with pytest.raises(ConfigError, match="--quantization nvfp4 contradicts the checkpoint, "
                                          "which holds fp8 weights"):
        LLM(fp8, device="cpu", quantization="modelopt_fp4")
    with pytest.raises(ConfigError, match="--quantization int4 was given but the checkpoint "
                                          "is not quantized"):
        LLM(ref, device="cpu", quantization="compressed-tensors")
    with pytest.raises(ConfigError, match="--quantization 'awq' is not a format"):
        LLM(fp8, device="cpu", quantization="awq")


def test_an_fp8_config_over_unquantized_tensors_is_reported(pair: tuple) -> None:
    _, ref, _, prompts, expected = pair
    path = os.path.join(ref, "config.json")
    with open(path) as f:
        config = json.load(f)
    with open(path, "w") as f:
        json.dump(config | {"quantization_config": FP8_CONFIG}, f)
    try:
        llm = LLM(ref, device="cpu", dtype="float32")
        assert [r.token_ids for r in llm.generate(prompts, GREEDY)] == expected
        assert "declares fp8 but the checkpoint holds no quantized tensors" in (
            llm.report.format())
    finally:
        with open(path, "w") as f:
            json.dump(config, f)


@pytest.mark.parametrize("fmt", ["nvfp4", "int4"])
def test_nvfp4_and_int4_checkpoints_match_transformers_on_their_dequantized_weights(
        tmp_path: str, fmt: str) -> None:
    """ModelOpt's NVFP4 (declared in hf_quant_config.json only) and compressed-tensors' INT4
    (written by its own compressor) on qwen3_moe: exact dequantization, so greedy tokens equal
    transformers on the dequantized weights in fp32."""
    quant, ref, count = write_quantized_pair("qwen3_moe", str(tmp_path), fmt)
    prompts = _prompts(256, (5, 17, 9))
    expected = hf_greedy(ref, prompts, GREEDY.max_tokens)
    llm = LLM(quant, device="cpu", dtype="float32")
    assert [r.token_ids for r in llm.generate(prompts, GREEDY)] == expected
    assert f"{count} weights dequantized" in llm.report.format()
    assert llm.engine.model_config.quantization.format == fmt
