"""DSA's decode step with its rows in two halves on two CUDA streams, in one graph: whether one
half's latency-bound phases (the top-k: a program a token on a fraction of the SMs; the split
combine; each launch's ramp and tail) overlap the other half's reads.

Why: at 32 rows of 8k positions (H100, benchmarks/results/gpu_56e6f7e/call1) the step's
kernels run one after another and each leaves the GPU part idle: the bisect top-k's 32
programs hold 32 of 132 SMs for 15 us, and the sparse MLA reads its 78 MB no faster than a
kernel that does nothing but read them (gather_rate.py), so the step sits at ~50% of its read
bound. Two halves on two streams give the scheduler independent work for those gaps. Each
half has its own indexer and latent caches (the same bytes as the whole step's), its rows'
outputs checked equal between the two orders before either is timed.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch

from benchmarks.kernels.kernel_runs import Timer, graph_timed
from benchmarks.kernels.mla.dsa_inputs import full_layer_step

# the sparse MLA's partitions of a token's selection in each half (None: its default, which
# fills the GPU with one half's programs)
SPLITS = (None, 2, 4)


def on_streams(parts: Sequence[Callable[[], torch.Tensor]]) -> Callable[[], list[torch.Tensor]]:
    """One call running each of `parts` on a CUDA stream of its own, forked from the current
    stream and joined back to it (so a graph captures them as parallel branches)."""
    streams = [torch.cuda.Stream() for _ in parts]

    def run() -> list[torch.Tensor]:
        here = torch.cuda.current_stream()
        outs = []
        for stream, part in zip(streams, parts):
            stream.wait_stream(here)
            with torch.cuda.stream(stream):
                outs.append(part())
        for stream in streams:
            here.wait_stream(stream)
        return outs
    return run


def time_two_streams(name: str, make_half: Callable[[int], tuple],
                     latent_step: Callable[[int, int, int], tuple], scales: tuple,
                     timer: Timer) -> dict:
    """make_half(seed) -> (q, w, index cache, metadata) of half the rows (kernels_dsa's
    make_step); latent_step(n, blocks, seed) -> (absorbed queries, latent cache); scales:
    (indexer scale, MLA scale, L, topk). At each of SPLITS: the two halves one after the other
    and on two streams, each in a CUDA graph, as {"dsa_graph_halves_ms": {splits: ms},
    "dsa_graph_two_streams_ms": {splits: ms}}."""
    scale, mla_scale, latent, topk = scales
    halves = []
    for seed in (11, 12):
        q_i, w, index_cache, meta = make_half(seed=seed)
        q, cache = latent_step(meta.num_tokens, index_cache.shape[0], seed)
        halves.append((q_i, w, index_cache, meta, q, cache))

    def step(half: tuple, splits: int | None) -> torch.Tensor:
        return full_layer_step(*half, scale, mla_scale, latent, topk, num_splits=splits)
    out: dict = {"dsa_graph_halves_ms": {}, "dsa_graph_two_streams_ms": {}}
    for splits in SPLITS:
        parts = [functools.partial(step, half, splits) for half in halves]
        want = [part().clone() for part in parts]
        both = on_streams(parts)
        got = both()
        torch.cuda.synchronize()
        assert all(torch.equal(g, w) for g, w in zip(got, want)), (
            f"{name}: the halves on two streams differ from one stream (splits {splits})")
        key = str(splits or "default")
        out["dsa_graph_halves_ms"][key] = round(
            graph_timed(timer, lambda p=parts: [part() for part in p], True), 4)
        out["dsa_graph_two_streams_ms"][key] = round(graph_timed(timer, both, True), 4)
    return out
