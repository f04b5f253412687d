"""The runner's warm-up before serving: the kernel variants serving will hit, compiled first."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from moeserve.runner.kv_cache import num_cache_blocks
from moeserve.types import SamplingParams, SchedulerOutput

if TYPE_CHECKING:
    from moeserve.runner.model_runner import ModelRunner


@torch.inference_mode()
def warm_up(runner: ModelRunner, moe_token_counts: list[int], max_model_len: int) -> None:
    """Compile the kernel variants serving will hit, before it starts (CUDA only): one MoE
    block at each token count (each tuned count has its own tiles) and two mixed steps (a
    decode row beside a prefill row; the second decode row's context splits). Positions
    stay below max_model_len (the RoPE tables end there or later). It writes the first KV
    blocks, which are free; the expert counters are reset afterwards."""
    if runner.device.type != "cuda" or not runner.kv_caches:
        return
    blocks = runner.model.moe_blocks()
    if blocks:
        hidden = runner.model_config.hidden_size
        gen = torch.Generator(device=runner.device).manual_seed(0)
        for n in moe_token_counts:
            blocks[0](torch.randn(n, hidden, generator=gen, device=runner.device,
                                  dtype=runner.dtype))
    # mixed steps: a decode row with a short context, then one long enough for the decode
    # attention to split over the context (its reduce kernel too)
    num_blocks = num_cache_blocks(runner.kv_caches)
    prompt = 17
    for context in sorted({min(c, max_model_len - 1) for c in (16, 600)}):
        if context < 1 or prompt > max_model_len:
            break
        blocks_needed = -(-(context + 1) // runner.block_size) + 2
        if num_blocks <= blocks_needed:
            break
        table = list(range(1, blocks_needed - 1))
        runner.execute(SchedulerOutput(
            req_ids=["warmup-decode", "warmup-prefill"], num_scheduled_tokens=[1, prompt],
            num_computed_tokens=[context, 0], token_ids=[0] * (prompt + 1),
            block_tables=[table, [blocks_needed - 1, blocks_needed]],
            sample=[True, True], sampling_params=[SamplingParams()] * 2,
            sample_seeds=[0, 0], num_output_tokens=[1, 0]))
    runner.reset_counters()
