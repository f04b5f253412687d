"""The DeepSeek / GLM / Kimi presets against the published configs (tests/hf_published.py: their
shapes, totals and where each config.json was found; `hf_overrides`: test_hf_overrides.py)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import pytest

from moeserve.config import ConfigError, load_model_config
from moeserve.hf_config import deepseek, fields, glm
from moeserve.model_config import ModelConfig
from moeserve.presets import list_presets, load_preset
from tests.hf_published import (
    NEW_PRESETS,
    PUBLISHED,
    PUBLISHED_FP8,
    PUBLISHED_TOTALS,
    V3_MLA,
    write_checkpoint_config,
)


def _published(name: str) -> dict[str, Any]:
    """The published config.json: the preset less its moeserve_* keys, with the FP8
    quantization_config the bf16 preset drops put back."""
    hf = {k: v for k, v in load_preset(name).items() if not k.startswith("moeserve_")}
    if name in PUBLISHED_FP8:
        hf["quantization_config"] = PUBLISHED_FP8[name]
    return hf


@pytest.mark.parametrize("name", NEW_PRESETS)
def test_preset_loads_as_a_checkpoint_with_the_published_shapes(tmp_path: Path,
                                                               name: str) -> None:
    folder = write_checkpoint_config(tmp_path / name, load_preset(name))
    mc, is_preset = load_model_config(folder)
    assert not is_preset
    assert mc == load_model_config(name)[0]
    for key, want in PUBLISHED[name].items():
        got = getattr(mc, key)
        if isinstance(want, dict):
            got = {k: getattr(got, k) for k in want}
        assert got == want, f"{name}.{key}"
    assert mc.tokenizer == "byte" and mc.checkpoint_dtype == "bfloat16"
    assert all(mc.is_moe_layer(i) == (i not in mc.mlp_only_layers) for i in range(mc.num_layers))


@pytest.mark.parametrize("name", NEW_PRESETS)
def test_preset_is_the_published_config(name: str) -> None:
    preset = load_preset(name)
    assert set(k for k in preset if k.startswith("moeserve_")) == {"moeserve_description",
                                                                    "moeserve_tokenizer"}
    assert preset["moeserve_tokenizer"] == "byte"
    assert "quantization_config" not in preset
    if name in PUBLISHED_FP8:  # published FP8: the description says it is dropped
        assert "FP8 quantization_config is dropped" in preset["moeserve_description"]


@pytest.mark.parametrize("name", NEW_PRESETS)
def test_num_params_within_2_percent_of_the_published_total(name: str) -> None:
    n = ModelConfig.from_hf(load_preset(name)).num_params()
    assert abs(n / PUBLISHED_TOTALS[name] - 1) < 0.02, n


def _mtp_params(mc: ModelConfig) -> int:
    """One MTP module as DeepSeek / GLM checkpoints store it: a decoder layer (sparse), its own
    copies of the embedding and the head, eh_proj [h, 2h], and three norms."""
    h, v = mc.hidden_size, mc.vocab_size
    layer = dataclasses.replace(mc, num_layers=1, mlp_only_layers=(), vocab_size=0).num_params()
    return layer - h + 2 * v * h + 2 * h * h + 3 * h


def _fp8_block_scales(mc: ModelConfig, layers: int, moe_layers: int) -> int:
    """weight_scale_inv elements of DeepSeek's FP8 checkpoints: one per 128 x 128 block of every
    attention, dense-MLP and expert (routed and shared) linear."""
    def blocks(n: int, k: int) -> int:
        return math.ceil(n / 128) * math.ceil(k / 128)
    h, m, heads = mc.hidden_size, mc.mla, mc.num_heads
    attn = (blocks(m.q_lora_rank, h) + blocks(heads * m.qk_head_dim, m.q_lora_rank)
            + blocks(m.latent_dim, h) + blocks(heads * (m.qk_nope_head_dim + m.v_head_dim),
                                               m.kv_lora_rank)
            + blocks(h, heads * m.v_head_dim))
    dense = 3 * blocks(mc.intermediate_size, h)
    expert = 3 * blocks(mc.moe_intermediate_size, h)
    return (layers * attn + (layers - moe_layers) * dense
            + moe_layers * (mc.num_experts + 1) * expert)


def test_num_params_equals_the_published_checkpoints_tensor_totals() -> None:
    """The tensor totals of the published safetensors (gogongxt/python's reports, see the top),
    from the shapes alone: the bf16 checkpoints exactly, and the FP8 ones once their MTP layer
    and block scales are added."""
    def mc(name: str) -> ModelConfig:
        return ModelConfig.from_hf(load_preset(name))
    assert mc("deepseek-v2-lite").num_params() == 15_706_484_224  # V2-Lite-Chat, same shapes
    flash = mc("glm-4.7-flash")
    assert flash.num_params() + _mtp_params(flash) == 31_221_488_576
    v3 = mc("deepseek-v3")  # 61 layers + the MTP layer, 58 + 1 of them sparse
    assert (v3.num_params() + _mtp_params(v3) + _fp8_block_scales(v3, 62, 59)
            == 684_531_386_000)
    kimi = mc("kimi-k2")  # no MTP layer; each layer stores a rotary inv_freq of 56 (bf16)
    assert kimi.num_params() + _fp8_block_scales(kimi, 61, 60) + 61 * 56 == 1_026_470_731_056
    v32 = mc("deepseek-v3.2")  # V3's, and each of the 62 layers' indexer (wq_b and wk in FP8)
    index_scales = 62 * (math.ceil(64 * 128 / 128) * math.ceil(1536 / 128)
                         + math.ceil(128 / 128) * math.ceil(7168 / 128))
    assert (v32.num_params() + _mtp_params(v32) + _fp8_block_scales(v32, 62, 59) + index_scales
            == 685_396_921_376)


_MODEL_TYPE = {"DeepseekV2ForCausalLM": "deepseek_v2", "DeepseekV3ForCausalLM": "deepseek_v3",
               "Glm4MoeForCausalLM": "glm4_moe", "Glm4MoeLiteForCausalLM": "glm4_moe_lite",
               "GlmMoeDsaForCausalLM": "glm_moe_dsa", "DeepseekV32ForCausalLM": "deepseek_v32"}


def _transformers_config(name: str) -> Any:
    from transformers import AutoConfig

    hf = {k: v for k, v in load_preset(name).items()
          if not k.startswith("moeserve_") and k != "model_type"}
    # kimi_k2 is not a transformers model type: its architecture is DeepseekV3's
    return AutoConfig.for_model(_MODEL_TYPE[hf["architectures"][0]], **hf)


@pytest.mark.parametrize("name", NEW_PRESETS)
def test_transformers_builds_the_same_model(name: str) -> None:
    """transformers' own model of the preset (on the meta device: no memory) has num_params()
    parameters (its correction-bias buffers included) and its MoE layers where ours are."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(_transformers_config(name))
    total = sum(p.numel() for p in model.parameters())
    total += sum(b.numel() for n, b in model.named_buffers() if "correction_bias" in n)
    mc = ModelConfig.from_hf(load_preset(name))
    assert total == mc.num_params()
    sparse = [hasattr(layer.mlp, "gate") for layer in model.model.layers]
    assert sparse == [mc.is_moe_layer(i) for i in range(mc.num_layers)]


@pytest.mark.parametrize("name", NEW_PRESETS)
def test_a_config_saved_by_transformers_parses_the_same(name: str) -> None:
    """save_pretrained writes the derived fields (head_dim, qk_head_dim, rope_parameters, ...):
    a checkpoint re-saved by transformers parses to the same model."""
    saved = _transformers_config(name).to_diff_dict()
    saved["moeserve_tokenizer"] = "byte"
    published = ModelConfig.from_hf(load_preset(name))
    resaved = ModelConfig.from_hf(saved)
    if published.bos_token_id is None:  # GLM-4.7-Flash has none; transformers' default is 0
        resaved = dataclasses.replace(resaved, bos_token_id=None)
    assert resaved == published


@pytest.mark.parametrize("name", NEW_PRESETS)
def test_every_published_field_is_honoured_checked_or_inert(name: str) -> None:
    hf = _published(name)
    hf.pop("quantization_config", None)  # refused on purpose: see the next test
    arch = hf["architectures"][0]
    family = deepseek if arch.startswith("Deepseek") else glm
    unknown = set(hf) - set(fields.INERT) - fields.COMMON - set(family.KNOWN[arch])
    assert not unknown
    ModelConfig.from_hf(hf)
    for inert in (fields.INERT, deepseek.INERT):
        assert all(isinstance(why, str) and why for why in inert.values())


@pytest.mark.parametrize("name", list(PUBLISHED_FP8))
def test_the_published_fp8_config_loads_as_fp8(tmp_path: Path, name: str) -> None:
    """The published FP8 configs load through a checkpoint's path: the shape of the bf16 preset,
    with its FP8 block-scaled quantization recorded."""
    folder = write_checkpoint_config(tmp_path / name, _published(name))
    cfg = load_model_config(folder)[0]
    assert cfg.quantization is not None and cfg.quantization.format == "fp8"
    assert cfg.quantization.block == (128, 128)
    preset = load_model_config(name)[0]
    assert dataclasses.replace(cfg, quantization=None, tokenizer=preset.tokenizer) == preset


def test_nvfp4_and_int4_configs_are_recorded() -> None:
    hf = load_preset("glm-4.5")
    int4 = {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {
        "group_0": {"weights": {"num_bits": 4, "symmetric": True, "group_size": 32,
                                "strategy": "group", "type": "int"}}}}
    cfg = ModelConfig.from_hf(hf | {"quantization_config": int4})
    assert cfg.quantization.format == "int4" and cfg.quantization.group_size == 32
    nvfp4 = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16}
    assert ModelConfig.from_hf(hf | {"quantization_config": nvfp4}).quantization.format == (
        "nvfp4")


