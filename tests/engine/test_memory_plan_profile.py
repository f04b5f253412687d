"""The step the engine profiles its activation peak on (runner/kv_cache.profile_step): the
budget's tokens at the end of the longest context, so that the attention's transients at long
context (DSA's indexer, the up-projected MLA prefill) are in the memory plan."""

from __future__ import annotations

import pytest

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
