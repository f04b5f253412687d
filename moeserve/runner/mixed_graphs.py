"""CUDA graphs for mixed steps (prompt and decode rows together): piecewise, per token bucket.

A mixed step's attention depends on each row's query and context lengths, which change every
step, so the step cannot be captured whole. Everything else in the forward depends only on the
step's token count: the embedding, projections, norms, RoPE with the KV write, the MLP or MoE
and the final norm. So each bucket of token counts captures the L + 1 pieces between the
model's L attentions, and each attention runs eagerly between two replays:

    piece 0      embed -> layer 0: input norm, attention inputs (projections, RoPE, KV write)
    piece i      layer i-1: output projection, post-attention norm, MLP/MoE
                 -> layer i: input norm, attention inputs                        (0 < i < L)
    piece L      layer L-1: output projection, post-attention norm, MLP/MoE -> final norm
    between      layer i's attention_core over the step's T real tokens, with the step's
    i and i+1    own metadata: it reads the inputs piece i left and writes what piece i+1 reads

The decoder layers' `begin` / `attention_core` / `finish` are the same code their forward runs,
so the two paths cannot drift apart.

Static buffers, sized for the largest bucket N; bucket B's pieces use their first B rows:

    input_ids, positions, slot_mapping, count_mask [N] int64 (one tensor, packed)
    residual [N, hidden] | attention inputs: each tensor of a layer's pre-attention state,
    [N, ...], shared by the layers | attention output [N, heads * v_head_dim]

Pieces hand their outputs on through these buffers rather than through graph-owned tensors, so
the memory pool holds one piece's intermediates, not every layer's. Rows T..B-1 are padding:
token 0 at position 0, writing its KV into slot 0 of the null block (never handed out);
count_mask 0 keeps them out of the expert-load counters; their attention output rows keep
earlier finite values and their hidden rows are dropped.

On CPU (tests) nothing is captured and the pieces run eagerly on the same buffers, so the
bucket, padding and buffer logic is exercised everywhere.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Iterator

import torch

from moeserve.kernels.attention.metadata import AttentionMetadata
from moeserve.runner.cuda_graphs import graph_batch_sizes

MIXED_MAX_PADDING = 0.25  # largest share of a bucket's tokens that may be padding
MIN_MIXED_TOKENS = 2  # a mixed step has a prompt token beside at least one more


def mixed_token_buckets(max_tokens: int) -> list[int]:
    """Token-count buckets for mixed steps, MIN_MIXED_TOKENS..max_tokens (the step's token
    budget), each padding any step to it by under MIXED_MAX_PADDING."""
    if max_tokens < MIN_MIXED_TOKENS:
        raise ValueError(f"a mixed step needs a token budget >= {MIN_MIXED_TOKENS}, "
                         f"got {max_tokens}")
    return [s for s in graph_batch_sizes(max_tokens, MIXED_MAX_PADDING)
            if s >= MIN_MIXED_TOKENS]


State = torch.Tensor | tuple  # a layer's pre-attention state: a tensor or (named) tuples of them


def _tensors(state: State | None) -> Iterator[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        yield state
    elif isinstance(state, tuple | list):
        for part in state:
            yield from _tensors(part)


class _Leaf:
    """A skeleton's stand-in for a tensor."""


_LEAF = _Leaf()


def _skeleton(state: State | None) -> object:
    """`state`'s structure with each tensor replaced by _LEAF (holds no memory)."""
    if isinstance(state, torch.Tensor):
        return _LEAF
    if state is None:
        return None
    items = [_skeleton(p) for p in state]
    return type(state)(*items) if hasattr(state, "_fields") else type(state)(items)


def _rebuild(skeleton: object, parts: Iterator[torch.Tensor]) -> State:
    """A skeleton's (or a state's) structure with its tensors taken from `parts`, in
    `_tensors` order."""
    if isinstance(skeleton, torch.Tensor) or skeleton is _LEAF:
        return next(parts)
    if skeleton is None:
        return None
    items = [_rebuild(p, parts) for p in skeleton]
    return type(skeleton)(*items) if hasattr(skeleton, "_fields") else type(skeleton)(items)


