"""How the MoE tuners time a candidate: `time_in_graph` (calls captured in one CUDA graph, a
few replays, the median; generic: the quantized tuner, quant/tune.py, uses it too),
`random_tokens` (the random tokens and routing both tuners time on) and `CudaPartTimer` (each
part of `moe_triton` alone on random inputs: the align, the gated launch, the down launch, the
whole op; and torch._grouped_mm). `moe_tune` owns the search and the ledger; this module only
measures.
"""

from __future__ import annotations

import functools
import statistics
from collections.abc import Callable

import torch

from moeserve.kernels.moe.tile_configs import down_tiles

PARTS = ("align", "gated", "down", "moe")  # what one timing measures (moe_tune's Timer)


def time_in_graph(fn: Callable[[], object], calls: int = 10, replays: int = 10) -> float:
    """Median ms per call of `fn`, `calls` of them captured in one CUDA graph and replayed
    `replays` times (after two eager warm-up calls: compilation happens there)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compile and warm up outside the graph
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    del graph
    return statistics.median(times)


def random_tokens(num_tokens: int, hidden: int, num_experts: int, top_k: int,
                  dtype: torch.dtype, gen: torch.Generator
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A tuner's inputs at num_tokens on gen's device: x [T, H] in dtype (randn), then
    topk_weights [T, k] fp32 and topk_ids [T, k] of a random router's top-k (renormalized).
    Shared by the bf16 timer (CudaPartTimer) and the quantized one (quant.tune.QuantTimer)."""
    from moeserve.kernels.routing.select import select_experts

    x = torch.randn(num_tokens, hidden, device=gen.device, generator=gen).to(dtype)
    logits = torch.randn(num_tokens, num_experts, device=gen.device, generator=gen)
    return (x, *select_experts(logits, top_k, renormalize=True))


class CudaPartTimer:
    """Times each part (align, one launch, the whole moe_triton) and moe_grouped_mm on the same
    random inputs per token count, with `time_in_graph` (weights built once, or the caller's).
    A launch timed alone reads the align's output at its BLOCK_M (computed once, kept for the
    token count) and writes buffers of the shapes moe_triton uses, so the kernel variants it
    compiles are the ones moe_triton runs. Inputs live on the weights' device (CUDA when it
    builds them; a test may hand CPU weights and replace `time_in_graph`)."""

    CALLS, REPLAYS = 10, 5

    def __init__(self, num_experts: int, hidden: int, inter: int, top_k: int,
                 dtype: torch.dtype,
                 weights: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        device = weights[0].device if weights is not None else torch.device("cuda")
        gen = torch.Generator(device=device).manual_seed(0)
        if weights is not None:
            self.w13, self.w2 = weights
        else:
            self.w13 = (torch.randn(num_experts, 2 * inter, hidden, device="cuda",
                                    generator=gen) * hidden ** -0.5).to(dtype)
            self.w2 = (torch.randn(num_experts, hidden, inter, device="cuda", generator=gen)
                       * inter ** -0.5).to(dtype)
        self.top_k, self.dtype, self.gen = top_k, dtype, gen
        self._inputs: dict[int, tuple[torch.Tensor, ...]] = {}
        self._aligned: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}

    def inputs(self, num_tokens: int) -> tuple[torch.Tensor, ...]:
        """x, topk_weights, topk_ids at num_tokens (dummy routing), then the launches' buffers
        act [T*k, I] (random: the down launch's input) and out [T*k, H]; kept for one token
        count."""
        if num_tokens not in self._inputs:
            self._inputs.clear()
            self._aligned.clear()
            num_experts, hidden = self.w13.shape[0], self.w13.shape[2]
            inter, pairs = self.w2.shape[2], num_tokens * self.top_k
            device = self.w13.device
            routed = random_tokens(num_tokens, hidden, num_experts, self.top_k, self.dtype,
                                   self.gen)
            act = torch.randn(pairs, inter, device=device, generator=self.gen).to(self.dtype)
            out = torch.empty(pairs, hidden, device=device, dtype=self.dtype)
            self._inputs[num_tokens] = (*routed, act, out)
        return self._inputs[num_tokens]

    def __call__(self, part: str, config: dict, num_tokens: int) -> float:
        from moeserve.kernels.moe.align import moe_align_block_size_triton
        from moeserve.kernels.moe.fused_triton import _launch, moe_triton

        x, weights, ids, act, out = self.inputs(num_tokens)
        num_experts = self.w13.shape[0]
        if part == "moe":
            fn = functools.partial(moe_triton, x, self.w13, self.w2, weights, ids, config=config)
        elif part == "align":
            fn = functools.partial(moe_align_block_size_triton, ids, num_experts,
                                   config["BLOCK_M"])
        elif part in ("gated", "down"):
            key = (num_tokens, config["BLOCK_M"])
            if key not in self._aligned:
                self._aligned[key] = moe_align_block_size_triton(ids, num_experts,
                                                                 config["BLOCK_M"])
            sorted_ids, expert_ids, post_padded = self._aligned[key]
            gated = part == "gated"
            tiles = ({k: v for k, v in config.items() if k != "down"} if gated
                     else down_tiles(config))  # with their options (ONE_DOT, PERSISTENT)
            fn = functools.partial(
                _launch, x if gated else act, self.w13 if gated else self.w2,
                act if gated else out, weights, sorted_ids, expert_ids, post_padded, ids.numel(),
                tiles, a_row_div=self.top_k if gated else 1, c_row_div=1, gated=gated,
                atomic=False)
        else:
            raise ValueError(f"part must be one of {PARTS}, got {part!r}")
        return time_in_graph(fn, self.CALLS, self.REPLAYS)

    def grouped_mm(self, num_tokens: int) -> float:
        from moeserve.kernels.moe.grouped_mm import moe_grouped_mm

        x, weights, ids, _, _ = self.inputs(num_tokens)
        return time_in_graph(lambda: moe_grouped_mm(x, self.w13, self.w2, weights, ids),
                             self.CALLS, self.REPLAYS)
