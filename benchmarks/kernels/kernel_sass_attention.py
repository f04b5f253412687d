"""kernel_sass.py's attention kernels (MLA decode and prefill in Triton and Gluon, DSA's sparse
MLA, indexer scores and top-k, GQA): each compiled for sm90 at the launch's constexprs, its
report as kernel_sass.py prints it (that module's docstring says what the report holds)."""

from __future__ import annotations

import argparse
import os

from benchmarks.kernels.sm90_compile import compile_sm90, nospec_of, pdl_level

MLA_POINTERS = {"q_ptr": "*bf16", "cache_ptr": "*bf16", "out_ptr": "*bf16",
                "part_m_ptr": "*fp32", "part_l_ptr": "*fp32", "part_acc_ptr": "*fp32",
                "sel_ptr": "*i32", "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32",
                "query_start_loc_ptr": "*i32", "rows_ptr": "*i32", "token_to_req_ptr": "*i32",
                "tiles_ptr": "*i32", "tok_pos_ptr": "*i64",
                "scale_log2": "fp32"}


def _mla_pointers(args: argparse.Namespace) -> dict[str, str]:
    """MLA_POINTERS with the latent cache's element type: --kv-cache-dtype fp8 compiles the
    float8 e4m3 cache's variant (each load converted to the queries' bf16); SASS_HALF_PARTIALS=1
    the split accumulators in bf16 (reduce_triton.half_partials)."""
    pointers = dict(MLA_POINTERS)
    if getattr(args, "kv_cache_dtype", "auto") == "fp8":
        pointers["cache_ptr"] = "*fp8e4nv"
    if os.environ.get("SASS_HALF_PARTIALS") == "1":
        pointers["part_acc_ptr"] = "*bf16"
    return pointers


def mla_decode(args: argparse.Namespace) -> dict:
    """The absorbed MLA decode kernel (kernels/attention/mla/absorbed_triton.py) at DeepSeek / GLM's
    latent (L 512 + R 64), bf16, a row's heads split into tiles of at most BM."""
    from moeserve.kernels.attention.mla import absorbed_triton as mla_triton
    from moeserve.kernels.triton_common import next_pow2

    bm, bn, warps, stages = args.tile
    tiles, per_tile = mla_triton.head_tiles(args.heads, bm)
    const = dict(NUM_HEADS=args.heads, HEADS_PER_TILE=per_tile,
                 BLOCK_H=max(16, next_pow2(per_tile)), L=512, R=64,
                 BLOCK_SIZE=args.block_size, BLOCK_N=bn, USE_ROWS=False, SPLIT=args.split,
                 IEEE=False)
    kernel = mla_triton._kernels().decode
    return {"head_tiles": tiles,
            **compile_sm90(kernel, _mla_pointers(args), const, nospec_of(args, kernel), warps,
                           stages)}


def mla_decode_gluon(args: argparse.Namespace) -> dict:
    """The Gluon MLA decode (kernels/attention/mla/decode_gluon.py, wgmma) at DeepSeek / GLM's
    latent, bf16: BM unused (64 heads a program), BN keys a tile, WARPS must be 8; --sparse
    its DSA form, --prefill its prefill form (prefill_gluon: query tiles of tokens x heads)."""
    from moeserve.kernels.attention.mla import decode_gluon, prefill_gluon

    _, bn, warps, stages = args.tile
    _, per_tile, block_q = prefill_gluon.prefill_block_q(args.heads)
    const = dict(NUM_HEADS=args.heads, L=512, R=64, BLOCK_SIZE=args.block_size, BLOCK_N=bn,
                 STAGES=stages, USE_ROWS=args.prefill, SPLIT=args.split, OVERLAP=args.overlap,
                 SPARSE=args.sparse, PACKED=args.sparse, PREFILL=args.prefill,
                 HPT=per_tile if args.prefill else decode_gluon.BLOCK_H,
                 BLOCK_Q=block_q if args.prefill else 1, VEC_STORE=args.vector_stores,
                 SLOTS=args.slots)
    kernel = decode_gluon._kernels().decode
    if args.swapped:  # decode_gluon_swapped.py: keys as wgmma's M, at most 32 heads
        from moeserve.kernels.attention.mla import decode_gluon_swapped

        # STAGES 1 (its default, one_stage: SASS_MAXNREG=128 caps the registers as its launch
        # does) or 2
        const = dict(NUM_HEADS=args.heads, L=512, R=64, BLOCK_SIZE=args.block_size,
                     USE_ROWS=False, SPLIT=args.split, VEC_STORE=args.vector_stores,
                     STAGES=stages)
        kernel = decode_gluon_swapped._kernels().decode
    if args.ws:  # decode_gluon_ws.py: its warpgroups specialized (4 + 4 warps; WARPS 4)
        from moeserve.kernels.attention.mla import decode_gluon_ws as ws

        two = bool(os.environ.get("SASS_TWO_PV"))  # two P V warpgroups (4 + 4 + 4 warps)
        os.environ.setdefault("SASS_MAXNREG", str(ws.MAX_REGISTERS_TWO_PV if two
                                                  else ws.MAX_REGISTERS))
        const = dict(NUM_HEADS=args.heads, L=512, R=64, BLOCK_SIZE=args.block_size,
                     USE_ROWS=False, SPLIT=args.split, SPARSE=args.sparse, PACKED=args.sparse,
                     # SASS_PV_SLOTS=0 / 1 overrides the module's slots_by_pv (sparse only)
                     TWO_PV=two, PV_SLOTS=args.sparse and os.environ.get(
                         "SASS_PV_SLOTS", "1" if ws.slots_by_pv else "0") == "1",
                     WORKER_REGS=ws.WORKER_REGISTERS_TWO_PV if two else ws.WORKER_REGISTERS,
                     PDL=pdl_level(), Q_EARLY=args.sparse and pdl_level() >= 2)
        kernel = ws._kernels().decode
    return compile_sm90(kernel, _mla_pointers(args), const, nospec_of(args, kernel), warps, 1)


