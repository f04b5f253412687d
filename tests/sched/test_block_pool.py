"""BlockPool: the null block, all-or-nothing allocation, ref counts, the prefix cache and LRU."""

from __future__ import annotations

import pytest

from moeserve.sched import NULL_BLOCK, BlockPool, Request
from moeserve.types import SamplingParams


def req(req_id: str, tokens: list[int]) -> Request:
    return Request(request_id=req_id, prompt_token_ids=tokens, sampling_params=SamplingParams())


def computed(pool: BlockPool, r: Request, num_tokens: int) -> list[int]:
    """Allocate and 'compute' the first num_tokens tokens of r; full blocks enter the cache."""
    blocks, num_hit = pool.get_computed_blocks(r)
    assert pool.allocate_slots(r, num_tokens - num_hit, blocks) is not None
    r.num_computed_tokens = num_tokens
    pool.cache_full_blocks(r, num_tokens)
    pool.check_integrity()
    return pool.block_tables[r.request_id]


def test_null_block_is_never_handed_out_and_usage_counts_usable_blocks() -> None:
    pool = BlockPool(num_blocks=5, block_size=4, enable_prefix_caching=True)
    assert pool.num_free_blocks == 4 and pool.usage == 0.0
    a = req("a", list(range(16)))
    assert pool.allocate_slots(a, 16) == [1, 2, 3, 4]
    assert NULL_BLOCK not in pool.block_tables["a"]
    assert pool.num_free_blocks == 0 and pool.usage == 1.0
    assert pool.allocate_slots(req("b", [1]), 1) is None
    pool.free(a)
    pool.check_integrity()
    assert pool.num_free_blocks == 4 and "a" not in pool.block_tables


def test_allocation_is_all_or_nothing() -> None:
    pool = BlockPool(num_blocks=5, block_size=4, enable_prefix_caching=False)
    a = req("a", list(range(12)))
    assert pool.allocate_slots(a, 12) is not None
    table = list(pool.block_tables["a"])
    b = req("b", list(range(8)))
    assert pool.allocate_slots(b, 8) is None  # needs 2, 1 free
    assert "b" not in pool.block_tables and pool.num_free_blocks == 1
    a.num_computed_tokens = 12
    assert pool.allocate_slots(a, 5) is None  # 17 tokens need 2 more blocks
    assert pool.block_tables["a"] == table and pool.num_free_blocks == 1
    assert pool.allocate_slots(a, 4) is not None  # 16 tokens: one more block
    assert pool.num_free_blocks == 0
    pool.check_integrity()


def test_growth_allocates_only_missing_blocks_and_lookahead_reserves_more() -> None:
    pool = BlockPool(num_blocks=10, block_size=4, enable_prefix_caching=False)
    a = req("a", list(range(6)))
    assert len(pool.allocate_slots(a, 6)) == 2
    a.num_computed_tokens = 6
    assert pool.allocate_slots(a, 1) == []  # position 6 still fits in block 2
    assert len(pool.allocate_slots(a, 1, num_lookahead_tokens=4)) == 1  # up to 11 tokens
    assert len(pool.block_tables["a"]) == 3


def test_reserved_blocks_must_remain_free() -> None:
    pool = BlockPool(num_blocks=6, block_size=4, enable_prefix_caching=False)  # 5 usable
    a = req("a", list(range(8)))
    assert pool.allocate_slots(a, 8, num_reserved_blocks=4) is None  # 2 + 4 > 5
    assert pool.allocate_slots(a, 8, num_reserved_blocks=3) is not None
    assert pool.num_free_blocks == 3


def test_free_returns_blocks_last_first_to_the_lru_tail() -> None:
    pool = BlockPool(num_blocks=5, block_size=1, enable_prefix_caching=False)
    a = req("a", [0, 0, 0])
    assert pool.allocate_slots(a, 3) == [1, 2, 3]
    pool.free(a)
    # queue: 4 (never used) then a's blocks freed last first: 3, 2, 1
    order = [pool.allocate_slots(req(f"r{i}", [0]), 1)[0] for i in range(4)]
    assert order == [4, 3, 2, 1]


