"""DSA on the GPU (issue 17): the indexer's scoring, query tiles against one token a program;
and the decode step's whole sparse attention against its read bound and against dense MLA.

Shape: GLM-5's lightning indexer (32 heads x 128, bf16 keys, blocks of 64 scattered over one
pool, index_topk 2048). Each case is first checked on integer-valued data (every score exact,
so any summation order selects alike): `indexer_topk_triton` equal to `indexer_topk_ref`, and
the one-token scoring's sort keys equal to the tiles' (`index_score_chunks(block_q=1)`, the
pre-tile kernel's work: every key tile loaded once per token). Then, on random data, timed with
triton.testing.do_bench: the scoring launches alone, tiled and one token a program, and the
whole op (scoring + torch.topk). Reports ms, the key bytes each scoring reads (a program loads
its visible key tiles whole: ceil(kv / BLOCK_N) * BLOCK_N * D * 2 B per tile or token) and the
achieved rate of those bytes. Decode-only steps run one token a program either way (listed as
the baseline).

Decode step (`decode_cases`): GLM-5's attention per layer, one decode token a row at batch 32
to 256 and contexts 8k to 64k, the indexer keys (256 bytes a token) and the latent cache (576
values, 1,152 bytes a token) over the same scattered blocks. Timed apart: the indexer (scores +
top-k), the top-k alone (topk_triton's radix select over the step's scores; and torch.topk over
int64 sort keys built from them, the path it replaced, as topk_torch_ms; the radix select's
default form ("auto"), and its "chunks" form as topk_chunks_ms; each also in a CUDA graph,
topk_graph_ms, topk_torch_graph_ms, topk_chunks_graph_ms (and at each of CHUNK_SIZES positions
a program as topk_chunks_sizes_graph_ms), the "coop" form (one launch, topk_coop_triton.py;
where refused, too many tokens, the reason as topk_coop) as topk_coop_graph_ms with the step's
graph with it as dsa_graph_coop_ms; the "bisect" form (topk_bisect_triton.py, rows of at most
16,384 positions; where refused, the reason as topk_bisect) as topk_bisect_graph_ms and the
step's graph with it as dsa_graph_bisect_ms (and with the scores as wide as the served graph's
context bound, dsa_graph_bound_bisect_ms), at BISECT_WARPS' warps as topk_bisect_warps_graph_ms
/ topk_bisect_warps_wide_graph_ms; the row form at ROW_VARIANTS' launch shapes in graphs as
topk_row_graph_ms; the row, chunks and coop forms with topk_triton.GATHER as
topk_gather_graph_ms, the step's graph with it as dsa_graph_gather_ms and with coop as
dsa_graph_coop_gather_ms), the scores with each scoring program walking SCORE_KEY_TILES key
tiles (score_key_tiles_ms, and the step in a graph as dsa_graph_key_tiles_ms) and launched at
SCORE_LAUNCHES' warps and stages (score_launch_ms, dsa_graph_score_launch_ms), the sparse MLA
over the 2,048 selected positions (sparse_mla_ms the default kernel, sparse_mla_kernel naming
it: decode_gluon.sparse_gluon on sm90 in bf16; sparse_mla_triton_ms the Triton kernel; with
--tiles, also at those TileConfigs; sparse_mla_slots_ms with sparse_triton's `slot_rows`
experiment switch on, its row conversion included; at SPARSE_SPLITS' partitions a token as
sparse_mla_splits_ms, the step's graph with each as dsa_graph_splits_ms; sparse_mla_gluon_ms by
decode_gluon's kernel and sparse_mla_ws_ms / sparse_mla_ws2_ms by decode_gluon_ws
(decode_gluon.ws_sparse, the default on sm90: one or two P V warpgroups) with
dsa_graph_gluon_ms / dsa_graph_ws_ms / dsa_graph_ws2_ms the step's graph with each; with
decode_gluon_ws.slots_by_pv as sparse_mla_ws_slots_ms / sparse_mla_ws2_slots_ms,
dsa_graph_ws_slots_ms / dsa_graph_ws2_slots_ms), the split partials and combine at REDUCE_FORMS
as sparse_mla_reduce_ms / dsa_graph_reduce_ms, the indexer's key write and query RoPE as torch
ops and fused as indexer_rope_graph_ms, and sparse_mla_gluon_slots_ms the Gluon kernel so where
it runs), and dense MLA (mla_triton) on the same cache; the scoring launches alone as score_ms.
The bound is the issue's: (context x 256 + 2,048 x 1,152) bytes a row / 4.27 TB/s, against
indexer + sparse MLA (eager: host gaps between the indexer's launches included), and against
the two captured in one CUDA graph as a served decode step runs them (dsa_graph_ms,
pct_of_bound_graph; and with the scores as wide as the served graph's context bound,
dsa_graph_bound_ms, and that with plain and programmatic dependent launches, dsa_graph_pdl_ms);
the selected latent rows read by a kernel doing nothing else, and as many contiguous ones, as
gather_rate_tbs (gather_rate.py: the ceiling under the sparse MLA's reads); the rows in two
halves, each with caches of its own, one after the other and on two CUDA streams in one graph,
at dsa_streams.SPLITS' partitions a token, as dsa_graph_halves_ms / dsa_graph_two_streams_ms
(dsa_streams.py: whether one half's top-k and combine overlap the other's reads); the dense
kernel's own read bound is context x 1,152 bytes a row. The selection and the sparse output are
first checked against the references on the first rows.

Writes kernels_dsa.json to --out (`--no-decode` skips the decode step, `--decode-only` the
scoring section).

    python -m benchmarks.kernels.mla.kernels_dsa --out DIR
    python -m benchmarks.kernels.mla.kernels_dsa --out DIR --smoke   # tiny shapes, CPU interpreter
    python -m benchmarks.kernels.mla.kernels_dsa --out DIR --decode-only --tiles 64,32,8,3 32,32,8,3
    python -m benchmarks.kernels.mla.kernels_dsa --out DIR --decode-only --cases decode_b32_ctx8k
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
from collections.abc import Callable

import numpy as np
import torch

# none imports triton (the kernels do on first use, after --smoke set the interpreter)
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
from benchmarks.kernels.mla.dsa_inputs import (
    DIM,
    HEADS,
    full_layer_step,
    latent_inputs,
    make_step,
)
from benchmarks.kernels.mla.dsa_streams import time_two_streams
from benchmarks.kernels.mla.gather_rate import time_gather_rate
from benchmarks.kernels.mla.kernels_dsa_forms import (
    BISECT_WARPS,
    time_bisect_settings,
    time_gather,
    time_indexer_rope,
    time_pdl,
    time_reduce_forms,
    time_sparse_splits,
    time_sparse_ws,
)
from benchmarks.kernels.mla.kernels_mla import parse_tile
from moeserve.kernels.attention.dsa import indexer_triton as dsa_triton
from moeserve.kernels.attention.dsa import sparse_triton as dsa_sparse_triton
from moeserve.kernels.attention.dsa import topk_triton
from moeserve.kernels.attention.dsa.reference import dsa_attention_ref, indexer_topk_ref
from moeserve.kernels.attention.metadata import AttentionMetadata
from moeserve.kernels.attention.mla import absorbed_triton as mla_triton
from moeserve.kernels.attention.mla import decode_gluon
from moeserve.kernels.attention.mla.decode_gluon_swapped import SWAPPED_HEADS
from moeserve.runner.cuda_graphs import context_bounds

BLOCK, TOPK = 64, 2048
CASES = (  # (name, computed tokens per row, new tokens per row)
    ("chunk_64_after_8k", [8128], [64]),
    ("chunk_512_after_8k", [8192], [512]),
    ("fresh_2048", [0], [2048]),
    ("4x512_after_4k", [4096] * 4, [512] * 4),
    ("32_decodes_8k_and_chunk_256_after_4k", [8191] * 32 + [4096], [1] * 32 + [256]),
    ("decode_32x8k", [8191] * 32, [1] * 32),
)
SMOKE = (("chunk_17_after_40", [40], [17]), ("2_decodes_and_chunk_9", [30, 5, 0], [1, 1, 9]))
# the decode step: (name, batch, context); GLM-5's MLA: 64 heads, latent 512 + rope 64
DECODE_CASES = (("decode_b32_ctx8k", 32, 8192), ("decode_b32_ctx64k", 32, 65536),
                ("decode_b128_ctx32k", 128, 32768), ("decode_b256_ctx8k", 256, 8192),
                ("decode_b256_ctx64k", 256, 65536))
SMOKE_DECODE = (("decode_b3_ctx40", 3, 40),)
MLA_HEADS, LATENT, ROPE = 64, 512, 64
COPY_TBPS = 4.27  # ANCHORS.md: the H200's copy rate; main() takes its GPU's (device_ceilings)
CHECK_ROWS = 2  # rows of each decode case checked against the references
# the radix top-k's row form at (positions a step, warps), in graphs
ROW_VARIANTS = ((2048, 8), (4096, 8), (2048, 16), (4096, 16), (8192, 32))
# the radix top-k's chunks form at these positions a program, in graphs
CHUNK_SIZES = (256, 512, 1024, 2048)
# indexer_triton.score_key_tiles settings timed: the scores alone and the step in a graph
SCORE_KEY_TILES = (2, 4, 8, 16)
# indexer_triton's (score_warps, score_stages) timed likewise (None: Triton's default stages)
SCORE_LAUNCHES = ((4, None), (8, None), (4, 2), (4, 4), (8, 3))


def key_bytes(meta: AttentionMetadata, block_q: int, block_n: int) -> int:
    """Key bytes the scoring loads: each tile of block_q consecutive tokens of a row (1: each
    token) loads its last token's visible key tiles whole."""
    pos, seq = meta.positions.cpu().numpy(), meta.seq_lens_np
    rows, starts = meta.token_to_req_np, np.cumsum(meta.query_lens_np) - meta.query_lens_np
    last = (np.arange(len(pos)) - starts[rows]) % block_q == block_q - 1
    last |= np.r_[rows[1:] != rows[:-1], True]  # a row's last token ends its tile
    visible = np.minimum(pos[last] + 1, seq[rows[last]])
    return int((-(-visible // block_n) * block_n).sum()) * DIM * 2


def context_mask(meta: AttentionMetadata, t0: int, n: int, num_keys: int) -> torch.Tensor:
    """[n, num_keys]: the positions tokens t0 .. t0 + n see, the scores the kernel writes."""
    tok = slice(t0, t0 + n)
    end = torch.minimum(meta.positions[tok] + 1, meta.seq_lens[meta.token_to_req[tok]].long())
    return torch.arange(num_keys, device=end.device)[None, :] < end[:, None]


def run_case(name: str, computed: list[int], scheduled: list[int], device: str,
             timer: Timer) -> dict:
    dtype, scale = (torch.bfloat16, DIM ** -0.5) if device == "cuda" else (torch.float32, 0.1)
    block, topk = (BLOCK, TOPK) if device == "cuda" else (16, 8)
    q, w, cache, meta = make_step(computed, scheduled, block, device, dtype, integers=True)
    got, _ = dsa_triton.indexer_topk_triton(q, w, cache, meta, 0.25, topk)
    want, _ = indexer_topk_ref(q, w, cache, meta, 0.25, topk)
    assert torch.equal(got, want), f"{name}: the tiled selection differs from the reference"
    tiled = [(t0, k) for t0, _, k in dsa_triton.index_score_chunks(q, w, cache, meta, 0.25)]
    single = [k for _, _, k in dsa_triton.index_score_chunks(q, w, cache, meta, 0.25, 1)]
    assert all(torch.equal(a[seen], b[seen]) for (t0, a), b in zip(tiled, single)
               for seen in [context_mask(meta, t0, a.shape[0], a.shape[1])]), f"{name}: scores"
    q, w, cache, meta = make_step(computed, scheduled, block, device, dtype, integers=False)
    decode = bool((meta.query_lens_np == 1).all())
    block_q = 1 if decode else dsa_triton.index_block_q(HEADS)
    block_n = dsa_triton.index_block_n(DIM)

    def scores(bq: int | None) -> Callable[[], object]:
        return lambda: [k for _, _, k in dsa_triton.index_score_chunks(q, w, cache, meta,
                                                                        scale, bq)]

    row: dict = {"case": name, "rows": len(computed), "tokens": meta.num_tokens,
                 "max_seq_len": meta.max_seq_len, "block_q": block_q}
    for label, bq in (("tiled", None), ("one_token", 1)):
        ms = timer(scores(bq))
        nbytes = key_bytes(meta, block_q if bq is None else 1, block_n)
        row[label] = {"score_ms": round(ms, 4), "key_mib": round(nbytes / 2 ** 20, 2),
                      "key_gb_per_s": round(nbytes / ms / 1e6, 1)}
    row["topk_op_ms"] = round(timer(lambda: dsa_triton.indexer_topk_triton(
        q, w, cache, meta, scale, topk)), 4)
    row["score_speedup"] = round(row["one_token"]["score_ms"] / row["tiled"]["score_ms"], 2)
    return row


def time_score_settings(name: str, args: tuple, scores: torch.Tensor, timer: Timer,
                        settings: dict[str, dict[str, object]], ms_key: str,
                        also: dict[str, Callable[[], float]] | None = None,
                        rtol: float = 0.0) -> dict:
    """The scores timed with indexer_triton's experiment switches set to each of `settings`
    (label -> {switch: value}, restored after), each first checked against `scores` where the
    tokens see them (equal, or within `rtol` of the largest score where a setting may reorder
    the dot's sums: another warp count): {ms_key: {label: ms}} and, for each `also` name,
    {name: {label: fn()}} run with the switches set. A setting that fails its check is
    recorded as {label: "mismatch <relative error>"} and not timed."""
    def score() -> list[torch.Tensor]:
        return [c for _, _, c in dsa_triton.index_score_chunks(*args)]
    seen = context_mask(args[3], 0, scores.shape[0], scores.shape[1])
    out: dict = {ms_key: {}, **{key: {} for key in also or {}}}
    for label, switches in settings.items():
        saved = {k: getattr(dsa_triton, k) for k in switches}
        try:
            for k, v in switches.items():
                setattr(dsa_triton, k, v)
            got, want = torch.cat(score())[seen], scores[seen]
            # as fp32: an ord moves by ~2^31 where a score crosses 0
            fgot, fwant = dsa_triton.scores_fp32(got), dsa_triton.scores_fp32(want)
            err = float((fgot - fwant).abs().max() / fwant.abs().max().clamp_min(1e-30))
            if not (torch.equal(got, want) or err <= rtol):
                print(f"{name}: {label} mismatch {err:.3g}", flush=True)
                out[ms_key][label] = f"mismatch {err:.3g}"
                continue
            out[ms_key][label] = round(timer(score), 4)
            for key, fn in (also or {}).items():
                out[key][label] = round(fn(), 4)
        finally:
            for k, v in saved.items():
                setattr(dsa_triton, k, v)
    return out


def time_score_key_tiles(name: str, args: tuple, scores: torch.Tensor, timer: Timer,
                         also: dict[str, Callable[[], float]] | None = None) -> dict:
    """`time_score_settings` at each of SCORE_KEY_TILES: {"score_key_tiles_ms": {tiles: ms}}."""
    return time_score_settings(name, args, scores, timer,
                               {str(t): {"score_key_tiles": t} for t in SCORE_KEY_TILES},
                               "score_key_tiles_ms", also)


def decode_bound_ms(batch: int, context: int, topk: int, index_dim: int, width: int,
                    itemsize: int, tbps: float | None = None) -> tuple[float, float]:
    """(DSA's read bound, dense MLA's) in ms for one decode step (module doc), at `tbps`
    (default COPY_TBPS, main()'s device's)."""
    rate = (tbps or COPY_TBPS) * 1e12
    sparse = batch * (context * index_dim + min(topk, context) * width) * itemsize
    dense = batch * context * width * itemsize
    return (sparse / rate * 1e3, dense / rate * 1e3)


def decode_shape(device: str) -> tuple[torch.dtype, int, int, int, int, int]:
    """(dtype, cache block, topk, MLA heads, latent L, rope R) of the decode cases: GLM-5's on
    the GPU, tiny ones on the CPU interpreter."""
    if device == "cuda":
        return torch.bfloat16, BLOCK, TOPK, MLA_HEADS, LATENT, ROPE
    return torch.float32, 16, 8, 4, 32, 16


def graph_bound(topk: int, context: int) -> int:
    """The served decode graph's context bound for rows of `context` (GLM-5's bounds): its
    scores are that wide."""
    return next(b for b in context_bounds(topk, 202752) if b >= context)


def run_decode_case(name: str, batch: int, context: int, device: str,
                    timer: Timer, tiles: tuple = ()) -> dict:
    cuda = device == "cuda"
    dtype, block, topk, heads, latent, rope = decode_shape(device)
    scale, mla_scale = DIM ** -0.5, (128 + 64) ** -0.5
    rows = [context - 1] * batch, [1] * batch

    latent_step = functools.partial(latent_inputs, heads=heads, width=latent + rope,
                                    block=block, device=device, dtype=dtype)
    # the check: the first rows' selection and sparse output against the references
    q_i, w, index_cache, meta = make_step(rows[0][:CHECK_ROWS], rows[1][:CHECK_ROWS], block,
                                          device, dtype, integers=True, seed=3)
    got, _ = dsa_triton.indexer_topk_triton(q_i, w, index_cache, meta, 0.25, topk)
    want, _ = indexer_topk_ref(q_i, w, index_cache, meta, 0.25, topk)
    assert torch.equal(got, want), f"{name}: the selection differs from the reference"
    q, cache = latent_step(CHECK_ROWS, index_cache.shape[0], 4)
    out = dsa_sparse_triton.dsa_attention_triton(q, cache, meta, got, mla_scale, latent).float()
    ref = dsa_attention_ref(q.float(), cache.float(), meta, got, mla_scale, latent).float()
    err = float((out - ref).abs().max() / ref.abs().max().clamp(min=1e-30))
    assert err <= (1e-5 if dtype == torch.float32 else 2 ** -6), f"{name}: sparse MLA {err:.3g}"
    # the timed step
    q_i, w, index_cache, meta = make_step(*rows, block, device, dtype, integers=False)
    q, cache = latent_step(batch, index_cache.shape[0], 5)
    positions, _ = dsa_triton.indexer_topk_triton(q_i, w, index_cache, meta, scale, topk)
    scores = torch.cat([k for _, _, k in dsa_triton.index_score_chunks(q_i, w, index_cache,
                                                                        meta, scale)])
    k = min(topk, scores.shape[1])
    # the replaced path's sort keys: ord(score) << 32 | (2^31 - 1 - position)
    keys = (scores.long() << 32) | ((1 << 31) - 1 - torch.arange(scores.shape[1],
                                                                 device=device))
    selected = torch.full((batch, topk), -1, dtype=torch.int32, device=device)
    row: dict = {"case": name, "batch": batch, "context": context, "mla_heads": heads,
                 "topk": topk, "check_error": err}
    row["indexer_ms"] = timer(lambda: dsa_triton.indexer_topk_triton(q_i, w, index_cache, meta,
                                                                     scale, topk))
    row["score_ms"] = timer(lambda: [c for _, _, c in dsa_triton.index_score_chunks(
        q_i, w, index_cache, meta, scale)])
    row["topk_ms"] = timer(lambda: topk_triton.radix_topk(scores, meta, 0, topk, selected))
    chunks = functools.partial(topk_triton.radix_topk, scores, meta, 0, topk,
                               torch.empty_like(selected), form="chunks")
    chunks()
    assert torch.equal(chunks.args[4], selected), f"{name}: the two top-k forms differ"
    row["topk_chunks_ms"] = timer(chunks)
    row["topk_chunks_graph_ms"] = graph_timed(timer, chunks, cuda)
    for size in CHUNK_SIZES if cuda else ():  # the chunks form at each chunk size, in graphs
        fn = functools.partial(chunks, chunk=size)
        fn()
        assert torch.equal(fn.args[4], selected), f"{name}: chunks of {size}"
        row.setdefault("topk_chunks_sizes_graph_ms", {})[size] = round(
            graph_timed(timer, fn, cuda), 4)
    for form in ("coop", "bisect"):  # forms that may refuse a case (too many tokens; rows
        fn = functools.partial(topk_triton.radix_topk, scores, meta, 0, topk,  # too wide)
                               torch.empty_like(selected), form=form)
        try:
            fn()
        except ValueError as refused:
            row[f"topk_{form}"] = str(refused)
        else:
            assert torch.equal(fn.args[4], selected), f"{name}: the {form} top-k differs"
            row[f"topk_{form}_graph_ms"] = graph_timed(timer, fn, cuda)
    for width, warps in ROW_VARIANTS if cuda else ():  # the row form's launch shapes
        saved, topk_triton.ROW_WARPS = topk_triton.ROW_WARPS, warps
        try:  # (not `block`: that is the caches' block size, which later steps use)
            fn = functools.partial(topk_triton.radix_topk, scores, meta, 0, topk,
                                   torch.empty_like(selected), chunk=width, form="row")
            fn()
            assert torch.equal(fn.args[4], selected), f"{name}: row {width, warps}"
            row.setdefault("topk_row_graph_ms", {})[f"{width},{warps}"] = round(
                graph_timed(timer, fn, cuda), 4)
        finally:
            topk_triton.ROW_WARPS = saved
    if "topk_bisect_graph_ms" in row and cuda:  # the bisect form's warps, rows as served
        row |= time_bisect_settings(name, scores, meta, topk, selected, timer, "WARPS",
                                    BISECT_WARPS)
        row |= time_bisect_settings(name, scores, meta, topk, selected, timer, "ALIGN_ROWS",
                                    (False, True))
    row["topk_torch_ms"] = timer(lambda: torch.topk(keys, k, dim=1))
    # both as a served decode step runs them: in a CUDA graph (no host time between launches)
    row["topk_graph_ms"] = graph_timed(
        timer, lambda: topk_triton.radix_topk(scores, meta, 0, topk, selected), cuda)
    row["topk_torch_graph_ms"] = graph_timed(timer, lambda: torch.topk(keys, k, dim=1), cuda)

    def step(m: AttentionMetadata = meta) -> torch.Tensor:  # as a full DSA layer runs it
        return full_layer_step(q_i, w, index_cache, m, q, cache, scale, mla_scale, latent, topk)
    step()
    row["dsa_graph_ms"] = graph_timed(timer, step, cuda)
    # as served: the decode graph's max_seq_len is its context bound (GLM-5's), the scores' width
    row["graph_bound"] = graph_bound(topk, context)
    wide = dataclasses.replace(meta, max_seq_len=row["graph_bound"], derived={})
    row["dsa_graph_bound_ms"] = graph_timed(timer, functools.partial(step, wide), cuda)
    if cuda:
        row |= time_pdl(name, functools.partial(step, wide), timer)
    for form, widths in (("coop", {"": meta}), ("bisect", {"": meta, "bound_": wide})):
        if f"topk_{form}_graph_ms" not in row:  # the step with that top-k, where it ran
            continue
        was, topk_triton.FORM = topk_triton.FORM, form
        try:
            for tag, m in widths.items():  # bound_: rows as wide as the graph's context bound
                step(m)
                row[f"dsa_graph_{tag}{form}_ms"] = graph_timed(
                    timer, functools.partial(step, m), cuda)
        finally:
            topk_triton.FORM = was
    row |= time_gather(name, scores, meta, topk, selected, step, timer, cuda)
    if cuda:  # the rows in two halves on two streams (dsa_streams.py)
        row |= time_two_streams(name, functools.partial(
            make_step, [context - 1] * (batch // 2), [1] * (batch // 2), block, device, dtype,
            False), latent_step, (scale, mla_scale, latent, topk), timer)
    # the selected latent rows read by a kernel doing nothing else (gather_rate.py)
    row |= time_gather_rate(cache, dsa_sparse_triton.selected_slots(positions, meta,
                                                                    cache.shape[1]),
                            latent, timer)
    if cuda:
        row |= time_score_key_tiles(name, (q_i, w, index_cache, meta, scale), scores, timer,
                                    {"dsa_graph_key_tiles_ms": lambda: graph_timed(
                                        timer, step, cuda)})
        row |= time_score_settings(
            name, (q_i, w, index_cache, meta, scale), scores, timer,
            {f"{warps},{stages or 'default'}": {"score_warps": warps, "score_stages": stages}
             for warps, stages in SCORE_LAUNCHES}, "score_launch_ms",
            {"dsa_graph_score_launch_ms": lambda: graph_timed(timer, step, cuda)}, rtol=1e-5)
    # the default (decode_gluon.sparse_gluon on sm90 in bf16) and the Triton kernel
    gluon = decode_gluon.supports(q, cache, latent)
    row["sparse_mla_kernel"] = ("triton" if not gluon else "gluon-ws" if (
        decode_gluon.ws_sparse and q.shape[1] > SWAPPED_HEADS) else "gluon")
    row["sparse_mla_ms"] = timer(lambda: dsa_sparse_triton.dsa_attention_triton(
        q, cache, meta, positions, mla_scale, latent))
    row["sparse_mla_triton_ms"] = timer(lambda: dsa_sparse_triton.dsa_attention_triton(
        q, cache, meta, positions, mla_scale, latent, gluon=False))
    base = dsa_sparse_triton.dsa_attention_triton(q, cache, meta, positions, mla_scale,
                                           latent).float()  # checked above, on a small step
    triton_base = dsa_sparse_triton.dsa_attention_triton(q, cache, meta, positions, mla_scale,
                                                         latent, gluon=False).float()
    if cuda:
        row |= time_sparse_splits(name, (q, cache, meta, positions, mla_scale, latent), base,
                                  (q_i, w, index_cache, meta, scale, topk), timer)
    dsa_sparse_triton.slot_rows = True  # the experiment switch: cache rows first, then the loop
    try:
        assert torch.equal(dsa_sparse_triton.dsa_attention_triton(
            q, cache, meta, positions, mla_scale, latent, gluon=False).float(),
            triton_base), f"{name}: slot rows"
        row["sparse_mla_slots_ms"] = timer(lambda: dsa_sparse_triton.dsa_attention_triton(
            q, cache, meta, positions, mla_scale, latent, gluon=False))
        if decode_gluon.supports(q, cache, latent):  # the Gluon kernel's form of it
            # within the sparse check's 2^-6: the slots form runs decode_gluon's kernel where
            # the default may be decode_gluon_ws's (decode_gluon.ws_sparse), another sum order
            got = dsa_sparse_triton.dsa_attention_triton(q, cache, meta, positions, mla_scale,
                                                         latent).float()
            err = float((got - base).abs().max() / base.abs().max())
            row["sparse_mla_gluon_slots_error"] = err
            assert err <= 2 ** -6, f"{name}: Gluon slot rows {err:.3g}"
            row["sparse_mla_gluon_slots_ms"] = timer(
                lambda: dsa_sparse_triton.dsa_attention_triton(q, cache, meta, positions,
                                                               mla_scale, latent))
    finally:
        dsa_sparse_triton.slot_rows = False
    if decode_gluon.supports(q, cache, latent) and q.shape[1] > SWAPPED_HEADS:
        row |= time_sparse_ws(name, step, (q, cache, meta, positions, mla_scale, latent), base,
                              timer, cuda)
    if cuda:
        row |= time_reduce_forms(name, step, (q, cache, meta, positions, mla_scale, latent),
                                 base, timer)
        row |= time_indexer_rope(name, index_cache, meta, HEADS, timer)
    for tile in tiles:  # the sparse MLA at other tiles (--tiles), first checked against it
        run = functools.partial(dsa_sparse_triton.dsa_attention_triton, q, cache, meta, positions,
                                mla_scale, latent, config=tile)
        err = float((run().float() - base).abs().max() / base.abs().max())
        assert err <= 2 ** -6, f"{name}: sparse MLA at {tile}: {err:.3g} from the default"
        key = f"{tile.block_m},{tile.block_n},{tile.num_warps},{tile.num_stages}"
        row.setdefault("sparse_mla_tiles", {})[key] = round(timer(run), 4)
    row["dense_mla_ms"] = timer(lambda: mla_triton.mla_attention_triton(q, cache, meta,
                                                                        mla_scale, latent))
    row = {key: round(v, 4) if isinstance(v, float) and key != "check_error" else v
           for key, v in row.items()}
    dsa_ms = row["indexer_ms"] + row["sparse_mla_ms"]
    bound, dense_bound = decode_bound_ms(batch, context, topk, DIM, latent + rope,
                                         q.element_size())
    row.update({"dsa_ms": round(dsa_ms, 4), "read_bound_ms": round(bound, 4),
                "pct_of_bound": round(100 * bound / dsa_ms, 1),
                "pct_of_bound_graph": round(100 * bound / row["dsa_graph_ms"], 1),
                "dense_read_bound_ms": round(dense_bound, 4),
                "dense_pct_of_bound": round(100 * dense_bound / row["dense_mla_ms"], 1),
                "speedup_vs_dense": round(row["dense_mla_ms"] / dsa_ms, 2),
                "bytes_predicted_speedup": round(dense_bound / bound, 2)})
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory for kernels_dsa.json")
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    parser.add_argument("--no-decode", action="store_true", help="skip the decode step")
    parser.add_argument("--decode-only", action="store_true", help="only the decode step")
    parser.add_argument("--cases", nargs="+", default=None, metavar="NAME",
                        help="only these decode cases (e.g. decode_b32_ctx8k)")
    parser.add_argument("--tiles", nargs="+", default=[], metavar="BM,BN,W,S",
                        help="also time the decode step's sparse MLA at these TileConfigs")
    parser.add_argument("--l2-flush", choices=L2_FLUSHES, default="zero",
                        help="the timer's L2 flush (kernel_runs; kernels_mla's flag)")
    args = parser.parse_args()
    device = run_device(args.smoke, "kernels_dsa")
    global COPY_TBPS
    ceilings = device_ceilings(device)
    COPY_TBPS = ceilings.bytes_per_s / 1e12
    cases, decode_cases = (SMOKE, SMOKE_DECODE) if args.smoke else (CASES, DECODE_CASES)
    timer = make_timer(args.smoke, warmup_ms=25, rep_ms=100, flush=args.l2_flush)
    from benchmarks.engine.w1_offline import environment

    os.makedirs(args.out, exist_ok=True)
    result: dict = {"environment": environment(), "ceilings": ceilings.name,
                    "l2_flush": args.l2_flush,
                    "copy_tbps": COPY_TBPS, "shape": {
        "heads": HEADS, "dim": DIM, "block_size": BLOCK, "topk": TOPK}, "cases": []}
    path = os.path.join(args.out, "kernels_dsa.json")
    result["decode"] = []
    runs = [] if args.decode_only else [("cases", run_case, c) for c in cases]
    tiles = tuple(parse_tile(t) for t in args.tiles)
    decode = functools.partial(run_decode_case, tiles=tiles)
    unknown = set(args.cases or ()) - {c[0] for c in decode_cases}
    if unknown:
        parser.error(f"--cases: no decode case {sorted(unknown)}; the cases: "
                     f"{[c[0] for c in decode_cases]}")
    runs += [] if args.no_decode else [("decode", decode, c) for c in decode_cases
                                       if args.cases is None or c[0] in args.cases]
    for section, run, (name, *case) in runs:
        record(result, section, run(name, *case, device, timer), path, device)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
