"""The engine with kv_cache_dtype="fp8": the KV cache in float8 e4m3 (half of bf16's bytes, a
quarter of fp32's): GQA's K/V, MLA's latent rows (DSA's indexer keys stay in the model's dtype).

- The memory plan counts the cache's bytes: the same budget holds 4x the tokens of an fp32
  cache, and the capacity report says the element type.
- Serving with it equals serving with a cache in the model's dtype that holds the same
  rounded values (the write rule of kernels/attention/paged.py's to_cache_dtype applied before
  an fp32 cache), token for token and logprob for logprob, through chunked prefill, prefix
  hits and preemption; and differs from the unrounded cache (the e4m3 path really ran).
- The Triton attention reads the same tokens as the torch reference over the e4m3 cache.
- The same for MLA's latent cache (DeepSeek-V3, GLM-4.7-Flash, GLM-5 with DSA's selection),
  with the Triton MLA kernels; an unknown element type is refused by name.
"""

from __future__ import annotations

import functools

import pytest
import torch

from moeserve import LLM, SamplingParams
from moeserve.config import ConfigError
from moeserve.kernels.attention import paged
from moeserve.kernels.attention.mla import reference as mla_reference
from moeserve.layers import attention as attention_module
from moeserve.layers import mla as mla_module
from tests.engine.test_generate_vs_hf import _llm, _prompts
from tests.models.checkpoints import write_tiny_checkpoint

FP8 = torch.float8_e4m3fn
NEW_TOKENS = 24
PARAMS = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(write_tiny_checkpoint("qwen3_moe", tmp_path_factory.mktemp("qwen3_moe_fp8kv")))


def rounded_write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                     slot_mapping: torch.Tensor) -> None:
    """write_kv into a cache of the model's dtype, of the values an e4m3 cache would hold."""
    paged.write_kv(paged.to_cache_dtype(k, FP8).to(k.dtype),
                   paged.to_cache_dtype(v, FP8).to(v.dtype), kv_cache, slot_mapping)


def run(llm: LLM, prompts: list[list[int]]) -> tuple[list[list[int]], list[list[float]]]:
    """Each prompt's greedy tokens and their logprobs."""
    results = llm.generate(prompts, PARAMS)
    return ([r.token_ids for r in results],
            [[lp.token_logprob for lp in r.logprobs] for r in results])


def test_fp8_cache_holds_four_times_an_fp32_caches_tokens(checkpoint: str) -> None:
    fp32 = _llm(checkpoint, "cpu")
    fp8 = _llm(checkpoint, "cpu", kv_cache_dtype="fp8")
    assert fp8.report.memory.bytes_per_block * 4 == fp32.report.memory.bytes_per_block
    assert fp8.report.memory.num_kv_tokens >= 4 * fp32.report.memory.num_kv_tokens
    assert "float8_e4m3fn" in fp8.report.to_dict()["kv_layout"]
    assert "float8" not in fp32.report.to_dict()["kv_layout"]
    assert all(c.dtype == FP8 for c in fp8.engine.runner.kv_caches)


VARIANTS = {
    "batch": {},
    "chunked_prefill": {"max_num_batched_tokens": 16},
    "preemption": {"block_size": 4, "num_blocks": 25, "max_model_len": 96,
                   "max_running_requests": 4},
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_fp8_cache_serves_what_a_cache_of_the_rounded_values_serves(
        checkpoint: str, monkeypatch: pytest.MonkeyPatch, variant: str) -> None:
    kw = VARIANTS[variant]
    prompts = _prompts(256, (5, 23, 41, 12))
    fp8_llm = _llm(checkpoint, "cpu", kv_cache_dtype="fp8", **kw)
    got = run(fp8_llm, prompts)
    if variant == "chunked_prefill":
        assert fp8_llm.engine.scheduler.stats.num_prefill_chunks > 1
    if variant == "preemption":
        assert fp8_llm.engine.scheduler.stats.num_preemptions > 0
    plain = run(_llm(checkpoint, "cpu", **kw), prompts)
    with monkeypatch.context() as m:
        m.setattr(attention_module, "write_kv", rounded_write_kv)
        want = run(_llm(checkpoint, "cpu", **kw), prompts)
    assert got == want
    assert got[1] != plain[1]  # the rounding changed the logprobs: the e4m3 cache was used


def test_fp8_cache_with_prefix_hits(checkpoint: str, monkeypatch: pytest.MonkeyPatch) -> None:
    shared = _prompts(256, (40,), seed=1)[0]
    prompts = [shared + tail for tail in _prompts(256, (3, 9, 1), seed=2)]

    def serve(llm: LLM) -> tuple:
        first = run(llm, prompts[:1])  # fills the cache with the shared blocks
        return first, run(llm, prompts[1:])

    fp8_llm = _llm(checkpoint, "cpu", kv_cache_dtype="fp8", block_size=8)
    got = serve(fp8_llm)
    assert fp8_llm.engine.scheduler.stats.num_prefix_hit_tokens >= 2 * 40 // 8 * 8
    with monkeypatch.context() as m:
        m.setattr(attention_module, "write_kv", rounded_write_kv)
        assert serve(_llm(checkpoint, "cpu", block_size=8)) == got


def test_fp8_cache_triton_attention_matches_torch(device: str, checkpoint: str) -> None:
    """The Triton kernels (on CPU through Triton's interpreter) read the e4m3 cache as the
    torch reference does: the same greedy tokens, with chunked prefill and decode."""
    prompts = _prompts(256, (5, 23, 41, 12))
    make = functools.partial(_llm, checkpoint, device, kv_cache_dtype="fp8",
                             max_num_batched_tokens=32)
    triton_llm = make(attention_backend="triton")
    assert triton_llm.engine.cfg.attention_backend == "triton"
    got = triton_llm.generate(prompts, PARAMS)
    want = make(attention_backend="torch").generate(prompts, PARAMS)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]


