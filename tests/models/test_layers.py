"""RMSNorm and RoPE against transformers' own functions (bf16 bitwise, fp32 to ~1 ulp); the
MLA layer's absorbed query buffer (q_rope written in place)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import Glm4MoeConfig
from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeRotaryEmbedding
from transformers.models.glm4_moe.modeling_glm4_moe import (
    apply_rotary_pos_emb as glm4_apply_rotary_pos_emb,
)
from transformers.models.qwen3_moe.modeling_qwen3_moe import (
    Qwen3MoeRMSNorm,
    Qwen3MoeRotaryEmbedding,
    apply_rotary_pos_emb,
)

from moeserve.kernels.attention.metadata import build_attention_metadata
from moeserve.kernels.attention.mla.reference import mla_attention_ref
from moeserve.layers import mla as mla_module
from moeserve.layers.mla import MLAttention
from moeserve.layers.norm import RMSNorm
from moeserve.layers.rope import RotaryEmbedding
from moeserve.model_config import ModelConfig
from tests.models.checkpoints import tiny_hf_config, write_tiny_checkpoint


def test_rms_norm_matches_hf_bitwise_in_bf16() -> None:
    torch.manual_seed(0)
    x = (torch.randn(7, 3, 64) * 5).bfloat16()
    ours, hf = RMSNorm(64, 1e-6, torch.bfloat16), Qwen3MoeRMSNorm(64, eps=1e-6).bfloat16()
    with torch.no_grad():
        ours.weight.copy_(torch.randn(64))
        hf.weight.copy_(ours.weight)
    assert torch.equal(ours(x), hf(x))


def test_rope_matches_hf() -> None:
    torch.manual_seed(0)
    cfg = tiny_hf_config("qwen3_moe", rope_parameters={"rope_type": "default",
                                                       "rope_theta": 1e6})
    hf_rope = Qwen3MoeRotaryEmbedding(cfg)
    rope = RotaryEmbedding(16, cfg.max_position_embeddings, 1e6)
    positions = torch.tensor([0, 1, 2, 300, 511, 7])  # [T]
    for dtype, tol in ((torch.float32, 2e-6), (torch.bfloat16, 1e-2)):
        q, k = torch.randn(6, 4, 16, dtype=dtype), torch.randn(6, 2, 16, dtype=dtype)
        cos, sin = hf_rope(q, positions[None])  # [1, T, D]
        hq, hk = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
        oq, ok = rope(positions, q, k)
        torch.testing.assert_close(oq, hq[0].transpose(0, 1), atol=tol, rtol=0)
        torch.testing.assert_close(ok, hk[0].transpose(0, 1), atol=tol, rtol=0)
    assert not torch.allclose(oq, q)  # position 1.. really rotates


def test_partial_rope_matches_hf_glm4_moe() -> None:
    """GLM-4.5's partial rotary (partial_rotary_factor 0.5, transformers' default for glm4_moe):
    head_dim 16, the first 8 dims rotate, the last 8 pass through."""
    torch.manual_seed(0)
    cfg = Glm4MoeConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16, max_position_embeddings=512)
    assert cfg.rope_parameters["partial_rotary_factor"] == 0.5
    hf_rope = Glm4MoeRotaryEmbedding(cfg)
    rope = RotaryEmbedding(16, cfg.max_position_embeddings, cfg.rope_parameters["rope_theta"],
                           rotary_dim=8)
    positions = torch.tensor([0, 1, 2, 300, 511, 7])  # [T]
    for dtype, tol in ((torch.float32, 2e-6), (torch.bfloat16, 1e-2)):
        q, k = torch.randn(6, 4, 16, dtype=dtype), torch.randn(6, 2, 16, dtype=dtype)
        cos, sin = hf_rope(q, positions[None])  # [1, T, 8]
        assert cos.shape[-1] == 8
        hq, hk = glm4_apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                           cos, sin)
        oq, ok = rope(positions, q, k)
        torch.testing.assert_close(oq, hq[0].transpose(0, 1), atol=tol, rtol=0)
        torch.testing.assert_close(ok, hk[0].transpose(0, 1), atol=tol, rtol=0)
        assert torch.equal(oq[..., 8:], q[..., 8:]) and torch.equal(ok[..., 8:], k[..., 8:])
    assert not torch.allclose(oq[..., :8], q[..., :8])


@pytest.mark.parametrize("limit", (1 << 18, 0), ids=("buffer", "own_tensor"))
@torch.inference_mode()
def test_mla_hands_the_absorbed_attention_q_rope_in_its_query_buffer(
        limit: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """MLAttention.pre_attention(latent_query=True), the forward's, writes q_rope into the
    absorbed query's last R columns (`Projected.q_lat`) when T x H is at most
    LATENT_QUERY_MAX_ROWS (else, and by default, q_rope is its own tensor), and `_absorbed`
    then fills that buffer instead of a new one: the attention's output is the same either way
    (fp32, bit for bit: the same ops on the same values)."""
    monkeypatch.setattr(mla_module, "LATENT_QUERY_MAX_ROWS", limit)
    cfg = ModelConfig.from_file(str(Path(write_tiny_checkpoint("deepseek_v3", tmp_path))
                                    / "config.json"))
    layer = MLAttention(0, cfg, mla_attention_ref, torch.float32, "cpu")
    gen = torch.Generator().manual_seed(5)
    for p in layer.parameters():
        p.copy_(torch.randn(p.shape, generator=gen) * 0.1 + (p.dim() == 1))
    block, cached = 4, [3, 5, 0, 9]
    layer.kv_cache = torch.randn(16, block, layer.kv_lora_rank + layer.rope_dim, generator=gen)
    t = len(cached)
    hidden = torch.randn(t, layer.in_proj.shape[1], generator=gen)
    need = [-(-(n + 1) // block) for n in cached]
    first = np.cumsum([1, *need[:-1]]).tolist()
    tables = [list(range(f, f + n)) for f, n in zip(first, need, strict=True)]
    meta = build_attention_metadata(cached, [1] * t, tables, block, "cpu")
    assert layer.pre_attention(meta.positions, hidden, meta.slot_mapping).proj.q_lat is None
    state = layer.pre_attention(meta.positions, hidden, meta.slot_mapping, latent_query=True)
    rank, width = layer.kv_lora_rank, layer.kv_lora_rank + layer.rope_dim
    q_lat = state.proj.q_lat
    assert (q_lat is not None) == (limit > 0)
    if q_lat is not None:
        assert q_lat.shape == (t, layer.num_heads, width)
        assert state.q_rope.data_ptr() == q_lat[..., rank:].data_ptr()
        assert state.q_rope.stride() == q_lat[..., rank:].stride()
    made = []
    real_new_empty = torch.Tensor.new_empty

    def counted(self: torch.Tensor, *size: object, **kw: object) -> torch.Tensor:
        made.append(size)
        return real_new_empty(self, *size, **kw)

    monkeypatch.setattr(torch.Tensor, "new_empty", counted)
    got = layer.attention_core(state, meta)
    monkeypatch.setattr(torch.Tensor, "new_empty", real_new_empty)
    assert (sum(1 for size in made if size[-1] == width) == 0) == (limit > 0)
    want = layer._absorbed(state.q_nope, state.q_rope.clone(), meta)
    assert torch.equal(got, want)