def test_a_compressed_tensors_config_is_refused_by_name() -> None:
    hf = load_preset("glm-4.5") | {"quantization_config": {
        "quant_method": "compressed-tensors", "format": "float-quantized"}}
    with pytest.raises(ConfigError, match="quantization_config.format='float-quantized' is not "
                                          "implemented"):
        ModelConfig.from_hf(hf)


def test_a_null_quantization_config_is_no_quantization() -> None:
    hf = load_preset("deepseek-v3")
    assert ModelConfig.from_hf(hf | {"quantization_config": None}) == ModelConfig.from_hf(hf)


@pytest.mark.parametrize("name", NEW_PRESETS)
def test_an_unknown_field_is_refused_by_name(name: str) -> None:
    with pytest.raises(ConfigError, match="not implemented for .*: brand_new_field"):
        ModelConfig.from_hf(load_preset(name) | {"brand_new_field": 1})


@pytest.mark.parametrize("name,edit,needle", [
    ("deepseek-v3", {"moe_layer_freq": 2}, "moe_layer_freq=2"),
    ("deepseek-v3", {"scoring_func": "softmax"}, "scoring_func='softmax'"),
    ("deepseek-v3", {"topk_method": "greedy"}, "topk_method='greedy'"),
    ("deepseek-v3", {"attention_bias": True}, "attention_bias=True"),
    ("deepseek-v3", {"head_dim": 128}, "head_dim 128 must equal qk_rope_head_dim 64"),
    ("deepseek-v3", {"rope_scaling": {"type": "longrope", "factor": 4.0}}, "longrope"),
    ("deepseek-v2-lite", {"norm_topk_prob": True}, "norm_topk_prob=True"),
    ("deepseek-v2-lite", {"scoring_func": "sigmoid"}, "scoring_func='sigmoid'"),
    ("kimi-k2", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ("glm-4.5", {"topk_method": "greedy"}, "topk_method='greedy'"),
    ("glm-4.7-flash", {"head_dim": 256}, "head_dim 256 must equal qk_rope_head_dim 64"),
    ("glm-4.7-flash", {"attention_bias": True}, "attention_bias=True"),
    ("glm-4.7-flash", {"first_k_dense_replace": 2}, "first_k_dense_replace 2 disagrees"),
    ("glm-5", {"indexer_rope_interleave": False}, "indexer_rope_interleave=False"),
    ("glm-5", {"rope_interleave": False}, "rope_interleave=False"),
    ("glm-5", {"moe_layer_freq": 2}, "moe_layer_freq=2"),
    ("glm-5", {"attention_bias": True}, "attention_bias=True"),
    ("glm-5", {"index_head_dim": 32}, "index_head_dim 32 must be >= qk_rope_head_dim 64"),
    ("glm-5", {"indexer_types": ["shared"] + ["full"] * 77}, "first entry must be 'full'"),
    ("glm-5", {"indexer_types": ["full"] * 77}, "indexer_types lists 77 layers, fewer than"),
    ("glm-5", {"indexer_types": ["full", "sparse"] * 39}, "'full' or 'shared' per layer"),
    ("glm-5", {"layer_types": ["full_attention"] * 78}, "deepseek_sparse_attention"),
    ("glm-5", {"mlp_layer_types": ["dense"] * 2 + ["sparse"] * 76},
     "first_k_dense_replace 3 disagrees"),
    ("deepseek-v3.2", {"indexer_rope_interleave": True}, "indexer_rope_interleave=True"),
    ("deepseek-v3.2", {"rope_interleave": False}, "rope_interleave=False"),
    ("deepseek-v3.2", {"q_lora_rank": None}, "DSA needs MLA with q_lora_rank"),
    ("deepseek-v3.2", {"mlp_bias": True}, "mlp_bias=True"),
    ("deepseek-v3.2", {"indexer_types": ["full"] * 61}, "not implemented for "
                                                        "DeepseekV32ForCausalLM: indexer_types"),
])
def test_a_checked_field_at_another_value_is_refused_by_name(name: str, edit: dict,
                                                             needle: str) -> None:
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        ModelConfig.from_hf(load_preset(name) | edit)


def test_kimi_k2_model_type_parses_as_deepseek_v3() -> None:
    hf = load_preset("kimi-k2")
    assert hf["model_type"] == "kimi_k2" and hf["architectures"] == ["DeepseekV3ForCausalLM"]
    mc = ModelConfig.from_hf(hf)
    assert mc.architecture == "DeepseekV3ForCausalLM" and mc.mla == V3_MLA
    assert ModelConfig.from_hf(hf | {"model_type": "deepseek_v3"}) == mc


def test_glm_num_local_experts_is_n_routed_experts() -> None:
    hf = load_preset("glm-4.5-air")
    alias = {k: v for k, v in hf.items() if k != "n_routed_experts"} | {"num_local_experts": 128}
    assert ModelConfig.from_hf(alias) == ModelConfig.from_hf(hf)


@pytest.mark.parametrize("name", list_presets())
def test_preset_ids_are_valid_for_the_byte_tokenizer(name: str) -> None:
    from moeserve.tokenizer import ByteTokenizer, load_tokenizer

    mc = ModelConfig.from_hf(load_preset(name))
    tok = load_tokenizer(None, mc.tokenizer, mc)
    assert isinstance(tok, ByteTokenizer) and tok.vocab_size == mc.vocab_size
    assert all(0 <= i < mc.vocab_size for i in (*mc.eos_token_ids, mc.bos_token_id or 0))
    assert tok.decode(tok.encode("héllo")) == "héllo"


# --- DeepSeek Sparse Attention --------------------------------------------------------------


@pytest.mark.parametrize("schedule", [
    {}, {"index_topk_freq": 4, "index_skip_topk_offset": 3}, {"index_topk_freq": 2},
    {"index_topk_pattern": "FFSSFS"}, {"index_topk_pattern": ["full", "shared"] * 3},
    {"indexer_types": ["full", "shared", "shared", "full", "full", "shared"]},
])
def test_glm5_indexer_types_follow_transformers_schedule(schedule: dict) -> None:
    """indexer_types, else index_topk_pattern, else index_topk_freq / index_skip_topk_offset:
    the layers GlmMoeDsaConfig makes "full" and "shared"; a shared layer's selection comes
    from the last full layer before it."""
    from transformers import GlmMoeDsaConfig

    hf = load_preset("glm-5") | {"num_hidden_layers": 6} | schedule
    dsa = ModelConfig.from_hf(hf).dsa
    assert dsa.indexer_types == tuple(GlmMoeDsaConfig(num_hidden_layers=6,
                                                      **schedule).indexer_types)
    for i in range(6):
        src = dsa.source_layer(i)
        assert dsa.is_full(src) and all(not dsa.is_full(j) for j in range(src + 1, i + 1))


def test_dsa_presets_slice_and_count_the_indexer_per_full_layer() -> None:
    """hf_overrides slices GLM-5 to 4 layers (its schedule derived for 4); num_params counts
    one indexer per full layer, and the cache one indexer key per full layer."""
    mc, _ = load_model_config("glm-5", {"num_hidden_layers": 4, "index_topk_freq": 2})
    assert mc.dsa.indexer_types == ("full", "full", "shared", "full")
    assert mc.index_cache_layers == 3
    dense = dataclasses.replace(mc, dsa=None)
    per_indexer = 2048 * 32 * 128 + 6144 * 128 + 2 * 128 + 6144 * 32
    assert mc.num_params() - dense.num_params() == 3 * per_indexer
    assert mc.cache_elems_per_token() == 4 * 576 + 3 * 128
    assert mc.cache_elems_per_token(indexer_cache=False) == 4 * 576