class MixedGraphs:
    """Static buffers and one CUDA graph per (bucket, piece) (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, sizes: list[int], device: torch.device):
        self.model = model
        self.layers = model.model.layers
        if not len(self.layers):
            raise ValueError("piecewise graphs need at least one decoder layer")
        self.sizes = sorted(sizes)
        self.max_tokens = n = self.sizes[-1]
        self.device = device
        self.packed64 = torch.zeros(4, n, dtype=torch.int64, device=device)
        self.input_ids, self.positions, self.slot_mapping, self.count_mask = self.packed64
        dtype = model.model.embed_tokens.dtype
        self.residual = torch.zeros(n, model.config.hidden_size, dtype=dtype, device=device)
        out_dim = self.layers[0].self_attn.attention_out_dim
        self.attn_out = torch.zeros(n, out_dim, dtype=dtype, device=device)
        self.state_skeleton: object = None  # the first pre-attention state's structure
        self.state_bufs: list[torch.Tensor] = []  # one [N, ...] buffer per state tensor
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.hidden: dict[int, torch.Tensor] = {}  # bucket -> its last piece's [B, hidden]
        self.capture_seconds = 0.0
        self.capture_bytes = 0

    @property
    def num_pieces(self) -> int:
        return len(self.layers) + 1

    def bucket(self, num_tokens: int) -> int | None:
        """The smallest bucket >= num_tokens, or None when the step is larger than every one."""
        i = bisect.bisect_left(self.sizes, num_tokens)
        return self.sizes[i] if i < len(self.sizes) else None

    def buffer_bytes(self) -> int:
        bufs = [self.packed64, self.residual, self.attn_out, *self.state_bufs]
        return sum(b.numel() * b.element_size() for b in bufs)

    # ---- the pieces ----------------------------------------------------------------------

    def _piece(self, k: int, b: int) -> torch.Tensor | None:
        """Piece k over the first b rows: reads the buffers, writes the next ones; the last
        piece returns the final hidden states [b, hidden]."""
        inner = self.model.model
        if k == 0:
            hidden, residual = inner.embed(self.input_ids[:b]), None
        else:
            hidden, residual = self.layers[k - 1].finish(self.attn_out[:b], self.residual[:b])
        if k == len(self.layers):
            return inner.final_norm(hidden, residual)
        state, residual = self.layers[k].begin(self.positions[:b], hidden, residual,
                                               self.slot_mapping[:b])
        self._store(state, residual, b)
        return None

    def _store(self, state: State, residual: torch.Tensor, b: int) -> None:
        tensors = list(_tensors(state))
        if self.state_skeleton is None:  # first run (eager: a warm-up, never a capture)
            self.state_skeleton = _skeleton(state)
            self.state_bufs = [torch.zeros((self.max_tokens, *t.shape[1:]), dtype=t.dtype,
                                           device=self.device) for t in tensors]
        if len(tensors) != len(self.state_bufs):
            raise RuntimeError(f"layers hand on different attention states ({len(tensors)} "
                               f"tensors, not {len(self.state_bufs)}): one kind of attention "
                               "per model is supported")
        for buf, t in zip(self.state_bufs, tensors, strict=True):
            buf[:b].copy_(t)
        self.residual[:b].copy_(residual)

    def _state(self, num_tokens: int) -> State:
        """The state the last piece stored, as views of its first num_tokens rows."""
        assert self.state_skeleton is not None
        return _rebuild(self.state_skeleton, (buf[:num_tokens] for buf in self.state_bufs))

    def _run_piece(self, k: int, b: int) -> torch.Tensor | None:
        graph = self.graphs.get((b, k))
        if graph is None:
            return self._piece(k, b)
        graph.replay()
        return self.hidden.get(b) if k == len(self.layers) else None

    # ---- capture -------------------------------------------------------------------------

    @torch.inference_mode()
    def capture(self) -> float:
        """Capture every bucket's pieces, largest bucket first, into one memory pool. Returns
        the seconds it took (0 on CPU, where nothing is captured)."""
        if self.device.type != "cuda":
            return 0.0
        start = time.perf_counter()
        before = torch.cuda.memory_allocated(self.device)
        self.packed64.zero_()  # every row padding: the state captured
        pool = torch.cuda.graph_pool_handle()
        set_mask = getattr(self.model, "set_expert_count_mask", None)
        try:
            for b in reversed(self.sizes):
                if set_mask is not None:
                    set_mask(self.count_mask[:b])
                for k in range(self.num_pieces):
                    self._piece(k, b)  # warm-up: Triton JIT, cuBLAS workspaces, the buffers
                    torch.cuda.synchronize(self.device)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        hidden = self._piece(k, b)
                    self.graphs[(b, k)] = graph
                    if hidden is not None:
                        self.hidden[b] = hidden
        finally:
            if set_mask is not None:
                set_mask(None)
        torch.cuda.synchronize(self.device)
        self.capture_bytes = torch.cuda.memory_allocated(self.device) - before
        self.capture_seconds = time.perf_counter() - start
        return self.capture_seconds

    # ---- per step ------------------------------------------------------------------------

    def run(self, input_ids: torch.Tensor, meta: AttentionMetadata, bucket: int
            ) -> torch.Tensor:
        """One mixed step: input_ids [T] (on the device) with the step's metadata, padded to
        `bucket` >= T. Returns the final hidden states [bucket, hidden] (rows >= T padding;
        graph memory: valid until the bucket's next replay)."""
        t = input_ids.shape[0]
        if not t <= bucket <= self.max_tokens:
            raise ValueError(f"{t} tokens do not fit bucket {bucket} (largest "
                             f"{self.max_tokens})")
        self.input_ids[:t].copy_(input_ids)
        self.positions[:t].copy_(meta.positions)
        self.slot_mapping[:t].copy_(meta.slot_mapping)
        self.count_mask[:t].fill_(1)
        self.packed64[:, t:bucket].zero_()
        set_mask = getattr(self.model, "set_expert_count_mask", None)
        if set_mask is not None and not self.graphs:
            set_mask(self.count_mask[:bucket])
        try:
            for k in range(self.num_pieces):
                hidden = self._run_piece(k, bucket)
                if k < len(self.layers):
                    out = self.layers[k].attention_core(self._state(t), meta)  # [T, H, v]
                    self.attn_out[:t].copy_(out.reshape(t, -1))
        finally:
            if set_mask is not None and not self.graphs:
                set_mask(None)
        assert hidden is not None
        return hidden