def mla_decode_flat(args: argparse.Namespace) -> dict:
    """The flat MLA decode (kernels/attention/mla/decode_flat_triton.py) at DeepSeek / GLM's
    latent, bf16: every head in one tile (BM unused), a program an SM over the row tiles."""
    from moeserve.kernels.attention.mla import decode_flat_triton
    from moeserve.kernels.triton_common import next_pow2

    _, bn, warps, stages = args.tile
    const = dict(NUM_PROGRAMS=132, NUM_HEADS=args.heads, BLOCK_H=max(16, next_pow2(args.heads)),
                 L=512, USE_ROWS=False, R=64, BLOCK_SIZE=args.block_size, BLOCK_N=bn,
                 SEARCH_BLOCK=decode_flat_triton.SEARCH_BLOCK, SCAN=True, IEEE=False)
    kernel = decode_flat_triton._kernels().decode
    pointers = {**_mla_pointers(args), "cut_ptr": "*i32"}
    return compile_sm90(kernel, pointers, const, nospec_of(args, kernel), warps, stages)


def mla_prefill(args: argparse.Namespace) -> dict:
    """The absorbed MLA prefill kernel (mla_triton's _prefill_kernel) at DeepSeek / GLM's
    latent, bf16: BM rows a program, as many query tokens as fit beside a tile of heads."""
    from moeserve.kernels.attention.mla import absorbed_triton as mla_triton
    from moeserve.kernels.triton_common import next_pow2

    bm, bn, warps, stages = args.tile
    tiles, per_tile = mla_triton.head_tiles(args.heads, bm)
    block_q = mla_triton._prefill_block_q(mla_triton.TileConfig(*args.tile), args.heads)
    const = dict(NUM_HEADS=args.heads, HEADS_PER_TILE=per_tile, BLOCK_Q=block_q,
                 BLOCK_M=max(16, next_pow2(block_q * per_tile)), L=512, R=64,
                 BLOCK_SIZE=args.block_size, BLOCK_N=bn, IEEE=False)
    kernel = mla_triton._kernels().prefill
    return {"head_tiles": tiles, "block_q": block_q,
            **compile_sm90(kernel, _mla_pointers(args), const, nospec_of(args, kernel), warps,
                           stages)}


def dsa_sparse(args: argparse.Namespace) -> dict:
    """DSA's sparse MLA (kernels/attention/dsa/sparse_triton.py's _sparse_attention_kernel) at
    GLM-5's latent (L 512 + R 64), bf16: a token's heads in tiles of at most BM over its
    selected positions, BN a step."""
    from moeserve.kernels.attention.dsa import sparse_triton as dsa_sparse_triton
    from moeserve.kernels.attention.mla import absorbed_triton as mla_triton
    from moeserve.kernels.triton_common import next_pow2

    bm, bn, warps, stages = args.tile
    tiles, per_tile = mla_triton.head_tiles(args.heads, bm)
    const = dict(NUM_HEADS=args.heads, HEADS_PER_TILE=per_tile,
                 BLOCK_H=max(16, next_pow2(per_tile)), L=512, R=64,
                 BLOCK_SIZE=args.block_size, BLOCK_N=bn, IEEE=False, TILES_FIRST=True,
                 SPLIT=False, PACKED=True, SLOTS=args.slots)
    kernel = dsa_sparse_triton._kernels().sparse_attention
    return {"head_tiles": tiles,
            **compile_sm90(kernel, _mla_pointers(args), const, nospec_of(args, kernel), warps,
                           stages)}


GQA_POINTERS = {**MLA_POINTERS, "k_ptr": "*bf16", "v_ptr": "*bf16"}


