"""End to end: moeserve's greedy outputs equal transformers' generate, token for token, in fp32.

Each test writes a tiny random checkpoint with transformers' own classes, serves it with
`moeserve.LLM`, and compares against `model.generate` on the same prompts. The variants force the
engine's other paths (staggered arrival, chunked prefill, prefix-cache hits, preemption) and assert
that each path really ran.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable

import pytest
import torch

from moeserve import LLM, SamplingParams
from tests.models.checkpoints import write_tiny_checkpoint

NEW_TOKENS = 32
PROMPT_LENS = (5, 23, 41, 12)
ARCH_BACKENDS = [("qwen3_moe", "torch"), ("qwen3_moe", "grouped_mm"), ("qwen3", "grouped_mm"),
                 ("mixtral", "torch"), ("mixtral", "grouped_mm")]


def _prompts(vocab: int, lens: tuple[int, ...] = PROMPT_LENS, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lens]


def hf_greedy(ckpt: str, prompts: list[list[int]], new_tokens: int = NEW_TOKENS) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    from tests.models.checkpoints import hf_config_as_published

    model = AutoModelForCausalLM.from_pretrained(ckpt, config=hf_config_as_published(ckpt),
                                                 dtype=torch.float32).eval()
    return hf_generate(model, prompts, new_tokens)


def hf_generate(model: torch.nn.Module, prompts: list[list[int]],
                new_tokens: int) -> list[list[int]]:
    """A transformers model's greedy continuations of `prompts`, exactly new_tokens each."""
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                 eos_token_id=None, pad_token_id=0)
            outs.append(gen[0, len(p):].tolist())
    return outs


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, list, list]]:
    """arch -> (folder, prompts, HF greedy outputs); the qwen3_moe one is sharded."""
    result = {}
    for arch in ("qwen3_moe", "qwen3", "mixtral"):
        folder = str(write_tiny_checkpoint(arch, tmp_path_factory.mktemp(arch),
                                           sharded=arch == "qwen3_moe"))
        from moeserve.model_config import ModelConfig

        vocab = ModelConfig.from_file(f"{folder}/config.json").vocab_size
        prompts = _prompts(vocab)
        result[arch] = (folder, prompts, hf_greedy(folder, prompts))
    return result


def _llm(folder: str, device: str, backend: str = "grouped_mm", **kw: object) -> LLM:
    if device == "cuda":
        kw.setdefault("mem_fraction", 0.1)  # a tiny model: leave the GPU's memory alone
    return LLM(folder, device=device, dtype="float32", moe_backend=backend, **kw)


GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("arch,backend", ARCH_BACKENDS)
def test_batch_matches_hf(device: str, checkpoints: dict, arch: str, backend: str) -> None:
    folder, prompts, expected = checkpoints[arch]
    results = _llm(folder, device, backend).generate(prompts, GREEDY)
    assert [r.token_ids for r in results] == expected
    assert all(r.finish_reason.value == "length" for r in results)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_staggered_arrivals_match_hf(device: str, checkpoints: dict, arch: str) -> None:
    folder, prompts, expected = checkpoints[arch]
    llm = _llm(folder, device)
    ids = []
    for p in prompts:  # a new request joins every three steps, beside running decodes
        ids.append(llm.add_request(p, GREEDY))
        for _ in range(3):
            llm.step()
    while llm.has_unfinished_requests():
        llm.step()
    assert [llm.result(i).token_ids for i in ids] == expected


def test_chunked_prefill_matches_hf(device: str, checkpoints: dict) -> None:
    folder, prompts, expected = checkpoints["qwen3_moe"]
    llm = _llm(folder, device, max_num_batched_tokens=16)
    results = llm.generate(prompts, GREEDY)
    assert llm.engine.scheduler.stats.num_prefill_chunks > 1
    assert [r.token_ids for r in results] == expected


def check_prefix_hits_match_hf(folder: str, make_llm: Callable[..., LLM]) -> None:
    """Three prompts sharing a 40-token prefix: the first fills the cache with the shared
    blocks, the other two hit them; all equal transformers' greedy outputs."""
    shared = _prompts(256, (40,), seed=1)[0]
    prompts = [shared + tail for tail in _prompts(256, (3, 9, 1), seed=2)]
    expected = hf_greedy(folder, prompts)
    llm = make_llm(block_size=8)
    first = llm.generate(prompts[:1], GREEDY)  # fills the cache with the shared blocks
    rest = llm.generate(prompts[1:], GREEDY)
    assert llm.engine.scheduler.stats.num_prefix_hit_tokens >= 2 * 40 // 8 * 8
    assert all(r.num_cached_tokens > 0 for r in rest)
    assert [r.token_ids for r in first + rest] == expected


def test_prefix_cache_hits_match_hf(device: str, checkpoints: dict) -> None:
    folder, _, _ = checkpoints["qwen3_moe"]
    check_prefix_hits_match_hf(folder, functools.partial(_llm, folder, device))


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_preemption_matches_hf(device: str, checkpoints: dict, arch: str) -> None:
    folder, prompts, expected = checkpoints[arch]
    # 4 requests need up to (41 + 32) / 4 = 19 blocks each; 24 blocks cannot hold them all.
    llm = _llm(folder, device, block_size=4, num_blocks=25, max_model_len=96,
               max_running_requests=4)
    results = llm.generate(prompts, GREEDY)
    assert llm.engine.scheduler.stats.num_preemptions > 0
    assert [r.token_ids for r in results] == expected


