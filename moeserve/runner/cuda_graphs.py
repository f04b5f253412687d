"""CUDA graphs for decode steps: batch-size buckets, static input buffers, capture and replay.

A decode step (every row computes one token) is captured once per bucket of batch sizes and then
replayed, so the host launches one graph instead of ~20 kernels per layer. The buckets run from 1
to the largest decode batch the scheduler can form (max_running_requests, capped by the step's
token budget), spaced so that padding a batch up to its bucket wastes under 10% of the rows run.

Static buffers, sized for the largest bucket; bucket B's graph reads their first B rows:

    input_ids [N] int64 | positions [N] int64 | slot_mapping [N] int64 | count_mask [N] int64
    seq_lens  [N] int32 | block_tables [N, max_blocks] int32 (width: max_model_len's blocks)
    query_start_loc = arange(N + 1), token_to_req = arange(N): constant for decode

Rows B' >= the batch (padding) get token 0 at position 0, seq_len 1 and slot 0: they write their
K/V into the null block (block 0, never handed out) and read one key from it; `count_mask` keeps
them out of the expert-load counters. Their outputs are dropped.

The Triton decode kernel sizes its context partitions from `max_seq_len`, fixed at capture (to
max_model_len by default); rows shorter than a partition skip it, so one graph serves every
context length. Where a decode's kernels depend on the rows' longest context, a bucket holds
one graph per context bound (`context_bounds`), and `stage` picks, on the host, the smallest
bound that every context stays within through a multi-step round:
  - the model's `decode_kernel_bounds()`: contexts past which an attention kernel changes (an
    MLA model of enough heads for the device (decode_gluon_ws.WS_MIN_HEADS: 64 on the H200, 128
    on the H100): decode_gluon's WS_SHORT_CONTEXT, past which its decode
    runs decode_gluon_ws, slower on short rows);
  - a model with DeepSeek Sparse Attention: its `dense_context_limit()` (index_topk), where
    layers/dsa.py runs dense MLA with no indexer, then bounds 8x apart up to max_model_len,
    where every row is sparse and the indexer's scores and top-k span the bound, not
    max_model_len.
Graphs are captured largest first into one memory pool (a smaller graph's activations fit in the
larger one's). Multi-step decode advances positions, lengths and slots on the device (`advance`)
between replays, with no host round trip.
"""

from __future__ import annotations

import bisect
import time

import numpy as np
import torch

from moeserve.kernels.attention.metadata import AttentionMetadata

MAX_PADDING = 0.1  # largest share of a bucket's rows that may be padding
CONTEXT_STEP = 8  # a DSA model's graph context bounds grow 8x from index_topk
ROUND_FROM = 64  # buckets above this are multiples of 8 (tile-friendly)


