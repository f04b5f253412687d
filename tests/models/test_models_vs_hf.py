"""Our forward of every family against transformers' own, on tiny random checkpoints: one
batched prefill of 3 prompts over the paged KV cache, then one decode step. The DSA models
(index_topk 8) run both paths in each step: the 11-token prompt sparse, the others dense."""

from __future__ import annotations

import os
import random
from collections.abc import Callable

import pytest
import torch
from transformers import PreTrainedModel

from moeserve.kernels.attention.metadata import build_attention_metadata
from moeserve.model_config import ModelConfig
from moeserve.models import build_model
from moeserve.models.decoder import CausalLM
from moeserve.runner.kv_cache import LayerCache, MemoryPlan, allocate_kv_caches
from moeserve.runner.weights.loader import load_weights
from tests.models.checkpoints import hf_logits
from tests.models.conftest import MLA_VARIANTS, VARIANTS

PROMPT_LENS = (5, 11, 8)
BLOCK_SIZE = 4
NUM_BLOCKS = 16


def assert_logits_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """max |actual - expected| <= 1e-4 * max |expected|."""
    assert actual.shape == expected.shape
    err = (actual - expected).abs().max().item()
    bound = 1e-4 * expected.abs().max().item()
    assert err <= bound, f"max abs error {err:.3g} > {bound:.3g}"


def _build(folder: str, moe_backend: str) -> tuple[CausalLM, ModelConfig, list[LayerCache]]:
    cfg = ModelConfig.from_file(os.path.join(folder, "config.json"))
    model = build_model(cfg, torch.float32, "cpu", moe_backend, "torch")
    load_weights(model, cfg, folder)
    plan = MemoryPlan("cpu", 0, 0, 0, 0, 0, 0, 0, NUM_BLOCKS, BLOCK_SIZE, "")
    kv = allocate_kv_caches(cfg, plan, torch.float32, "cpu")  # GQA K/V, MLA latent, DSA both
    model.bind_kv_caches(kv)
    return model, cfg, kv


def _block_tables(rng: random.Random, lens: tuple[int, ...]) -> list[list[int]]:
    """Scattered, distinct blocks (never the null block 0), room for one more token each."""
    free = list(range(1, NUM_BLOCKS))
    rng.shuffle(free)
    return [[free.pop() for _ in range(n // BLOCK_SIZE + 1)] for n in lens]


@pytest.mark.parametrize("moe_backend", ["torch", "grouped_mm"])
@pytest.mark.parametrize("variant", list(VARIANTS) + [f"{v}-absorbed" for v in MLA_VARIANTS])
@torch.inference_mode()
def test_prefill_then_decode_match_hf(variant: str, moe_backend: str,
                                      tiny_checkpoint: Callable[[str], str],
                                      hf_model: Callable[[str], PreTrainedModel]) -> None:
    """MLA: the prefill up-projected (or, "-absorbed", through the latent like decode), the
    decode absorbed."""
    torch.manual_seed(0)
    rng = random.Random(0)
    variant, _, form = variant.partition("-")
    model, cfg, kv = _build(tiny_checkpoint(variant), moe_backend)
    for layer in model.model.layers:
        if form:
            layer.self_attn.prefill_form = form
    hf = hf_model(variant)
    prompts = [[rng.randrange(cfg.vocab_size) for _ in range(n)] for n in PROMPT_LENS]
    tables = _block_tables(rng, PROMPT_LENS)

    meta = build_attention_metadata([0, 0, 0], list(PROMPT_LENS), tables, BLOCK_SIZE, "cpu")
    input_ids = torch.tensor([t for p in prompts for t in p])  # [T]
    logits = model.compute_logits(model(input_ids, meta.positions, meta))  # [T, V]
    assert logits.dtype == torch.float32
    starts = meta.query_start_loc.tolist()
    for i, prompt in enumerate(prompts):
        assert_logits_close(logits[starts[i]:starts[i + 1]], hf_logits(hf, prompt))

    # decode: one new token per prompt, continuing in the same KV cache
    new_tokens = logits[[s - 1 for s in starts[1:]]].argmax(-1).tolist()  # [3]
    meta = build_attention_metadata(list(PROMPT_LENS), [1, 1, 1], tables, BLOCK_SIZE, "cpu")
    assert meta.positions.tolist() == list(PROMPT_LENS)
    logits = model.compute_logits(model(torch.tensor(new_tokens), meta.positions, meta))
    for i, prompt in enumerate(prompts):
        assert_logits_close(logits[i], hf_logits(hf, prompt + [new_tokens[i]])[-1])
    first = kv[0].latent if cfg.dsa is not None else kv[0]
    assert model.model.layers[0].self_attn.kv_cache is first  # bound tensors are kept as is


def test_sparse_layers_follow_config(tiny_checkpoint: Callable[[str], str]) -> None:
    """mlp_only_layers and decoder_sparse_step choose which layers get experts."""
    kinds = {}
    for variant in ("qwen3_moe_norm", "qwen3_moe_step2", "qwen3_tied", "mixtral"):
        model, _, _ = _build(tiny_checkpoint(variant), "torch")
        kinds[variant] = [type(layer.mlp).__name__ for layer in model.model.layers]
    assert kinds["qwen3_moe_norm"] == ["MLP", "SparseMoeBlock", "SparseMoeBlock"]
    assert kinds["qwen3_moe_step2"] == ["MLP", "SparseMoeBlock", "MLP"]
    assert kinds["qwen3_tied"] == ["MLP"] * 3
    assert kinds["mixtral"] == ["SparseMoeBlock"] * 3


def test_unbound_kv_cache_is_an_error(tiny_checkpoint: Callable[[str], str]) -> None:
    model, _, _ = _build(tiny_checkpoint("qwen3_tied"), "torch")
    model.bind_kv_caches([])
    meta = build_attention_metadata([0], [2], [[1]], BLOCK_SIZE, "cpu")
    with pytest.raises(RuntimeError, match="no KV cache bound"):
        model(torch.tensor([1, 2]), meta.positions, meta)
    with pytest.raises(ValueError, match="2 KV caches for 3 layers"):
        model.bind_kv_caches([torch.zeros(1)] * 2)
