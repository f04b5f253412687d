"""An FP8 block-scaled checkpoint in DeepSeek's layout, loaded and served.

The checkpoints are tiny random models written by transformers (qwen3_moe at widths of 320 and
192: two full 128-blocks and a partial one, or one and a half; deepseek_v3 with MLA, shared
experts and a dense first layer), then every projection, expert and shared-expert weight is
quantized as the published FP8 releases hold it (e4m3 `weight` + fp32 `weight_scale_inv` per
128 x 128 block, `quantization_config` in config.json, some modules in
`modules_to_not_convert`). The reference is transformers on the dequantized weights, computed
block by block here (not by quant/fp8_block's expansion): in fp32, moeserve's greedy output
must equal it token for token.

moeserve serves these weights dequantized at load (the FP8 kernels come later in issue 18), so
this pins the loader: names, per-expert slices, the kept modules, the scales' checks.
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


def write_fp8_pair(arch: str, root: str) -> tuple[str, str, int]:
    """(the FP8 checkpoint, the reference with its dequantized weights, tensors quantized)."""
    src = write_tiny_checkpoint(arch, os.path.join(root, "src"), **WIDE[arch])
    fp8, ref = os.path.join(root, "fp8"), os.path.join(root, "ref")
    for out in (fp8, ref):
        shutil.copytree(src, out)
    files = [f for f in os.listdir(src) if f.endswith(".safetensors")]
    count = 0
    for fname in files:
        q_tensors, ref_tensors = {}, {}
        with safe_open(os.path.join(src, fname), framework="pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                if _quantizable(name, tuple(t.shape), KEPT[arch]):
                    q, s = quantize_blockwise(t)
                    q_tensors[name], q_tensors[name + "_scale_inv"] = q, s
                    ref_tensors[name] = _dequantized_by_blocks(q, s)
                    count += 1
                else:
                    q_tensors[name] = ref_tensors[name] = t
        save_file(q_tensors, os.path.join(fp8, fname), metadata={"format": "pt"})
        save_file(ref_tensors, os.path.join(ref, fname), metadata={"format": "pt"})
    path = os.path.join(fp8, "config.json")
    with open(path) as f:
        config = json.load(f)
    config["quantization_config"] = {**FP8_CONFIG, "modules_to_not_convert": KEPT[arch]}
    with open(path, "w") as f:
        json.dump(config, f)
    return fp8, ref, count


@pytest.fixture(scope="module", params=["qwen3_moe", "deepseek_v3"])
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple:
    fp8, ref, count = write_fp8_pair(request.param, str(tmp_path_factory.mktemp(request.param)))
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
    fp8, _, _ = write_fp8_pair("qwen3_moe", str(tmp_path))
    name = "model.layers.0.self_attn.k_proj.weight"  # [160, 320]: scales [2, 3]

    def transpose_scale(t: dict) -> None:
        t[name + "_scale_inv"] = t[name + "_scale_inv"].t().contiguous()

    _rewrite(fp8, transpose_scale)
    with pytest.raises(WeightLoadError, match=rf"{name}_scale_inv has shape \[3, 2\] .*; "
                                              rf".* \[160, 320\] in \(128, 128\) blocks "
                                              rf"needs \[2, 3\]"):
        LLM(fp8, device="cpu", dtype="float32")

    def drop_scale(t: dict) -> None:
        del t[name + "_scale_inv"]

    _rewrite(fp8, drop_scale)
    with pytest.raises(WeightLoadError, match=rf"tensor {name} is float8_e4m3fn .* has no "
                                              rf"{name}_scale_inv"):
        LLM(fp8, device="cpu", dtype="float32")


def test_fp8_tensors_without_the_config_are_refused(tmp_path: str) -> None:
    fp8, _, _ = write_fp8_pair("qwen3_moe", str(tmp_path))
    path = os.path.join(fp8, "config.json")
    with open(path) as f:
        config = json.load(f)
    del config["quantization_config"]
    with open(path, "w") as f:
        json.dump(config, f)
    with pytest.raises(WeightLoadError, match="weight_scale_inv.*but its config.json declares "
                                              "no fp8 quantization_config"):
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
