"""Weight loading (strict name map, shards, fused expert layout) and dummy weights."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable

import pytest
import torch
from safetensors.torch import load_file, save_file

from moeserve.kernels.attention.metadata import build_attention_metadata
from moeserve.kernels.routing.select import select_experts
from moeserve.model_config import ModelConfig
from moeserve.models import build_model
from moeserve.models.decoder import CausalLM
from moeserve.runner.weights.loader import (
    INDEX_FILE,
    WeightLoadError,
    init_dummy_weights,
    load_weights,
    model_weight_bytes,
)
from tests.models.checkpoints import write_tiny_checkpoint


def _load(folder: str) -> CausalLM:
    cfg = ModelConfig.from_file(os.path.join(folder, "config.json"))
    model = build_model(cfg, torch.float32, "cpu", "torch", "torch")
    load_weights(model, cfg, folder)
    return model


def _edited_copy(src: str, dst: str, edit: Callable[[dict[str, torch.Tensor]], None]) -> str:
    """A copy of the single-file checkpoint `src` with its tensors changed by `edit`."""
    os.makedirs(dst)
    shutil.copy(os.path.join(src, "config.json"), dst)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    edit(tensors)
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    return dst


def test_packed_params_hold_the_hf_tensors(tiny_checkpoint: Callable[[str], str]) -> None:
    folder = tiny_checkpoint("mixtral")
    model, hf = _load(folder), load_file(os.path.join(folder, "model.safetensors"))
    attn, moe = model.model.layers[1].self_attn, model.model.layers[1].mlp
    p = "model.layers.1."
    assert torch.equal(attn.qkv_proj, torch.cat([hf[p + f"self_attn.{n}_proj.weight"]
                                                 for n in "qkv"]))
    assert torch.equal(moe.w13[5], torch.cat([hf[p + "block_sparse_moe.experts.5.w1.weight"],
                                              hf[p + "block_sparse_moe.experts.5.w3.weight"]]))
    assert torch.equal(moe.w2[5], hf[p + "block_sparse_moe.experts.5.w2.weight"])
    assert torch.equal(moe.gate, hf[p + "block_sparse_moe.gate.weight"])
    assert torch.equal(model.lm_head, hf["lm_head.weight"])


def test_sharded_and_tied_checkpoints(tiny_checkpoint: Callable[[str], str]) -> None:
    sharded = tiny_checkpoint("qwen3_moe_norm")
    assert os.path.exists(os.path.join(sharded, INDEX_FILE))
    assert len([f for f in os.listdir(sharded) if f.endswith(".safetensors")]) > 2
    model = _load(sharded)
    mlp = model.model.layers[0].mlp  # mlp_only layer: dense
    assert torch.isfinite(mlp.gate_up_proj).all() and mlp.gate_up_proj.abs().sum() > 0
    tied = _load(tiny_checkpoint("qwen3_tied"))
    assert tied.lm_head is None


def test_tied_checkpoint_with_lm_head_skips_it(tiny_checkpoint: Callable[[str], str],
                                                tmp_path: str) -> None:
    """Some tied checkpoints still carry lm_head.weight: it is not an unexpected tensor."""
    folder = _edited_copy(tiny_checkpoint("qwen3_tied"), tmp_path / "ckpt",
                          lambda t: t.update({"lm_head.weight": torch.zeros(256, 64)}))
    model = _load(folder)
    assert model.lm_head is None and model.model.embed_tokens.abs().sum() > 0


def test_fused_expert_layout_loads_the_same(tmp_path: str) -> None:
    for arch in ("qwen3_moe", "mixtral"):
        per_expert = _load(write_tiny_checkpoint(arch, tmp_path / f"{arch}_a", seed=3))
        fused_dir = write_tiny_checkpoint(arch, tmp_path / f"{arch}_b", seed=3,
                                          fused_experts=True)
        assert "model.layers.0.mlp.experts.gate_up_proj" in load_file(
            os.path.join(fused_dir, "model.safetensors"))
        fused = _load(fused_dir)
        for (name, a), (_, b) in zip(per_expert.named_parameters(), fused.named_parameters()):
            assert torch.equal(a, b), name


def test_missing_tensor_is_named(tiny_checkpoint: Callable[[str], str], tmp_path: str) -> None:
    name = "model.layers.2.block_sparse_moe.experts.3.w2.weight"
    folder = _edited_copy(tiny_checkpoint("mixtral"), tmp_path / "ckpt",
                          lambda t: t.pop(name))
    with pytest.raises(WeightLoadError, match=f"missing tensor.*{name}"):
        _load(folder)


def test_unexpected_tensor_is_named(tiny_checkpoint: Callable[[str], str], tmp_path: str) -> None:
    name = "model.layers.0.self_attn.rogue_proj.weight"
    folder = _edited_copy(tiny_checkpoint("qwen3_moe_nonorm"), tmp_path / "ckpt",
                          lambda t: t.update({name: torch.zeros(4, 4)}))
    with pytest.raises(WeightLoadError, match=f"unexpected tensor.*{name}"):
        _load(folder)


def test_wrong_shape_is_named(tiny_checkpoint: Callable[[str], str], tmp_path: str) -> None:
    name = "model.layers.1.self_attn.k_proj.weight"
    folder = _edited_copy(tiny_checkpoint("qwen3_moe_nonorm"), tmp_path / "ckpt",
                          lambda t: t.update({name: torch.zeros(16, 64)}))
    with pytest.raises(WeightLoadError, match=rf"{name} has shape \[16, 64\].*\[32, 64\]"):
        _load(folder)


def test_missing_shard_file_is_named(tiny_checkpoint: Callable[[str], str],
                                     tmp_path: str) -> None:
    folder = shutil.copytree(tiny_checkpoint("qwen3_moe_norm"), tmp_path / "ckpt")
    shard = sorted(f for f in os.listdir(folder) if f.startswith("model-"))[1]
    os.remove(os.path.join(folder, shard))
    with pytest.raises(WeightLoadError, match=f"shard file {shard} .* is missing"):
        _load(str(folder))


def test_no_weights_at_all(tmp_path: str, tiny_checkpoint: Callable[[str], str]) -> None:
    shutil.copy(os.path.join(tiny_checkpoint("mixtral"), "config.json"), tmp_path)
    with pytest.raises(WeightLoadError, match="no model.safetensors"):
        _load(str(tmp_path))


def _dummy_config() -> ModelConfig:
    return ModelConfig(architecture="Qwen3MoeForCausalLM", vocab_size=512, hidden_size=512,
                       num_layers=4, num_heads=8, num_kv_heads=4, head_dim=64,
                       intermediate_size=1024, num_experts=8, num_experts_per_tok=2,
                       moe_intermediate_size=256, mlp_only_layers=(0,), qk_norm=True,
                       max_position_embeddings=256)


@torch.inference_mode()
def test_dummy_weights_give_finite_logits_and_spread_routing_in_bf16() -> None:
    cfg = _dummy_config()
    model = build_model(cfg, torch.bfloat16, "cpu", "torch", "torch")
    init_dummy_weights(model, seed=7)
    assert model_weight_bytes(model) == cfg.num_params() * 2
    assert torch.equal(model.model.layers[1].input_layernorm.weight,
                       torch.ones(cfg.hidden_size, dtype=torch.bfloat16))
    model.bind_kv_caches([torch.zeros(2, 8, 16, 4, 64, dtype=torch.bfloat16)
                          for _ in range(cfg.num_layers)])
    moe_inputs = []
    last_moe = model.model.layers[-1].mlp
    last_moe.register_forward_hook(lambda mod, args, out: moe_inputs.append(args[0]))
    ids = torch.randint(0, cfg.vocab_size, (96,), generator=torch.Generator().manual_seed(0))
    meta = build_attention_metadata([0, 0], [64, 32], [[1, 2, 3, 4], [5, 6]], 16, "cpu")
    logits = model.compute_logits(model(ids, meta.positions, meta))  # [96, V]
    assert torch.isfinite(logits).all() and logits.std() > 0.1

    # the tokens reaching the last layer's router still differ: every expert gets some
    _, topk_ids = select_experts(moe_inputs[0] @ last_moe.gate.T, 2, True)
    counts = torch.bincount(topk_ids.flatten(), minlength=cfg.num_experts).float()
    assert counts.min() > 0 and counts.max() < 2.5 * counts.mean(), counts

    again = build_model(cfg, torch.bfloat16, "cpu", "torch", "torch")
    init_dummy_weights(again, seed=7)
    assert torch.equal(again.model.layers[3].mlp.w13, model.model.layers[3].mlp.w13)


def test_checkpoint_has_a_byte_tokenizer(tiny_checkpoint: Callable[[str], str]) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(tiny_checkpoint("mixtral"), "tokenizer.json"))
    text = "héllo wörld!\n\x00"
    ids = tok.encode(text).ids
    assert ids == list(text.encode("utf-8"))
    assert tok.get_vocab_size() == 256 and tok.decode(ids) == text
