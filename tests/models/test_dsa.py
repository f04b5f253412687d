"""DeepSeek Sparse Attention at the model level, against transformers' own GLM-5 / DeepSeek-V3.2
(tiny checkpoints, index_topk 8): the selection drops the tokens beyond index_topk and is the one
transformers' indexer makes; chunked prefill (a prefix hit's shape: queries after cached
positions) keeps prefill logits within 1e-4; a context of at most index_topk runs dense MLA,
with the same result as the sparse path selecting everything.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch
from transformers import PreTrainedModel

from moeserve.kernels.attention.metadata import build_attention_metadata
from tests.models.checkpoints import hf_logits
from tests.models.test_models_vs_hf import BLOCK_SIZE, _block_tables, _build, assert_logits_close

DSA = ("glm_moe_dsa", "deepseek_v32")
TOPK = 8


@pytest.mark.parametrize("variant", DSA)
@torch.inference_mode()
def test_selection_drops_tokens_beyond_topk_as_transformers_does(
        variant: str, tiny_checkpoint: Callable[[str], str],
        hf_model: Callable[[str], PreTrainedModel]) -> None:
    """A 40-token prefill: query p keeps min(p + 1, 8) causal positions (every one when
    p < 8, 8 of p + 1 after), and they are the positions transformers' indexer returns (its
    picks beyond the causal ones, made when p < 7, are masked out by its attention)."""
    model, cfg, _ = _build(tiny_checkpoint(variant), "torch")
    hf = hf_model(variant)
    captured: dict[int, torch.Tensor] = {}
    hooks = [layer.self_attn.indexer.register_forward_hook(
        lambda _m, _i, out, i=i: captured.__setitem__(i, out[0]))  # [S, topk]
        for i, layer in enumerate(hf.model.layers) if layer.self_attn.indexer is not None]
    prompt = [random.Random(7).randrange(cfg.vocab_size) for _ in range(40)]
    hf_logits(hf, prompt)
    for hook in hooks:
        hook.remove()
    for layer in model.dsa_layers():
        if layer.indexer is not None:
            layer.indexer.count_ties = True
    meta = build_attention_metadata([0], [40], _block_tables(random.Random(0), (40,)),
                                    BLOCK_SIZE, "cpu")
    model(torch.tensor(prompt), meta.positions, meta)
    full_layers = [i for i, a in enumerate(model.dsa_layers()) if a.indexer is not None]
    assert sorted(captured) == full_layers
    for i in full_layers:
        ours = meta.derived[("dsa_topk", i, "auto")]  # [40, topk] int32, -1 = none
        assert ours.shape == (40, TOPK)
        for p in range(40):
            picked = [s for s in ours[p].tolist() if s >= 0]
            assert len(picked) == len(set(picked)) == min(p + 1, TOPK)
            assert all(s <= p for s in picked)  # causal; p + 1 - 8 positions dropped
            theirs = {s for s in captured[i][p].tolist() if s <= p}
            assert set(picked) == theirs, (i, p)
        assert model.dsa_layers()[i].indexer.boundary_ties == 0


@pytest.mark.parametrize("variant", DSA)
@torch.inference_mode()
def test_chunked_prefill_logits_match_hf(variant: str, tiny_checkpoint: Callable[[str], str],
                                         hf_model: Callable[[str], PreTrainedModel]) -> None:
    """A 45-token prompt in chunks [0, 5) (a context within index_topk: dense), [5, 13),
    [13, 29), [29, 45) (sparse, queries after cached positions as on a prefix hit): every
    position's logits within 1e-4 of transformers' one-pass prefill."""
    model, cfg, _ = _build(tiny_checkpoint(variant), "torch")
    hf = hf_model(variant)
    prompt = [random.Random(3).randrange(cfg.vocab_size) for _ in range(45)]
    table = _block_tables(random.Random(1), (45,))
    bounds = (0, 5, 13, 29, 45)
    logits = []
    for start, end in zip(bounds, bounds[1:], strict=False):
        meta = build_attention_metadata([start], [end - start], table, BLOCK_SIZE, "cpu")
        hidden = model(torch.tensor(prompt[start:end]), meta.positions, meta)
        logits.append(model.compute_logits(hidden))
    sparse = [a.tokens_sparse for a in model.dsa_layers()]
    assert all(n == 45 - 5 for n in sparse)  # every chunk after the first (context > 8)
    assert_logits_close(torch.cat(logits), hf_logits(hf, prompt))


@pytest.mark.parametrize("variant", DSA)
@torch.inference_mode()
def test_within_topk_dense_equals_sparse(variant: str,
                                         tiny_checkpoint: Callable[[str], str]) -> None:
    """Contexts of 3, 8 (= index_topk) and 6 tokens: "auto" runs dense MLA (no indexer
    query); the sparse path forced on them selects every position and gives the same logits."""
    model, cfg, _ = _build(tiny_checkpoint(variant), "torch")
    rng = random.Random(5)
    lens = (3, 8, 6)
    prompts = [t for n in lens for t in (rng.randrange(cfg.vocab_size) for _ in range(n))]
    tables = _block_tables(rng, lens)
    out = {}
    for mode in ("auto", "sparse"):
        model.set_dsa_mode(mode)
        meta = build_attention_metadata([0] * 3, list(lens), tables, BLOCK_SIZE, "cpu")
        out[mode] = model.compute_logits(model(torch.tensor(prompts), meta.positions, meta))
        sparse = [a.tokens_sparse for a in model.dsa_layers()]
        assert sparse == [0 if mode == "auto" else sum(lens)] * cfg.num_layers
        if mode == "sparse":
            chosen = meta.derived[("dsa_topk", 0, "sparse")]
            assert ((chosen >= 0).sum(-1) == meta.positions + 1).all()  # everything
    assert_logits_close(out["sparse"], out["auto"])
    assert (out["sparse"] - out["auto"]).abs().max() <= 1e-5 * out["auto"].abs().max()


def test_set_dsa_mode_is_validated(tiny_checkpoint: Callable[[str], str]) -> None:
    model, _, _ = _build(tiny_checkpoint("glm_moe_dsa"), "torch")
    with pytest.raises(ValueError, match="dsa mode must be one of auto, dense, sparse"):
        model.set_dsa_mode("topk")


@torch.inference_mode()
def test_a_full_layer_without_its_indexer_cache_runs_dense_only(
        tiny_checkpoint: Callable[[str], str]) -> None:
    """The latent alone bound to a full layer (dsa="dense"'s allocation): "dense" runs, any
    other mode says why it cannot."""
    from moeserve.runner.kv_cache import MemoryPlan, allocate_kv_caches

    model, cfg, _ = _build(tiny_checkpoint("glm_moe_dsa"), "torch")
    plan = MemoryPlan("cpu", 0, 0, 0, 0, 0, 0, 0, 16, BLOCK_SIZE, "")
    model.bind_kv_caches(allocate_kv_caches(cfg, plan, torch.float32, "cpu",
                                            indexer_cache=False))
    meta = build_attention_metadata([0], [12], [[1, 2, 3, 4]], BLOCK_SIZE, "cpu")
    ids = torch.arange(12)
    with pytest.raises(RuntimeError, match="no indexer key cache bound"):
        model(ids, meta.positions, meta)
    model.set_dsa_mode("dense")
    meta = build_attention_metadata([0], [12], [[1, 2, 3, 4]], BLOCK_SIZE, "cpu")
    assert model(ids, meta.positions, meta).shape == (12, cfg.hidden_size)


@pytest.mark.parametrize("variant", DSA)
@torch.inference_mode()
def test_fused_indexer_launches_match_the_torch_ops(
        variant: str, tiny_checkpoint: Callable[[str], str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The indexer's fused key write and query RoPE (Indexer.fused, the Triton launches)
    forced on CPU under the interpreter: the chunked prefill's logits and indexer caches as
    the torch ops give them (fp32: the key norm's sums in another order, within 1e-5 of the
    largest magnitude), once a full layer and chunk each; unforced, the CPU runs neither."""
    from moeserve.layers import dsa as dsa_layer

    calls: list[str] = []
    for name in ("indexer_keys_triton", "indexer_q_rope_triton"):
        real = getattr(dsa_layer, name)
        monkeypatch.setattr(dsa_layer, name, lambda *a, real=real, name=name, **k: (
            calls.append(name), real(*a, **k))[1])
    model, cfg, kv = _build(tiny_checkpoint(variant), "torch")
    prompt = [random.Random(3).randrange(cfg.vocab_size) for _ in range(29)]
    table = _block_tables(random.Random(1), (29,))
    full = [a for a in model.dsa_layers() if a.indexer is not None]
    assert full

    def run() -> list[torch.Tensor]:
        logits = []
        for start, end in ((0, 5), (5, 13), (13, 29)):
            meta = build_attention_metadata([start], [end - start], table, BLOCK_SIZE, "cpu")
            logits.append(model.compute_logits(
                model(torch.tensor(prompt[start:end]), meta.positions, meta)))
        return [torch.cat(logits)] + [a.index_cache.clone() for a in full]
    want = run()
    assert not calls
    for a in full:
        a.indexer.fused = True
    got = run()
    # keys every chunk; queries on the two sparse chunks (the first is within index_topk)
    assert calls.count("indexer_keys_triton") == 3 * len(full)
    assert calls.count("indexer_q_rope_triton") == 2 * len(full)
    for g, w in zip(got, want, strict=True):
        assert (g - w).abs().max() <= 1e-5 * w.abs().max()
