"""One MLA decode attention case for a kernel profiler (Nsight Compute) or a quick A/B: GLM-5's
attention shape (64 heads, or --heads; latent 512 + rope 64, bf16, blocks of 64 scattered over
one pool, kernels_dsa's cases), DSA's sparse MLA over 2,048 selected positions a row or the
dense MLA decode over the whole context. Compiled and warmed up first; the timed calls (CUDA events)
then run between cudaProfilerStart and cudaProfilerStop, so `ncu --profile-from-start off`
sees only them. Prints one JSON line: the median ms, the bytes the op must read and the share
of its read bound (4.27 TB/s), and of the FLOP bound (787 TFLOP/s).

The sparse kind passes its selection packed, as the DSA layer does (the same work here: every
selected position is valid). Without `--gluon` the Triton kernels run (as "auto" would
without decode_gluon); `--gluon` runs mla/decode_gluon.py's kernels, the serving default on
sm90 (--tile's BN and S; `--overlap` its overlap).

The selection (`--select`): "random", 2,048 distinct positions of each row's context drawn
uniformly and sorted ascending (the indexer's output on random scores, without running it);
"first", positions 0 .. 2,047 (each row's first 32 blocks: the same FLOPs and bytes, from
contiguous 73.7 KB blocks instead of rows spread over the context, so that the two show what
the gather costs).

    source benchmarks/gpu_env.sh
    python3 -m benchmarks.kernels.mla.mla_once --kind sparse --batch 256 --context 8192 --splits 1
    ncu --profile-from-start off -k regex:_sparse_attention --section SpeedOfLight ... \
        python3 -m benchmarks.kernels.mla.mla_once --kind sparse --calls 1
"""

from __future__ import annotations

import argparse
import json

import torch

from benchmarks.kernels.kernel_runs import profiled_median_ms
from benchmarks.kernels.mla.kernels_dsa import (
    BLOCK,
    COPY_TBPS,
    LATENT,
    MLA_HEADS,
    ROPE,
    TOPK,
    make_step,
)
from benchmarks.kernels.mla.kernels_mla import parse_tile

PEAK_TFLOPS = 787.0  # ANCHORS.md: the H200's dense bf16 rate


def selection(kind: str, batch: int, context: int, gen: torch.Generator) -> torch.Tensor:
    """[batch, TOPK] int32 ascending positions (module doc's --select)."""
    k = min(TOPK, context)
    if kind == "first":
        return torch.arange(k, dtype=torch.int32, device="cuda").expand(batch, k).contiguous()
    draw = torch.rand(batch, context, generator=gen, device="cuda")
    return draw.topk(k, dim=1).indices.sort(dim=1).values.to(torch.int32).contiguous()


def main() -> None:
    from moeserve.kernels.attention.dsa import sparse_triton
    from moeserve.kernels.attention.mla import absorbed_triton

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", choices=("sparse", "dense"), default="sparse")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--select", choices=("random", "first"), default="random")
    parser.add_argument("--splits", type=int, default=None, help="default: the kernel's")
    parser.add_argument("--tile", default=None, metavar="BM,BN,W,S", help="default: the kernel's")
    parser.add_argument("--slot-rows", action="store_true", help="sparse_triton.slot_rows on")
    parser.add_argument("--calls", type=int, default=20, help="timed calls")
    parser.add_argument("--heads", type=int, default=MLA_HEADS,
                        help="query heads (GLM-4.7-Flash: 20)")
    parser.add_argument("--gluon", action="store_true",
                        help="mla/decode_gluon.py's kernels (wgmma, sm90): --tile's BN and S")
    parser.add_argument("--overlap", action="store_true", help="with --gluon: its overlap")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("mla_once needs a CUDA GPU")
    dtype, scale = torch.bfloat16, (128 + 64) ** -0.5
    rows = [args.context - 1] * args.batch, [1] * args.batch
    _, _, index_cache, meta = make_step(*rows, BLOCK, "cuda", dtype, integers=False)
    gen = torch.Generator(device="cuda").manual_seed(5)
    q = torch.randn(args.batch, args.heads, LATENT + ROPE, generator=gen, device="cuda").to(dtype)
    cache = torch.randn(index_cache.shape[0], BLOCK, LATENT + ROPE, generator=gen,
                        device="cuda").to(dtype)
    del index_cache
    tile = parse_tile(args.tile) if args.tile else None
    gluon = {}
    if args.gluon:
        from moeserve.kernels.attention.mla import decode_gluon

        gluon = {"block_n": tile and tile.block_n, "stages": tile and tile.num_stages,
                 "overlap": args.overlap}
    if args.kind == "sparse":
        sparse_triton.slot_rows = args.slot_rows
        pos = selection(args.select, args.batch, args.context, gen)
        keys = pos.shape[1]

        def fn() -> torch.Tensor:
            if gluon:
                return decode_gluon.sparse_gluon(q, cache, meta, pos, scale, LATENT,
                                                 num_splits=args.splits, packed=True, **gluon)
            return sparse_triton.dsa_attention_triton(q, cache, meta, pos, scale, LATENT,
                                                      config=tile, num_splits=args.splits,
                                                      packed=True, gluon=False)
    else:
        keys = args.context

        def fn() -> torch.Tensor:
            if gluon:
                out = q.new_empty(*q.shape[:2], LATENT)
                decode_gluon.decode_gluon(q, cache, meta, scale, LATENT, out, None,
                                          meta.num_reqs, meta.max_seq_len,
                                          num_splits=args.splits, **gluon)
                return out
            form = absorbed_triton.auto_decode_form(args.heads, args.batch)  # Triton's pick
            return absorbed_triton.mla_attention_triton(q, cache, meta, scale, LATENT,
                                                        decode_splits=args.splits,
                                                        decode_config=tile, decode_form=form)
    ms = profiled_median_ms(fn, args.calls)
    nbytes = args.batch * keys * (LATENT + ROPE) * 2
    flops = 2 * args.batch * args.heads * keys * (2 * LATENT + ROPE)
    read_ms, flop_ms = nbytes / COPY_TBPS / 1e9, flops / PEAK_TFLOPS / 1e9
    print(json.dumps({**vars(args), "ms": round(ms, 4), "read_bound_ms": round(read_ms, 4),
                      "pct_of_read_bound": round(100 * read_ms / ms, 1),
                      "flop_bound_ms": round(flop_ms, 4),
                      "pct_of_flop_bound": round(100 * flop_ms / ms, 1),
                      "tflops": round(flops / ms / 1e9, 1)}), flush=True)


if __name__ == "__main__":
    main()
