"""The step the engine profiles its activation peak on (runner/kv_cache.profile_step): the
budget's tokens at the end of the longest context, so that the attention's transients at long
context (DSA's indexer, the up-projected MLA prefill) are in the memory plan."""

from __future__ import annotations

import pytest
import torch

from moeserve.runner.kv_cache import profile_step


def test_profile_step_is_a_chunk_at_the_end_of_the_longest_context() -> None:
    step, num_blocks = profile_step(8192, 33280, 16)
    assert step.num_scheduled_tokens == [8192] and step.num_computed_tokens == [33280 - 8192]
    assert len(step.token_ids) == 8192 and step.sample == [True]
    assert num_blocks == 33280 // 16 + 1  # the context's blocks and the null block
    assert step.block_tables == [list(range(1, num_blocks))]  # block 0, the null one, unused
    # a context that is not a whole number of blocks gets its last partial one
    step, num_blocks = profile_step(5, 21, 8)
    assert num_blocks == 4 and step.block_tables == [[1, 2, 3]]
    assert step.num_computed_tokens == [16]


def test_profile_step_refuses_a_chunk_longer_than_its_context() -> None:
    with pytest.raises(ValueError, match="num_tokens 9 must be in 1..context_len"):
        profile_step(9, 8, 16)


def test_a_profile_out_of_memory_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from moeserve import LLM
    from moeserve.config import ConfigError
    from moeserve.runner.model_runner import ModelRunner

    def no_room(self, num_tokens: int, num_sample_rows: int, context_len: int) -> int:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 864.00 MiB.\nmore")

    monkeypatch.setattr(ModelRunner, "profile_activation_peak", no_room)
    with pytest.raises(ConfigError, match=r"profile step \(96 tokens at the end of a 300-token "
                                          r"context\) ran out of device memory.*lower "
                                          r"max_model_len \(300\) or max_num_batched_tokens "
                                          r"\(96\) \(CUDA out of memory. Tried to allocate "
                                          r"864.00 MiB.\)$"):
        LLM("tiny-moe", device="cpu", max_model_len=300, max_num_batched_tokens=96)
