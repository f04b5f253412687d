"""DSA's decode step at each of kernels_dsa's decode cases, timed after each of kernel_runs'
L2 flushes, against its read bound; and a bare reader's rate over contiguous latent rows of
several sizes after each: what the timer's own flush costs a kernel of the step's size.

Why: triton.testing.do_bench (every kernel benchmark's timer) empties the L2 before each call
by zeroing 256 MB, which leaves the L2 full of dirty lines; the timed call then writes them
back to DRAM while it reads its own bytes (up to 50 MB on an H100, 60 on an H200: as much as
the 32 x 8k step's sparse MLA reads). A served decode step's L2 holds the previous layer's
weights (clean): the "read" flush is that state, the "zero" flush the figures so far.

Each step is the one a full DSA layer runs (dsa_inputs.full_layer_step: the indexer's scores
and top-k, then the sparse MLA) in a CUDA graph, its scores as wide as the served graph's
context bound, at the default PDL level; its phases are also timed alone (`parts_ms`, read
flush: the scores, scores + top-k, the sparse MLA). Writes dsa_flush.json to --out.

    python -m benchmarks.kernels.mla.dsa_flush --out DIR [--cases decode_b32_ctx8k ...]
    python -m benchmarks.kernels.mla.dsa_flush --out DIR --smoke   # tiny shapes, CPU interpreter
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os

import torch

from benchmarks.kernels.kernel_runs import (
    L2_FLUSHES,
    SMOKE_HELP,
    Timer,
    device_ceilings,
    graph_timed,
    make_timer,
    record,
    run_device,
)
from benchmarks.kernels.mla.dsa_inputs import DIM, full_layer_step, latent_inputs, make_step
from benchmarks.kernels.mla.gather_rate import row_sums
from benchmarks.kernels.mla.kernels_dsa import (
    BLOCK,
    DECODE_CASES,
    LATENT,
    ROPE,
    SMOKE_DECODE,
    decode_bound_ms,
    decode_shape,
    graph_bound,
)

# the bare reader's sizes (MB of contiguous latent rows) and launch (rows a program, warps:
# gather_rate's fastest on the H100, gpu_1d87ba9)
READ_MB = (16, 75, 150, 300, 1200)
SMOKE_READ_MB = (0.1,)
READER = (16, 4)


def step_case(name: str, batch: int, context: int, device: str, timers: dict,
              copy_bps: float) -> dict:
    """The case's decode step in a graph after each flush: {"step_ms": {flush: ms},
    "pct_of_bound": {flush: %}} beside its read bound."""
    cuda = device == "cuda"
    dtype, block, topk, heads, latent, rope = decode_shape(device)
    q_i, w, index_cache, meta = make_step([context - 1] * batch, [1] * batch, block, device,
                                          dtype, integers=False)
    q, cache = latent_inputs(batch, index_cache.shape[0], 5, heads=heads, width=latent + rope,
                             block=block, device=device, dtype=dtype)
    bound = graph_bound(topk, context)
    wide = dataclasses.replace(meta, max_seq_len=bound, derived={})

    def step() -> torch.Tensor:
        return full_layer_step(q_i, w, index_cache, wide, q, cache, DIM ** -0.5,
                               (128 + 64) ** -0.5, latent, topk)
    step()
    bound_ms = decode_bound_ms(batch, context, topk, DIM, latent + rope, q.element_size(),
                               copy_bps / 1e12)[0]
    times = {flush: round(graph_timed(timer, step, cuda), 4) for flush, timer in timers.items()}
    return {"case": name, "batch": batch, "context": context, "graph_bound": bound,
            "read_bound_ms": float(f"{bound_ms:.4g}"), "step_ms": times,
            "pct_of_bound": {f: round(100 * bound_ms / ms, 1) for f, ms in times.items()},
            "parts_ms": step_parts((q_i, w, index_cache, wide, q, cache), latent, topk,
                                   timers["read"], cuda)}


def step_parts(inputs: tuple, latent: int, topk: int, timer: Timer, cuda: bool) -> dict:
    """The step's phases each alone in a graph (read flush): the indexer's scores, scores
    and top-k (`indexer`; the top-k's share is the difference), the sparse MLA over the
    indexer's selection (its queries' copies after its wait: no queries_made_earlier)."""
    from moeserve.kernels.attention.dsa import indexer_triton, sparse_triton

    q_i, w, index_cache, meta, q, cache = inputs

    def indexer() -> torch.Tensor:
        return indexer_triton.indexer_topk_triton(q_i, w, index_cache, meta, DIM ** -0.5,
                                                  topk)[0]

    def scores() -> list[torch.Tensor]:
        return [c for _, _, c in indexer_triton.index_score_chunks(q_i, w, index_cache, meta,
                                                                   DIM ** -0.5)]
    positions = indexer()
    sparse = functools.partial(sparse_triton.dsa_attention_triton, q, cache, meta, positions,
                               (128 + 64) ** -0.5, latent, packed=True)
    parts = {"scores": scores, "indexer": indexer, "sparse_mla": sparse}
    return {name: round(graph_timed(timer, fn, cuda), 4) for name, fn in parts.items()}


def read_case(megabytes: float, device: str, timers: dict) -> dict:
    """gather_rate's reader over `megabytes` of contiguous latent rows after each flush:
    {"ms": {flush: ms}, "tbs": {flush: TB/s}}."""
    width = LATENT + ROPE
    rows = int(megabytes * 10 ** 6) // (width * 2) // BLOCK * BLOCK
    cache = torch.ones(rows // BLOCK, BLOCK, width, dtype=torch.bfloat16, device=device)
    order = torch.arange(rows, dtype=torch.int32, device=device)
    got = row_sums(cache, order, LATENT, *READER)
    assert torch.equal(got, torch.full_like(got, READER[0] * width)), "row sums of ones"
    times = {flush: round(graph_timed(timer, lambda: row_sums(cache, order, LATENT, *READER),
                                      device == "cuda"), 4)
             for flush, timer in timers.items()}
    nbytes = rows * width * 2
    return {"megabytes": round(nbytes / 1e6, 1), "ms": times,
            "tbs": {f: round(nbytes / ms / 1e9, 3) for f, ms in times.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory for dsa_flush.json")
    parser.add_argument("--cases", nargs="+", default=None, metavar="NAME",
                        help="only these decode cases (default: all of kernels_dsa's)")
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = parser.parse_args()
    device = run_device(args.smoke, "dsa_flush")
    ceilings = device_ceilings(device)
    cases = SMOKE_DECODE if args.smoke else DECODE_CASES
    unknown = set(args.cases or ()) - {c[0] for c in cases}
    if unknown:
        parser.error(f"--cases: no decode case {sorted(unknown)}; the cases: "
                     f"{[c[0] for c in cases]}")
    timers = {f: make_timer(args.smoke, warmup_ms=25, rep_ms=100, flush=f) for f in L2_FLUSHES}
    from benchmarks.engine.w1_offline import environment

    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "dsa_flush.json")
    result: dict = {"environment": environment(), "ceilings": ceilings.name,
                    "copy_tbps": ceilings.bytes_per_s / 1e12, "reader": READER,
                    "timer": "mean of CUDA-event times after each flush, warmup 25 ms, rep 100 "
                             "ms (zero: triton.testing.do_bench; read: read_flushed_bench)",
                    "steps": [], "reads": []}
    for name, batch, context in cases:
        if args.cases is None or name in args.cases:
            record(result, "steps", step_case(name, batch, context, device, timers,
                                              ceilings.bytes_per_s), path, device)
    for megabytes in SMOKE_READ_MB if args.smoke else READ_MB:
        record(result, "reads", read_case(megabytes, device, timers), path, device)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