def test_prefix_hits_follow_the_hash_chain() -> None:
    pool = BlockPool(num_blocks=16, block_size=4, enable_prefix_caching=True)
    a_table = computed(pool, req("a", list(range(10))), 10)
    assert [pool.is_cached(b) for b in a_table] == [True, True, False]  # only full blocks
    b = req("b", list(range(8)) + [99, 98, 97])
    blocks, num_hit = pool.get_computed_blocks(b)
    assert blocks == a_table[:2] and num_hit == 8
    # same second block, different first block: the chain breaks at block 0
    c = req("c", [50, 51, 52, 53] + list(range(4, 8)) + [1])
    assert pool.get_computed_blocks(c) == ([], 0)
    # an 8-token prompt fully cached still leaves its last block to compute
    d = req("d", list(range(8)))
    assert pool.get_computed_blocks(d) == (a_table[:1], 4)
    # a 9-token prompt hits both blocks and computes one token
    e = req("e", list(range(9)))
    assert pool.get_computed_blocks(e) == (a_table[:2], 8)


def test_hit_blocks_are_shared_and_revived_from_the_free_queue() -> None:
    pool = BlockPool(num_blocks=8, block_size=4, enable_prefix_caching=True)  # 7 usable
    a = req("a", list(range(10)))
    a_table = list(computed(pool, a, 10))
    b_table = computed(pool, req("b", list(range(8)) + [5, 5, 5]), 11)
    assert b_table[:2] == a_table[:2] and b_table[2] != a_table[2]
    assert [pool.ref_count(x) for x in a_table[:2]] == [2, 2]
    assert pool.num_free_blocks == 7 - 4
    pool.free(a)
    pool.free(req("b", []))  # frees by request id
    pool.check_integrity()
    assert pool.num_free_blocks == 7 and pool.is_cached(a_table[0])  # cached while free
    c = req("c", list(range(8)) + [6])
    blocks, num_hit = pool.get_computed_blocks(c)
    assert blocks == a_table[:2] and num_hit == 8
    assert pool.allocate_slots(c, 1, blocks) is not None
    assert pool.num_free_blocks == 7 - 3  # 2 revived + 1 new
    assert [pool.ref_count(x) for x in a_table[:2]] == [1, 1]
    pool.check_integrity()


def test_taking_a_cached_free_block_evicts_its_hash() -> None:
    pool = BlockPool(num_blocks=4, block_size=4, enable_prefix_caching=True)  # 3 usable
    a = req("a", list(range(9)))
    a_table = list(computed(pool, a, 9))
    pool.free(a)
    # queue: a's blocks freed last first: [a2, a1, a0]; a 2-block request evicts a2 and a1
    assert pool.allocate_slots(req("x", [7] * 8), 8) == [a_table[2], a_table[1]]
    assert pool.is_cached(a_table[0]) and not pool.is_cached(a_table[1])
    assert pool.get_computed_blocks(req("c", list(range(9)))) == ([a_table[0]], 4)
    pool.check_integrity()


def test_duplicate_content_is_cached_once() -> None:
    pool = BlockPool(num_blocks=8, block_size=4, enable_prefix_caching=True)
    a_table = list(computed(pool, req("a", list(range(5))), 5))
    # b computed the same block without hitting (it was admitted before a cached it)
    b = req("b", list(range(5)))
    assert pool.allocate_slots(b, 5) is not None
    pool.cache_full_blocks(b, 5)
    pool.check_integrity()
    assert not pool.is_cached(pool.block_tables["b"][0])
    assert pool.get_computed_blocks(req("c", list(range(5)))) == (a_table[:1], 4)


def test_prefix_caching_off_never_hits() -> None:
    pool = BlockPool(num_blocks=8, block_size=4, enable_prefix_caching=False)
    table = computed(pool, req("a", list(range(9))), 9)
    assert not any(pool.is_cached(b) for b in table)
    assert pool.get_computed_blocks(req("b", list(range(9)))) == ([], 0)


def test_check_integrity_catches_a_wrong_refcount() -> None:
    pool = BlockPool(num_blocks=4, block_size=4, enable_prefix_caching=True)
    assert pool.allocate_slots(req("a", [1, 2]), 2) is not None
    pool._ref_counts[pool.block_tables["a"][0]] = 2
    with pytest.raises(AssertionError, match="refcounts"):
        pool.check_integrity()
