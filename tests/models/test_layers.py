"""RMSNorm and RoPE against transformers' own functions (bf16 bitwise, fp32 to ~1 ulp)."""

from __future__ import annotations

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

from moeserve.layers.norm import RMSNorm
from moeserve.layers.rope import RotaryEmbedding
from tests.models.checkpoints import tiny_hf_config


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