def test_seeded_sampling_is_batch_independent(device: str, checkpoints: dict) -> None:
    folder, prompts, _ = checkpoints["qwen3_moe"]
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    alone = _llm(folder, device).generate(prompts[:1], params)[0].token_ids
    noisy = [SamplingParams(max_tokens=16, temperature=1.0, seed=s) for s in (1, 2, 3)]
    batched = _llm(folder, device).generate(prompts, [params] + noisy)[0].token_ids
    assert alone == batched


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_async_scheduling_matches_hf(device: str, checkpoints: dict, arch: str) -> None:
    """Overlap: step N+1 is launched with step N's tokens still on the device."""
    folder, prompts, expected = checkpoints[arch]
    llm = _llm(folder, device, async_scheduling=True, max_num_batched_tokens=16)
    results = llm.generate(prompts, GREEDY)
    assert llm.engine.scheduler.stats.num_prefill_chunks > 1
    assert [r.token_ids for r in results] == expected


def test_async_scheduling_with_preemption_and_stops(device: str, checkpoints: dict) -> None:
    """A stop applies one step late under overlap; outputs still equal the synchronous run."""
    folder, prompts, expected = checkpoints["qwen3_moe"]
    stop = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0,
                          stop_token_ids=[expected[2][20]])  # a token its greedy run will meet
    params = [GREEDY, GREEDY, stop, GREEDY]
    kw = {"block_size": 4, "num_blocks": 25, "max_model_len": 96, "max_running_requests": 4}
    sync = _llm(folder, device, **kw).generate(prompts, params)
    overlap_llm = _llm(folder, device, async_scheduling=True, **kw)
    overlap = overlap_llm.generate(prompts, params)
    assert overlap_llm.engine.scheduler.stats.num_preemptions > 0
    assert [r.token_ids for r in overlap] == [r.token_ids for r in sync]
    assert [r.finish_reason for r in overlap] == [r.finish_reason for r in sync]
    assert any(r.finish_reason.value == "stop" for r in sync)
    overlap_llm.engine.scheduler.check_integrity()
    assert overlap_llm.engine.scheduler.pool.num_free_blocks == 24


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_triton_backends_match_hf(device: str, checkpoints: dict, arch: str) -> None:
    """The fast path's kernels (Triton attention and fused MoE; on CPU through Triton's
    interpreter) give the same greedy tokens in fp32, with chunked prefill and decode."""
    folder, prompts, expected = checkpoints[arch]
    llm = _llm(folder, device, "triton", attention_backend="triton", max_num_batched_tokens=32)
    results = llm.generate(prompts, GREEDY)
    assert [r.token_ids for r in results] == expected


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_continuous_decode_steps_match_hf(device: str, checkpoints: dict, arch: str) -> None:
    """Decode-only steps run 4 tokens back to back, fed on the device; ragged max_tokens."""
    folder, prompts, expected = checkpoints[arch]
    llm = _llm(folder, device, num_continuous_decode_steps=4)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
              for n in (NEW_TOKENS, 7, NEW_TOKENS - 3, 1)]
    results = llm.generate(prompts, params)
    assert [r.token_ids for r in results] == [e[:p.max_tokens] for e, p in zip(expected, params)]
    forwards = llm.engine.runner.num_forward_steps
    assert forwards > llm.engine.scheduler.stats.num_scheduled_steps  # several per round ran
    llm.engine.scheduler.check_integrity()
    assert llm.engine.scheduler.pool.num_free_blocks == llm.engine.report.memory.num_blocks - 1


def test_continuous_decode_steps_with_stops_and_preemption(device: str, checkpoints: dict) -> None:
    folder, prompts, expected = checkpoints["qwen3_moe"]
    stop = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0,
                          stop_token_ids=[expected[2][10]])
    params = [GREEDY, GREEDY, stop, GREEDY]
    kw = {"block_size": 4, "num_blocks": 25, "max_model_len": 96, "max_running_requests": 4}
    single = _llm(folder, device, **kw).generate(prompts, params)
    multi_llm = _llm(folder, device, num_continuous_decode_steps=3, **kw)
    multi = multi_llm.generate(prompts, params)
    assert [r.token_ids for r in multi] == [r.token_ids for r in single]
    assert [r.finish_reason for r in multi] == [r.finish_reason for r in single]
    stats = multi_llm.engine.scheduler.stats
    assert multi_llm.engine.runner.num_forward_steps > stats.num_scheduled_steps
    assert stats.num_preemptions > 0
    multi_llm.engine.scheduler.check_integrity()


def test_prefill_batching_matches_hf(device: str, checkpoints: dict) -> None:
    """prefill_batch_delay_steps holds new prompts behind running decodes; tokens are unchanged."""
    folder, prompts, expected = checkpoints["qwen3_moe"]
    llm = _llm(folder, device, prefill_batch_delay_steps=3)
    ids = []
    for p in prompts:  # a new request every step, beside running decodes
        ids.append(llm.add_request(p, GREEDY))
        llm.step()
    sched = llm.engine.scheduler
    assert (sched.num_running, sched.num_waiting) == (1, 3)  # held for 3 decode-only steps
    llm.step()
    assert (sched.num_running, sched.num_waiting) == (4, 0)  # then admitted together
    while llm.has_unfinished_requests():
        llm.step()
    assert [llm.result(i).token_ids for i in ids] == expected