def gqa(args: argparse.Namespace) -> dict:
    """The paged GQA attention (kernels/attention/paged_triton.py) at head_dim 128, bf16:
    gqa-prefill, BM rows a program (tokens x the query heads of one KV head); gqa-decode, a
    row's GROUP heads (BM unused). --heads is the query heads a KV head (qwen3-30b-a3b's 8)."""
    from moeserve.kernels.attention import paged_triton
    from moeserve.kernels.triton_common import next_pow2

    bm, bn, warps, stages = args.tile
    group, kern = args.heads, paged_triton._kernels()
    const = dict(NUM_KV_HEADS=4, GROUP=group, HEAD_DIM=128, BLOCK_SIZE=args.block_size,
                 BLOCK_N=bn, IEEE=False)
    if args.kernel == "gqa-prefill":
        block_q = paged_triton._prefill_block_q(paged_triton.TileConfig(*args.tile), group)
        const |= dict(BLOCK_Q=block_q, BLOCK_M=max(16, next_pow2(block_q * group)))
        kernel = kern.prefill
    else:
        const |= dict(BLOCK_G=max(16, next_pow2(group)), USE_ROWS=False, SPLIT=args.split)
        kernel = kern.decode
    return compile_sm90(kernel, GQA_POINTERS, const, nospec_of(args, kernel), warps, stages)


TOPK_POINTERS = {"scores_ptr": "*i32", "work_ptr": "*i32", "out_ptr": "*i32",
                 "positions_ptr": "*i64", "seq_lens_ptr": "*i32", "token_to_req_ptr": "*i32",
                 "ties_ptr": "*i32", "bin_ptr": "*i32"}


INDEX_POINTERS = {"q_ptr": "*bf16", "w_ptr": "*fp32", "cache_ptr": "*bf16", "keys_ptr": "*i32",
                  "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "positions_ptr": "*i64",
                  "token_to_req_ptr": "*i32", "tiles_ptr": "*i32", "scale": "fp32"}


def index_score(args: argparse.Namespace) -> dict:
    """DSA's indexer scores (kernels/attention/dsa/indexer_triton.py) at GLM-5's shape (32
    heads x 128, blocks of 64): a decode token a program, or --block-q tokens a tile, walking
    --key-tiles key tiles."""
    from moeserve.kernels.attention.dsa import indexer_triton

    const = dict(NUM_HEADS=32, BLOCK_H=max(16 // args.block_q, 32), BLOCK_Q=args.block_q,
                 D=128, BLOCK_SIZE=64, BLOCK_N=64, USE_TILES=args.block_q > 1, IEEE=False,
                 KEY_TILES=args.key_tiles, PDL=pdl_level())
    kernel = indexer_triton._kernels().index_score
    return compile_sm90(kernel, INDEX_POINTERS, const, nospec_of(args, kernel), args.warps,
                        args.stages)


def topk(args: argparse.Namespace) -> dict:
    """DSA's radix top-k (kernels/attention/dsa/topk_triton.py, topk_chunks_triton.py,
    topk_coop_triton.py, topk_bisect_triton.py): --form's
    kernel at --block positions a step (a program's chunk for hist / count / write / gather,
    last_levels' step) and --warps; the coop form's registers and shared memory are what its
    residency rule reads."""
    from moeserve.kernels.attention.dsa import topk_chunks_triton, topk_coop_triton, topk_triton

    levels, bins = topk_triton._LEVELS, topk_triton._BINS
    if args.form == "coop":
        kernel = topk_coop_triton._kernels().coop
        const = dict(COUNT_TIES=False, GATHER=args.gather, LEVELS=levels, BLOCK=args.block,
                     BINS=bins)
    elif args.form == "bisect":
        from moeserve.kernels.attention.dsa import topk_bisect_triton

        kernel = topk_bisect_triton._kernels().bisect  # --block: the row's positions
        const = dict(COUNT_TIES=False, CHUNKS=topk_bisect_triton.num_chunks(args.block),
                     CHUNK=topk_bisect_triton.CHUNK,
                     ALIGNED=args.block % topk_bisect_triton.ROW_ALIGN == 0, PDL=pdl_level())
    elif args.form == "row":
        kernel = topk_triton._kernels().row
        const = dict(COUNT_TIES=False, GATHER=args.gather, BLOCK=args.block, BINS=bins)
    else:
        kernel = getattr(topk_chunks_triton._kernels(), args.form)
        const = dict(LEVELS=levels, CHUNK=args.block, BINS=bins)
        const |= {"LEVEL": 0} if args.form == "hist" else {}
        const |= {"COUNT_TIES": False} if args.form == "count" else {}
    return compile_sm90(kernel, TOPK_POINTERS, const, nospec_of(args, kernel), args.warps, 1)
