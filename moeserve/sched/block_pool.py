"""The KV block pool: which block holds which request's tokens, and the prefix cache over them.

The KV cache is `num_blocks` blocks of `block_size` tokens. Block 0 is the null block: never
handed out, never freed, never in a block table (the runner pads tables and dummy rows with it).
Each request owns a `block_table` (its blocks in position order; replaced by a new list when it
grows, never changed in place, so a step's plan may hold it without a copy); a block may be
shared by several tables (a prefix hit), so blocks are ref-counted.

Prefix caching hashes FULL blocks as a chain, hash((parent_hash, tokens of the block)), so a hash
names a block's tokens and everything before them. Cached blocks whose refcount falls to 0 stay in
the hash map and also sit in the free queue, where a later request may still hit them:

    block state        ref_count   in free queue   in hash map
    free, uncached     0           yes             no
    free, cached       0           yes             yes   (evicted when taken for new use)
    in use             >= 1        no              maybe

The free queue is LRU: blocks are taken from its head and freed blocks go to its tail. A request's
blocks are freed last block first, so its tail blocks (the least likely to be shared) are evicted
before its head blocks (as in vLLM v1). Allocation is all or nothing: it returns None and changes
nothing when the blocks are not there.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from moeserve.sched.request import Request

NULL_BLOCK = 0
_ROOT_HASH = 0  # parent hash of a request's first block

# NOTE: block hashes use Python's built-in hash (64-bit, fast). Two different prefixes that
# collide would share KV; at 64 bits this is far less likely than a hardware fault.


def cdiv(a: int, b: int) -> int:
    return -(a // -b)


class BlockPool:
    """Ref-counted KV blocks, per-request block tables and the prefix cache."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        if num_blocks < 2:
            raise ValueError(
                f"num_blocks must be >= 2 (block 0 is the null block), got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.block_tables: dict[str, list[int]] = {}  # request id -> its blocks, position order
        self._ref_counts = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        self._block_hash: list[int | None] = [None] * num_blocks
        self._hash_to_block: dict[int, int] = {}
        self._num_cached_blocks: dict[str, int] = {}  # request id -> leading blocks hashed

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out (cached free blocks included)."""
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of the usable blocks (null block excluded) held by requests."""
        return 1.0 - len(self._free) / (self.num_blocks - 1)

    def num_cached_blocks(self, req_id: str) -> int:
        """The request's leading blocks already entered into the prefix cache (0 if none)."""
        return self._num_cached_blocks.get(req_id, 0)

    def ref_count(self, block: int) -> int:
        """How many block tables hold the block."""
        return self._ref_counts[block]

    def is_cached(self, block: int) -> bool:
        """True when the block's content is in the prefix cache."""
        return self._block_hash[block] is not None

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Longest run of cached blocks matching the request's leading full blocks.

        Never the whole sequence: at least one token is left to compute, so that its logits exist.
        Touches nothing; pass the blocks to `allocate_slots` to take them.

        Returns:
            (block ids, number of hit tokens = len(block ids) * block_size)
        """
        if not self.enable_prefix_caching:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes = self._block_hashes(request, max_blocks)
        blocks: list[int] = []
        for block_hash in hashes[:max_blocks]:
            block = self._hash_to_block.get(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: Sequence[int] = (), num_reserved_blocks: int = 0,
                       num_lookahead_tokens: int = 0) -> list[int] | None:
        """Grow the request's block table to hold its computed tokens, the prefix-hit blocks and
        `num_new_tokens` (+ `num_lookahead_tokens`, for several decode steps ahead).

        Args:
            request: its `num_computed_tokens` must not yet count the prefix-hit tokens.
            new_computed_blocks: prefix-hit blocks from `get_computed_blocks` (on admission).
            num_reserved_blocks: free blocks that must remain afterwards (the admission watermark).

        Returns:
            The newly allocated blocks (hit blocks excluded), or None (nothing changed) when the
            free blocks do not suffice.
        """
        table = self.block_tables.get(request.request_id)
        num_tokens = request.num_computed_tokens + num_new_tokens + num_lookahead_tokens
        if table is not None and num_tokens <= len(table) * self.block_size:
            return []  # the common decode step: the last block has room
        num_held = len(table) if table is not None else 0
        assert not new_computed_blocks or num_held == 0, "prefix hits only on admission"
        num_hit = len(new_computed_blocks)
        num_needed = max(cdiv(num_tokens + num_hit * self.block_size, self.block_size)
                         - num_held - num_hit, 0)
        num_revived = (sum(1 for b in new_computed_blocks if self._ref_counts[b] == 0)
                       if new_computed_blocks else 0)
        if num_needed + num_revived + num_reserved_blocks > len(self._free):
            return None
        if table is None:
            self._num_cached_blocks[request.request_id] = num_hit
        for block in new_computed_blocks:
            if self._ref_counts[block] == 0:
                del self._free[block]
            self._ref_counts[block] += 1
        new_blocks = [self._take_free_block() for _ in range(num_needed)]
        # NOTE: a new list, never the old one grown: a step's plan holds the table it was
        # scheduled with (SchedulerOutput.block_tables), and it must not change under it.
        self.block_tables[request.request_id] = [*(table or ()), *new_computed_blocks,
                                                 *new_blocks]
        return new_blocks

    def free(self, request: Request) -> None:
        """Release the request's blocks, last block first; safe when it holds none."""
        table = self.block_tables.pop(request.request_id, None)
        self._num_cached_blocks.pop(request.request_id, None)
        for block in reversed(table or ()):
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                self._free[block] = None  # tail of the LRU queue

    def uncache(self, request: Request) -> None:
        """Drop the request's blocks from the prefix cache (their KV may not have been written:
        a failed step's); another request holding one still uses it, uncached."""
        for block in self.block_tables.get(request.request_id, ()):
            block_hash = self._block_hash[block]
            if block_hash is not None:  # the map holds every hashed block
                self._block_hash[block] = None
                del self._hash_to_block[block_hash]
        if request.request_id in self._num_cached_blocks:
            self._num_cached_blocks[request.request_id] = 0

    def cache_full_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Enter the request's full blocks below `num_computed_tokens` into the prefix cache.

        Call once their KV is computed (or scheduled, by a step that runs before any step that
        could hit them); the tokens must be known: num_computed_tokens <= request.num_tokens.
        """
        table = self.block_tables.get(request.request_id)
        if not self.enable_prefix_caching or not table:
            return
        num_full = min(num_computed_tokens // self.block_size, len(table))
        start = self._num_cached_blocks[request.request_id]
        if num_full <= start:
            return
        hashes = self._block_hashes(request, num_full)
        for i in range(start, num_full):
            block, block_hash = table[i], hashes[i]
            # A block with the same content cached by another request wins; this one stays
            # uncached and is freed as usual.
            if self._block_hash[block] is None and block_hash not in self._hash_to_block:
                self._block_hash[block] = block_hash
                self._hash_to_block[block_hash] = block
        self._num_cached_blocks[request.request_id] = num_full

    def check_integrity(self) -> None:
        """Recount refcounts from the block tables; raise AssertionError naming what is off."""
        counts = [0] * self.num_blocks
        for req_id, table in self.block_tables.items():
            assert NULL_BLOCK not in table, f"null block in the table of {req_id}: {table}"
            assert len(set(table)) == len(table), f"block twice in the table of {req_id}: {table}"
            for block in table:
                counts[block] += 1
        assert counts == self._ref_counts, (
            "refcounts differ from the tables: "
            f"{[(b, c, r) for b, (c, r) in enumerate(zip(counts, self._ref_counts)) if c != r]}")
        assert NULL_BLOCK not in self._free, "null block in the free queue"
        free = {b for b in range(1, self.num_blocks) if self._ref_counts[b] == 0}
        assert set(self._free) == free, f"free queue {list(self._free)} != unowned blocks {free}"
        num_owned = sum(1 for c in self._ref_counts if c > 0)
        assert len(self._free) + num_owned == self.num_blocks - 1, (
            f"free {len(self._free)} + owned {num_owned} != {self.num_blocks - 1} usable blocks")
        for block_hash, block in self._hash_to_block.items():
            assert self._block_hash[block] == block_hash, f"hash map and block {block} disagree"
        num_hashed = sum(1 for h in self._block_hash if h is not None)
        assert num_hashed == len(self._hash_to_block), "a hashed block is missing from the map"

    def _take_free_block(self) -> int:
        """Pop the LRU head of the free queue, evicting its cached hash if it has one."""
        block, _ = self._free.popitem(last=False)
        block_hash = self._block_hash[block]
        if block_hash is not None:
            del self._hash_to_block[block_hash]
            self._block_hash[block] = None
        self._ref_counts[block] = 1
        return block

    def _block_hashes(self, request: Request, num_full_blocks: int) -> list[int]:
        """The request's chained block hashes, extended to cover `num_full_blocks` blocks."""
        hashes = request.block_hashes
        size = self.block_size
        assert num_full_blocks * size <= request.num_tokens, "hashing a block with unknown tokens"
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else _ROOT_HASH
            hashes.append(hash((parent, tuple(request.get_token_ids(i * size, (i + 1) * size)))))
        return hashes