# ---- MLA's latent cache (DeepSeek-V3, GLM-4.7-Flash) and DSA's (GLM-5: indexer keys stay) ----

MLA_ARCHS = ("deepseek_v3", "glm4_moe_lite", "glm_moe_dsa")


@pytest.fixture(scope="module")
def mla_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return {arch: str(write_tiny_checkpoint(arch, tmp_path_factory.mktemp(f"{arch}_fp8kv")))
            for arch in MLA_ARCHS}


def rounded_write_latent(latent: torch.Tensor, latent_cache: torch.Tensor,
                         slot_mapping: torch.Tensor) -> None:
    """write_latent into a cache of the model's dtype, of the rows an e4m3 cache would hold."""
    mla_reference.write_latent(paged.to_cache_dtype(latent, FP8).to(latent.dtype), latent_cache,
                               slot_mapping)


@pytest.mark.parametrize("arch", MLA_ARCHS)
def test_fp8_latent_cache_serves_what_a_cache_of_the_rounded_rows_serves(
        mla_checkpoints: dict[str, str], monkeypatch: pytest.MonkeyPatch, arch: str) -> None:
    # prompts past index_topk, so that GLM-5's indexer really selects; chunks of 16 tokens,
    # so that prefill rows attend both absorbed and (past AUTO_ABSORBED_MAX_CONTEXT: none here)
    prompts = _prompts(256, (16, 57, 33, 12))
    kw = {"max_num_batched_tokens": 32}
    fp8_llm = _llm(mla_checkpoints[arch], "cpu", kv_cache_dtype="fp8", **kw)
    caches = fp8_llm.engine.runner.kv_caches
    latents = [c.latent if hasattr(c, "latent") else c for c in caches]
    assert all(t.dtype == FP8 for t in latents)
    if arch == "glm_moe_dsa":  # the indexer keys stay in the model's dtype
        keys = [c.index_keys for c in caches if hasattr(c, "index_keys")]
        assert keys and all(k.dtype == torch.float32 for k in keys)
    got = run(fp8_llm, prompts)
    plain = run(_llm(mla_checkpoints[arch], "cpu", **kw), prompts)
    with monkeypatch.context() as m:
        m.setattr(mla_module, "write_latent", rounded_write_latent)
        want = run(_llm(mla_checkpoints[arch], "cpu", **kw), prompts)
    assert got == want
    assert got[1] != plain[1]


def test_fp8_latent_cache_triton_attention_matches_torch(device: str,
                                                        mla_checkpoints: dict[str, str]) -> None:
    """The Triton MLA kernels (absorbed decode and prefill) read the e4m3 latent cache as the
    torch reference does."""
    prompts = _prompts(256, (5, 23, 41, 12))
    make = functools.partial(_llm, mla_checkpoints["deepseek_v3"], device,
                             kv_cache_dtype="fp8", max_num_batched_tokens=32)
    got = make(attention_backend="triton").generate(prompts, PARAMS)
    want = make(attention_backend="torch").generate(prompts, PARAMS)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]


def test_fp8_latent_cache_bytes(mla_checkpoints: dict[str, str]) -> None:
    fp32 = _llm(mla_checkpoints["glm_moe_dsa"], "cpu")
    fp8 = _llm(mla_checkpoints["glm_moe_dsa"], "cpu", kv_cache_dtype="fp8")
    mc = fp8.engine.model_config
    latent = mc.num_layers * mc.mla.latent_dim
    index = mc.index_cache_layers * mc.dsa.index_head_dim
    assert fp32.report.memory.bytes_per_block == 16 * 4 * (latent + index)
    assert fp8.report.memory.bytes_per_block == 16 * (latent + 4 * index)
    assert "float8_e4m3fn" in fp8.report.to_dict()["kv_layout"]


@pytest.mark.parametrize("value, message", [
    ("fp8_e5m2", "fp8_e5m2 is not implemented; fp8_e4m3 is"),
    ("int8", "kv_cache_dtype must be one of auto, fp8, fp8_e4m3, got 'int8'"),
])
def test_bad_kv_cache_dtype_is_named(value: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        LLM("tiny-moe", kv_cache_dtype=value)