def graph_batch_sizes(max_batch: int, max_padding: float = MAX_PADDING) -> list[int]:
    """Bucket sizes 1..max_batch such that any batch b, padded to the smallest bucket >= b,
    has fewer than `max_padding` of the bucket's rows as padding."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    sizes = [1]
    while sizes[-1] < max_batch:
        prev = sizes[-1]
        nxt = prev + 1  # the smallest batch this bucket takes is prev + 1
        while nxt + 1 <= max_batch and (nxt + 1) - (prev + 1) < max_padding * (nxt + 1):
            nxt += 1
        if nxt > ROUND_FROM and nxt < max_batch and nxt // 8 * 8 > prev:
            nxt = nxt // 8 * 8
        sizes.append(min(nxt, max_batch))
    return sizes


def bucket_padding(sizes: list[int]) -> float:
    """The worst padding share over every batch 1..max(sizes) (a check of the spacing)."""
    worst, prev = 0.0, 0
    for s in sizes:
        worst = max(worst, (s - prev - 1) / s)
        prev = s
    return worst


def context_bounds(dense_limit: int | None, max_model_len: int, step: int = CONTEXT_STEP,
                   kernel_bounds: tuple[int, ...] = ()) -> tuple[int, ...]:
    """The max_seq_len of each graph a bucket holds, ascending, the last max_model_len: the
    dense limit and `step`x bounds from it below max_model_len (GLM-5's 2,048 at 202,752:
    2,048, 16,384, 131,072, 202,752), and each of `kernel_bounds` below max_model_len (the
    contexts where a decode's attention kernel changes); (max_model_len,) with neither."""
    bounds = {b for b in kernel_bounds if 0 < b < max_model_len}
    if dense_limit is not None:
        b = dense_limit
        while b < max_model_len:
            bounds.add(b)
            b *= step
    return (*sorted(bounds), max_model_len)


class DecodeGraphs:
    """Static decode buffers and one CUDA graph per bucket (see the module docstring).

    On CPU (tests) `capture` is skipped and `replay` runs the model eagerly on the same static
    buffers, so the padding and buffer logic is exercised everywhere."""

    def __init__(self, model: torch.nn.Module, sizes: list[int], max_model_len: int,
                 block_size: int, device: torch.device):
        self.model = model
        self.sizes = sorted(sizes)
        self.max_batch = self.sizes[-1]
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.device = device
        limit = getattr(model, "dense_context_limit", lambda: None)()
        # the model's dense limit (DSA: index_topk) when below max_model_len, else None
        self.dense_context = limit if limit is not None and limit < max_model_len else None
        # context -> what changes past it (the model's `decode_kernel_bounds`)
        self.kernel_bounds: dict[int, str] = {
            b: why for b, why in getattr(model, "decode_kernel_bounds", dict)().items()
            if b < max_model_len}
        self.bounds = context_bounds(self.dense_context, max_model_len,  # graphs' max_seq_len
                                     kernel_bounds=tuple(self.kernel_bounds))
        self.bound = max_model_len  # the staged step's (`stage`)
        n = self.max_batch
        self.max_blocks = -(-max_model_len // block_size)
        # int64 rows: input ids, positions, slots, count mask; one host-to-device copy per step
        self.packed64 = torch.zeros(4, n, dtype=torch.int64, device=device)
        self.input_ids, self.positions, self.slot_mapping, self.count_mask = self.packed64
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, self.max_blocks, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.token_to_req = torch.arange(n, dtype=torch.int64, device=device)
        # (bucket, context bound) -> the graph; every graph copies its hidden states into
        # `hidden_out`'s first rows (allocated at capture), so no graph holds an output of its
        # own in the pool: with several bounds a bucket, those would add up
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.hidden_out: torch.Tensor | None = None  # [N, hidden]
        self.capture_seconds = 0.0
        self.capture_bytes = 0  # the device memory the capture reserved (pool and buffers)

    def bucket(self, batch: int) -> int | None:
        """The smallest bucket >= batch, or None when the batch is larger than every bucket."""
        i = bisect.bisect_left(self.sizes, batch)
        return self.sizes[i] if i < len(self.sizes) else None

    def metadata(self, bucket: int, bound: int | None = None) -> AttentionMetadata:
        """The attention metadata of bucket rows, as views of the static buffers; max_seq_len
        is `bound` (every row's context within it; default max_model_len)."""
        ones = np.ones(bucket, dtype=np.int64)
        return AttentionMetadata(
            positions=self.positions[:bucket], slot_mapping=self.slot_mapping[:bucket],
            block_tables=self.block_tables[:bucket], seq_lens=self.seq_lens[:bucket],
            query_start_loc=self.query_start_loc[:bucket + 1],
            token_to_req=self.token_to_req[:bucket], block_size=self.block_size,
            max_query_len=1, max_seq_len=bound or self.max_model_len,
            query_lens_np=ones,
            seq_lens_np=ones, token_to_req_np=np.arange(bucket, dtype=np.int64),
            exact_host_lens=False)

    # ---- capture -------------------------------------------------------------------------

    @torch.inference_mode()
    def capture(self) -> float:
        """Capture every bucket, largest first, into one pool. Returns the seconds it took."""
        start = time.perf_counter()
        if self.device.type != "cuda":
            return 0.0
        self._pad_all()
        before = torch.cuda.memory_reserved(self.device)
        pool = torch.cuda.graph_pool_handle()
        set_mask = getattr(self.model, "set_expert_count_mask", None)
        try:
            for bucket in reversed(self.sizes):
                for bound in self.bounds:
                    meta = self.metadata(bucket, bound)
                    if set_mask is not None:
                        set_mask(self.count_mask[:bucket])
                    # warm-up: Triton JIT for this bucket's tile configs, cuBLAS workspaces
                    warm = self.model(self.input_ids[:bucket], self.positions[:bucket], meta)
                    if self.hidden_out is None:  # the largest bucket's rows, its dtype
                        self.hidden_out = warm.new_empty(self.max_batch, warm.shape[-1])
                    del warm
                    torch.cuda.synchronize(self.device)
                    # a fresh metadata for the capture: what the warm-up left in meta.derived
                    # (tensors of the step's first layer, reused by the others) would be baked
                    # into the graph, not recomputed by it, and freed once the capture is done
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        hidden = self.model(self.input_ids[:bucket], self.positions[:bucket],
                                            self.metadata(bucket, bound))
                        self.hidden_out[:bucket].copy_(hidden)
                        del hidden
                    self.graphs[bucket, bound] = graph
        finally:
            if set_mask is not None:
                set_mask(None)
        torch.cuda.synchronize(self.device)
        self.capture_bytes = torch.cuda.memory_reserved(self.device) - before
        self.capture_seconds = time.perf_counter() - start
        return self.capture_seconds

    def report(self, seconds: float) -> str:
        """The capacity report's one-line state, after `capture` took `seconds`."""
        kind = (f"captured, {self.capture_bytes / 2**30:.2f} GiB reserved" if self.graphs
                else "static buffers, eager (no CUDA)")
        why = [f"{b}: {text}" for b, text in sorted(self.kernel_bounds.items())]
        if self.dense_context is not None:
            why.append(f"DSA: within {self.dense_context} dense MLA, no indexer")
        bounds = (f" x {len(self.bounds)} context bounds {', '.join(map(str, self.bounds))} "
                  f"({'; '.join(why)})" if len(self.bounds) > 1 else "")
        return (f"on: {len(self.sizes)} decode batch sizes 1..{self.max_batch}{bounds} ({kind} "
                f"in {seconds:.1f}s), padding < 10% of a batch")

    def _pad_all(self) -> None:
        """Every row as padding (the state captured; also harmless for warm-up)."""
        self.packed64.zero_()
        self.seq_lens.fill_(1)
        self.block_tables.zero_()

    # ---- per step ------------------------------------------------------------------------

    def stage(self, token_ids: np.ndarray, num_computed: np.ndarray,
              block_tables: list[list[int]], bucket: int, steps: int = 1) -> None:
        """Write one decode step's inputs for `len(token_ids)` rows, padded to `bucket`, and
        choose the graph's context bound: the smallest that every context stays within
        through `steps` steps (a multi-step round advances them on the device).

        token_ids [B] int64 (a -1 is left as 0: the caller fills it on the device),
        num_computed [B] int64 = each row's position."""
        b = len(token_ids)
        bs = self.block_size
        width = max((len(t) for t in block_tables), default=1) or 1
        if width > self.max_blocks:
            raise ValueError(f"a block table has {width} blocks, more than max_model_len's "
                             f"{self.max_blocks}")
        table = np.zeros((bucket, width), dtype=np.int32)  # [bucket, width], padding -> block 0
        for i, bt in enumerate(block_tables):
            table[i, :len(bt)] = bt
        host64 = np.zeros((4, bucket), dtype=np.int64)
        pos = num_computed.astype(np.int64)
        host64[0, :b] = np.maximum(token_ids, 0)
        host64[1, :b] = pos
        host64[2, :b] = table[np.arange(b), pos // bs].astype(np.int64) * bs + pos % bs
        host64[3, :b] = 1
        seq = np.ones(bucket, dtype=np.int32)
        seq[:b] = pos + 1
        need = int(pos.max(initial=0)) + steps  # the longest context the round reaches
        self.bound = self.bounds[min(bisect.bisect_left(self.bounds, need),
                                     len(self.bounds) - 1)]
        self.packed64[:, :bucket].copy_(_pinned(host64, self.device), non_blocking=True)
        self.seq_lens[:bucket].copy_(_pinned(seq, self.device), non_blocking=True)
        self.block_tables[:bucket, :width].copy_(_pinned(table, self.device), non_blocking=True)

    def replay(self, bucket: int) -> torch.Tensor:
        """Run bucket's graph on the staged inputs; returns its hidden states [bucket, hidden]
        (graph memory: valid until the next replay)."""
        graph = self.graphs.get((bucket, self.bound))
        if graph is not None:
            graph.replay()
            return self.hidden_out[:bucket]
        set_mask = getattr(self.model, "set_expert_count_mask", None)
        if set_mask is not None:
            set_mask(self.count_mask[:bucket])
        try:
            return self.model(self.input_ids[:bucket], self.positions[:bucket],
                              self.metadata(bucket, self.bound))
        finally:
            if set_mask is not None:
                set_mask(None)

    def advance(self, sampled: torch.Tensor) -> None:
        """Multi-step decode: the next step's inputs from this one's, on the device. sampled [B]
        are the next input ids; rows 0..B-1 move one position on (padding rows stay)."""
        b = sampled.shape[0]
        self.input_ids[:b].copy_(sampled)
        self.positions[:b].add_(1)
        self.seq_lens[:b].add_(1)
        pos = self.positions[:b]
        block = self.block_tables[:b].gather(1, (pos // self.block_size).unsqueeze(1))  # [B, 1]
        self.slot_mapping[:b].copy_(block.squeeze(1).long() * self.block_size
                                    + pos % self.block_size)


def _pinned(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """A fresh host tensor (pinned on CUDA: the copy is asynchronous, and a fresh buffer is never
    overwritten while its copy is still queued)."""
    t = torch.from_numpy(a)
    return t.pin_memory() if device.type == "cuda" else t
