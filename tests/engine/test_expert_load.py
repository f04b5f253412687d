"""Expert-load counters: tokens per expert per MoE layer, counted on the device, equal a count
made independently from each MoE block's router inputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moeserve import LLM, SamplingParams
from moeserve.kernels.routing.select import select_experts


def test_counters_equal_reference_count() -> None:
    llm = LLM("tiny-moe", device="cpu", max_num_batched_tokens=24)
    runner = llm.engine.runner
    blocks = runner.model.moe_blocks()
    num_experts = llm.engine.model_config.num_experts
    reference = torch.zeros(len(blocks), num_experts, dtype=torch.int64)

    def hook(j: int):
        def count(block, inputs, _output) -> None:  # the router, recomputed from the input
            _, ids = select_experts(F.linear(inputs[0], block.gate), block.top_k,
                                    block.renormalize)
            reference[j] += torch.bincount(ids.flatten(), minlength=num_experts)
        return count

    handles = [b.register_forward_hook(hook(j)) for j, b in enumerate(blocks)]
    prompts = [[1, 2, 3, 4, 5] * 8, [9, 8, 7], list(range(100, 130))]
    llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    for h in handles:
        h.remove()
    load = runner.expert_load()
    assert load["tokens_per_expert"] == reference.tolist()
    assert load["num_steps"] == llm.engine.scheduler.stats.num_scheduled_steps
    top_k = llm.engine.model_config.num_experts_per_tok
    computed = sum(len(p) for p in prompts) + 3 * 5  # prompts, then 5 decode steps each
    assert all(sum(row) == computed * top_k for row in load["tokens_per_expert"])


def test_counting_can_be_turned_off() -> None:
    llm = LLM("tiny-moe", device="cpu", collect_expert_load=False)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
    assert llm.engine.runner.expert_load() is None
    assert all(b.expert_counts is None for b in llm.engine.runner.model.moe_blocks())


@pytest.mark.gpu
def test_async_read_catches_up_with_the_synchronous_one() -> None:
    """The busy engine's read (`expert_load_async`, no host sync) returns a completed copy."""
    llm = LLM("tiny-moe", device="cuda", dtype="float32", mem_fraction=0.1,
              moe_backend="grouped_mm", attention_backend="torch")
    llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=8, ignore_eos=True))
    runner = llm.engine.runner
    assert runner.expert_load_async() is None  # the first copy has only been started
    torch.cuda.synchronize()
    assert runner.expert_load_async() == runner.expert_load()
