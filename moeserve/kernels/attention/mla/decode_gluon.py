"""Absorbed MLA decode on Hopper's asynchronous tensor cores, in Gluon (Triton's lower-level
language): `decode_gluon`, the same contract as absorbed_triton's split decode (a program a
head tile, decode row and context partition; the partitions combined by reduce_triton).

Why: Triton's tl.dot gives the 20-head decode mma.sync, its operands re-read from shared
memory into registers every key tile: latency-bound on those loads on the H200 (Nsight
Compute, benchmarks/results/gpu_bb408cc/call5). Here every product is a wgmma that reads its
operands from shared memory itself:

    program (head tile, row, partition), 8 warps = 2 warpgroups, BLOCK_H = 64 heads (20
    heads padded, as FlashMLA pads them; 128 heads are two tiles):
      Q  -> shared [64, L] + [64, R]           (cp.async, one group)
      keys tile j (BLOCK_N latent rows, gathered through the block table) -> stage j % STAGES
                                               (cp.async, a group a tile, STAGES - 1 ahead)
      S  = Q_lat K_lat^T + Q_pe K_pe^T         wgmma [64, BLOCK_N], each warpgroup half the keys
      online softmax in fp32 (base 2)          rows reduced across the two warpgroups
      P  -> shared (bf16)
      O += P V,  V = K_lat                     wgmma [64, L], each warpgroup half of L

Within a tile S, softmax and P V run in turn (three CTA barriers a tile), the loads STAGES - 1
tiles ahead; `overlap` issues tile t + 1's S before tile t's softmax. bf16 / fp16 queries and
cache only, L and R powers of two, an sm90 GPU: `supports` says whether it takes a call.

`sparse_gluon` is DSA's sparse MLA on the same kernel (SPARSE): a program's keys are a token's
selected positions, dsa/sparse_triton.py's contract. mla/prefill_gluon.py launches it for the
absorbed prefill (PREFILL): a program's 64 query rows are BLOCK_Q of a row's tokens x a tile of
heads, each masked to its causal context.

Where `supports` holds, the Triton launcher's "auto" decode form runs decode_gluon
(absorbed_triton.auto_decode_form), its prefill rows prefill_gluon (1.07-1.9x the Triton
prefill: gpu_5bd5ebf/call6-7), and DSA's sparse attention sparse_gluon
(dsa/sparse_triton.dsa_attention_triton). The overlap measured no faster and stays off.
Gluon is imported on first use (`_kernels`); the kernel's parts (query rows, key tiles'
copies, scores, online softmax) are in gluon_parts.py, shared with decode_gluon_swapped.py.
Removed after measuring slower (in git's history): a persistent form (one program an SM, its
rows one key stream; gpu_c432eb0/call1, at c432eb0), a block-table prefetch (each tile's cache
rows an iteration ahead; gpu_70a3760/call1, 20 heads 53-62% against 62-74%, at 941ba87).
"""

from __future__ import annotations

import functools
import importlib
import math
from types import SimpleNamespace
from typing import Any

import torch

from moeserve import envs
from moeserve.kernels.attention import metadata
from moeserve.kernels.attention.metadata import AttentionMetadata
from moeserve.kernels.attention.mla import gluon_parts, reduce_triton
from moeserve.kernels.triton_common import MAX_GRID_Y

BLOCK_H = 64  # heads a program: wgmma's M
NUM_WARPS = 8  # two warpgroups: S split by keys, O by value columns
# keys a tile and stages: the fastest on the H200 at 20 and 64 heads in every kernels_mla case
# (gpu_5bd5ebf/call1: 62-72% of the read bound at 1k-4k keys; (32, 3) 47-53%); 225 KB shared
DEFAULT_BLOCK_N, DEFAULT_STAGES = 64, 2
OVERLAP_BLOCK_N, OVERLAP_STAGES = 32, 3  # the overlap needs three stages: (64, 3) does not fit
# Split decodes aim at one program an SM (the Triton kernels' rule takes two): a program holds
# an SM's shared memory, so a second wave is a tail. On the H200 (gpu_c432eb0/call1, mla_once)
# one wave against two: DSA's sparse MLA at 32 tokens x 2,048 keys 0.111 against 0.166 ms,
# the dense decode at 4 rows x 16k keys (20 heads) 0.104 against 0.246, at 32 x 4k (64 heads)
# 0.138 against 0.176.
DECODE_WAVES = 1
# decodes of at most 32 heads by decode_gluon_swapped.py's kernel (keys as wgmma's M: 20 heads
# pay for 32, not 64); MOESERVE_MLA_DECODE_SWAPPED=0 keeps them here. On the H200
# (gpu_70a3760/call1, kernels_mla, 20 heads) 68-82% of the bound at batch 256-2,048 x 1k-4k
# keys against this kernel's 62-74%, 47.8 / 51.9% at W1's contexts against 42.1 / 46.2%; with
# its one key stage (its default since gpu_ff7b345) 70.5-90.2%, and 52.2 / 59.6%
swapped = envs.mla_decode_swapped()
# decodes of more heads whose longest row has more than WS_SHORT_CONTEXT keys by
# decode_gluon_ws.py's warp-specialized kernel (one warpgroup a tile's scores, the other half
# of P V); MOESERVE_MLA_DECODE_WS=0 keeps them here. The choice is the launch's, by max_seq_len:
# a served decode's CUDA graph is captured per context bound, one of them WS_SHORT_CONTEXT
# (`kernel_bounds`, runner/cuda_graphs.py), so a step of short rows replays a graph of this
# kernel. H200 (gpu_fc67c12/call1, share of the bound, this kernel -> it): 4k keys at 256-2,048
# rows 70.0-72.1 -> 78.2-82.9% at 64 heads, 47.7-48.4 -> 53.8-55.7% at 128; 1k level (-0.9 to
# +2.7 points); W1's contexts 36.7 / 41.9 -> 29.9 / 33.7% at 64 heads (they stay here). The
# crossover (gpu_e6ddc73/call3): 64 heads 1-19% slower at 384-768 keys, 3-6% faster at 1,536;
# 128 heads -1 to +3% from 768, 7-8% at 1,536.
ws = envs.mla_decode_ws()
WS_SHORT_CONTEXT = 1024
# DSA's sparse MLA of more than 32 heads by decode_gluon_ws.py's kernel too (`sparse_ws`, at
# L 512, R 64, default tile, no slots), on any sm90 device, with `ws` (MOESERVE_MLA_DECODE_WS=0
# turns both off). GLM-5's DSA decode step in a CUDA graph (kernels_dsa's dsa_graph_ws_ms)
# 1.2-5.8% faster with it in all five cases on the H200 (gpu_e6ddc73/call3), 0.3-4.4% on the
# H100 (call1) and 0.7-2.9% there again (gpu_b8a5462/call2); DSA's prefill, the same launch
# over W3's chunks (kernels_dsa_prefill's sparse_mla_ws_ms), 4.4-7.2% faster on the H100
# (gpu_b8a5462/call2: 7.87 -> 7.52, 6.64 -> 6.17, 1.023 -> 0.977 ms)
ws_sparse = ws
# the decode forms' output (and split partials) stored from 8 consecutive latent columns a
# thread (16-byte stores; 200 -> 216 registers); MOESERVE_MLA_VECTOR_STORES=0 keeps the
# accumulator's layout, for A/Bs. H200 (gpu_7c427c9/call3), W1's contexts at 1,024 / 2,048
# rows: 64 heads 32.6 / 36.0 -> 38.7 / 42.1% of the bound, 128 23.5 / 25.0 -> 28.4 / 29.7, 20
# (swapped) 47.0 / 52.1 -> 48.8 / 52.9; 1k +1.5 to +3.2 points; 4k within -1.7 / +1.1. The
# prefill form (prefill_gluon.py) keeps the accumulator's stores (255 registers).
vector_stores = envs.mla_vector_stores()
# rows longest context first (metadata.longest_first; =0 in MOESERVE_DECODE_LONGEST_FIRST: step
# order): W1 glm-4.7-flash c1024 level (gpu_43c198d). (The kernel-alone A/B, gpu_6b1031a/call2,
# timed absorbed_triton's split kernel: kernels_mla's "auto" passed a Triton tile until 57.)
longest_first = envs.decode_longest_first(default=True)
_DTYPES = (torch.bfloat16, torch.float16)

gl: Any = None  # triton.experimental.gluon.language, bound by _kernels()
# the Hopper builtins the kernel calls, bound by _kernels()
async_copy: Any = None
fence_async_shared: Any = None
warpgroup_mma: Any = None
warpgroup_mma_wait: Any = None
# gluon_parts' jitted functions the kernel calls, bound by _kernels()
_load_tile: Any = None
_scores: Any = None
_valid_keys: Any = None
_query_rows: Any = None
_program_keys: Any = None
_softmax_to_p: Any = None
_nvmma_buffer: Any = None


def supports(q: torch.Tensor, latent_cache: torch.Tensor, kv_lora_rank: int) -> bool:
    """Whether it takes these inputs: sm90, bf16 / fp16 q and cache of one dtype, L, R 2^k."""
    return q.dtype == latent_cache.dtype and supports_cache(latent_cache, kv_lora_rank)


def supports_cache(latent_cache: torch.Tensor, kv_lora_rank: int) -> bool:
    """Whether the kernels take queries of this latent cache's dtype over it (`supports`)."""
    rope = latent_cache.shape[-1] - kv_lora_rank
    return (latent_cache.is_cuda and _is_sm90(latent_cache.device.index)
            and latent_cache.dtype in _DTYPES and _pow2(kv_lora_rank) and _pow2(rope))


@functools.cache
def _is_sm90(index: int | None) -> bool:  # asked once a device: every decode call checks
    return torch.cuda.get_device_capability(index)[0] == 9


def _pow2(n: int) -> bool:
    return n >= 16 and n & (n - 1) == 0


def _swapped():  # the module, imported on use (it imports this one)
    return importlib.import_module("moeserve.kernels.attention.mla.decode_gluon_swapped")


def _ws():  # the module, imported on use (it imports this one)
    return importlib.import_module("moeserve.kernels.attention.mla.decode_gluon_ws")


def kernel_bounds(num_heads: int, latent_cache: torch.Tensor, kv_lora_rank: int
                  ) -> dict[int, str]:
    """Contexts past which a decode of `num_heads` heads over this cache, by `decode_gluon`
    with its default tile, runs another kernel, each with what changes: {WS_SHORT_CONTEXT:
    ...} where the warp-specialized kernel takes the longer launches (decode_gluon_ws's
    `takes_heads`: by the device), else {}."""
    rope = latent_cache.shape[-1] - kv_lora_rank
    if (not ws or not supports_cache(latent_cache, kv_lora_rank)
            or not _ws().takes_shape(kv_lora_rank, rope)
            or not _ws().takes_heads(num_heads, latent_cache.device)):
        return {}
    return {WS_SHORT_CONTEXT: "MLA decode past it warp-specialized (decode_gluon_ws)"}


def decode_kernel(q: torch.Tensor, latent_cache: torch.Tensor, kv_lora_rank: int,
                  max_seq_len: int, default_tile: bool = True) -> str:
    """`decode_gluon`'s kernel for these queries: "swapped" (at most 32 heads), "ws" (rows
    past WS_SHORT_CONTEXT keys) or "gluon" (this module's; at a tile not the default too)."""
    heads = q.shape[1]
    long_ws = ws and max_seq_len > WS_SHORT_CONTEXT and _ws().takes(q, latent_cache, kv_lora_rank)
    return ("gluon" if not default_tile else "swapped" if swapped and _swapped().takes(heads)
            else "ws" if long_ws and _ws().takes_heads(heads, q.device) else "gluon")


def decode_gluon(q: torch.Tensor, latent_cache: torch.Tensor, meta: AttentionMetadata,
                 scale: float, kv_lora_rank: int, out: torch.Tensor,
                 rows: torch.Tensor | None, num_rows: int, max_seq_len: int,
                 num_splits: int | None = None, block_n: int | None = None,
                 stages: int | None = None, overlap: bool = False) -> None:
    """Decode rows (one query each) into out [T, H, L]: `rows` [num_rows] int32 row ids, or
    None for rows 0..B-1 (absorbed_triton._launch_decode's contract). num_splits: context
    partitions a row (default reduce_triton.decode_num_splits, one wave). block_n, stages: default
    `tile`. overlap: each tile's scores issued during the previous tile's softmax (stages >=
    3); the same result."""
    if longest_first and num_rows > 1:  # the same rows, another launch order
        rows = metadata.longest_first(meta, rows)
    kernel = decode_kernel(q, latent_cache, kv_lora_rank, max_seq_len,
                           block_n is None and stages is None and not overlap)
    if kernel != "gluon":
        launch = _swapped().decode_swapped if kernel == "swapped" else _ws().decode_ws
        return launch(q, latent_cache, meta, scale, kv_lora_rank, out, rows, num_rows,
                      max_seq_len, num_splits)
    block_n, stages = tile(block_n, stages, overlap)
    _check(q, latent_cache, kv_lora_rank, stages, overlap)
    num_head_tiles = -(-q.shape[1] // BLOCK_H)
    if num_splits is None:
        num_splits = reduce_triton.decode_num_splits(num_rows, num_head_tiles, max_seq_len,
                                                     q.device, waves=DECODE_WAVES)
    parts = _launch(q, latent_cache, meta, scale, kv_lora_rank, out, num_rows, max_seq_len,
                    num_splits, block_n, stages, overlap, rows=rows)
    if num_splits > 1:
        reduce_triton.reduce_splits(*parts, out, meta.query_start_loc, rows, num_rows,
                                    num_splits)


def sparse_gluon(q: torch.Tensor, latent_cache: torch.Tensor, meta: AttentionMetadata,
                 positions: torch.Tensor, scale: float, kv_lora_rank: int, *,
                 num_splits: int | None = None, packed: bool = False,
                 block_n: int | None = None, stages: int | None = None,
                 overlap: bool = False, slots: bool = False) -> torch.Tensor:
    """DSA's sparse MLA (dsa/sparse_triton.dsa_attention_triton's contract): each token's
    absorbed queries over its selected positions [T, topk] int32 (-1, or past the block
    table: skipped; packed: valid ones first, at most the token's position + 1 of them, so
    the loop stops there) -> [T, H, L]; a token with no valid position gets zeros. slots:
    the positions turned into cache rows by one small launch first
    (sparse_triton.selected_slots), so that each tile's copies wait on one load, not a
    position load feeding a block-table load (the same rows: the same bits)."""
    default_tile = block_n is None and stages is None and not overlap
    block_n, stages = tile(block_n, stages, overlap)
    _check(q, latent_cache, kv_lora_rank, stages, overlap)
    if (positions.dim() != 2 or positions.shape[0] != q.shape[0]
            or positions.dtype != torch.int32 or positions.stride(-1) != 1):
        raise ValueError(f"sparse_gluon: positions must be int32 [T, topk] with T = "
                         f"{q.shape[0]} and a unit last stride, got {positions.dtype} "
                         f"{tuple(positions.shape)} strides {positions.stride()}")
    num_tokens, topk = positions.shape
    out = q.new_empty(num_tokens, q.shape[1], kv_lora_rank)
    if num_tokens == 0:
        return out
    if ws_sparse and default_tile and not slots and (
            _ws().takes(q, latent_cache, kv_lora_rank) and not _swapped().takes(q.shape[1])):
        _ws().sparse_ws(q, latent_cache, meta, positions, scale, kv_lora_rank, out,
                        num_splits, packed)
        return out
    if num_tokens > MAX_GRID_Y:
        raise ValueError(f"sparse_gluon: {num_tokens} tokens in one launch, at most "
                         f"{MAX_GRID_Y} (the grid's y dimension)")
    num_head_tiles = -(-q.shape[1] // BLOCK_H)
    if num_splits is None:
        num_splits = reduce_triton.decode_num_splits(num_tokens, num_head_tiles, topk, q.device,
                                                     waves=DECODE_WAVES)
    if slots:
        from moeserve.kernels.attention.dsa.sparse_triton import selected_slots

        positions = selected_slots(positions, meta, latent_cache.shape[1])
    parts = _launch(q, latent_cache, meta, scale, kv_lora_rank, out, num_tokens, topk,
                    num_splits, block_n, stages, overlap, sel=positions, packed=packed,
                    slots=slots)
    if num_splits > 1:
        reduce_triton.reduce_splits(*parts, out, None, None, num_tokens, num_splits)
    return out


def tile(block_n: int | None, stages: int | None, overlap: bool) -> tuple[int, int]:
    """(keys a tile, stages): the given ones, else the overlap's setting's defaults."""
    default = (OVERLAP_BLOCK_N, OVERLAP_STAGES) if overlap else (DEFAULT_BLOCK_N, DEFAULT_STAGES)
    return block_n or default[0], stages or default[1]


def _check(q: torch.Tensor, latent_cache: torch.Tensor, kv_lora_rank: int, stages: int,
           overlap: bool) -> None:
    if not supports(q, latent_cache, kv_lora_rank):
        raise ValueError("decode_gluon needs an sm90 GPU, bf16 / fp16 q and latent_cache of "
                         "one dtype and power-of-two L and R >= 16; got "
                         f"{q.dtype} / {latent_cache.dtype} on {q.device}, L {kv_lora_rank}, "
                         f"R {q.shape[-1] - kv_lora_rank}")
    if overlap and stages < 3:
        raise ValueError(f"decode_gluon: overlap needs stages >= 3, got {stages}")


def _launch(q: torch.Tensor, latent_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
            kv_lora_rank: int, out: torch.Tensor, num_rows: int, keys: int, num_splits: int,
            block_n: int, stages: int, overlap: bool, *, rows: torch.Tensor | None = None,
            sel: torch.Tensor | None = None, packed: bool = False,
            slots: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One launch over (head tiles, rows or tokens, partitions of `keys`: a row's context, or
    a token's selection when `sel` is given: cache rows with `slots`); returns the split
    partials for the reduce."""
    if not 1 <= num_splits <= reduce_triton.MAX_SPLITS:
        raise ValueError(f"decode_gluon: num_splits must be in 1..{reduce_triton.MAX_SPLITS}, "
                         f"got {num_splits}")
    if num_rows > MAX_GRID_Y:
        raise ValueError(f"decode_gluon: {num_rows} rows in one launch, at most {MAX_GRID_Y} "
                         "(the grid's y dimension)")
    num_heads, dim = q.shape[1:]
    partition = -(-max(1, keys) // num_splits)
    partition = -(-partition // block_n) * block_n  # whole key tiles a partition
    part_m, part_l, part_acc = reduce_triton.split_partials(out, num_rows, num_splits)
    sparse = sel is not None
    _kernels().decode[(-(-num_heads // BLOCK_H), num_rows, num_splits)](
        q, latent_cache, out, part_m, part_l, part_acc,
        meta.block_tables, meta.seq_lens, meta.query_start_loc, rows if rows is not None
        else meta.query_start_loc, sel if sparse else meta.seq_lens, meta.token_to_req,
        meta.positions, scale * math.log2(math.e), partition, num_splits, keys,
        meta.block_tables.shape[1], q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        meta.block_tables.stride(0), sel.stride(0) if sparse else 0,
        NUM_HEADS=num_heads, L=kv_lora_rank, R=dim - kv_lora_rank,
        BLOCK_SIZE=latent_cache.shape[1], BLOCK_N=block_n, STAGES=stages,
        USE_ROWS=rows is not None, SPLIT=num_splits > 1, OVERLAP=overlap, SPARSE=sparse,
        PACKED=packed, PREFILL=False, HPT=BLOCK_H, BLOCK_Q=1, VEC_STORE=vector_stores,
        SLOTS=slots, num_warps=NUM_WARPS)
    return part_m, part_l, part_acc


@functools.cache
def _kernels() -> SimpleNamespace:
    """Jit the functions below on first use (gluon imported here only), bound with the Hopper
    builtins they call as module globals (where the compiler resolves names)."""
    global gl, async_copy, fence_async_shared, warpgroup_mma, warpgroup_mma_wait
    global _load_tile, _scores, _valid_keys, _query_rows, _softmax_to_p, _nvmma_buffer
    global _program_keys
    global _decode_kernel
    from triton.experimental import gluon
    from triton.experimental.gluon.language.nvidia import hopper

    parts = gluon_parts.jitted()
    gl = gluon_parts.gl
    async_copy, fence_async_shared = hopper.async_copy, hopper.fence_async_shared
    warpgroup_mma, warpgroup_mma_wait = hopper.warpgroup_mma, hopper.warpgroup_mma_wait
    _load_tile, _scores, _valid_keys = parts.load_tile, parts.scores, parts.valid_keys
    _query_rows, _softmax_to_p = parts.query_rows, parts.softmax_to_p
    _nvmma_buffer, _program_keys = parts.nvmma_buffer, parts.program_keys
    # rows_ptr: a slice of one index array at any offset (no new compile mid-serving)
    _decode_kernel = gluon.jit(do_not_specialize=["partition", "num_splits", "topk",
                                                  "max_blocks", "stride_table"],
                               do_not_specialize_on_alignment=["rows_ptr"])(_decode_kernel)
    return SimpleNamespace(decode=_decode_kernel)


# ---- Gluon functions (jitted by _kernels; module globals, where the compiler finds names) ----

def _decode_kernel(q_ptr, cache_ptr, out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr,
                   block_tables_ptr, seq_lens_ptr, query_start_loc_ptr, rows_ptr, sel_ptr,
                   token_to_req_ptr, tok_pos_ptr, scale_log2, partition, num_splits, topk,
                   max_blocks, stride_qt, stride_qh, stride_ot, stride_oh, stride_table,
                   stride_sel,
                   NUM_HEADS: gl.constexpr, L: gl.constexpr, R: gl.constexpr,
                   BLOCK_SIZE: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                   USE_ROWS: gl.constexpr, SPLIT: gl.constexpr, OVERLAP: gl.constexpr,
                   SPARSE: gl.constexpr, PACKED: gl.constexpr, PREFILL: gl.constexpr,
                   HPT: gl.constexpr, BLOCK_Q: gl.constexpr, VEC_STORE: gl.constexpr,
                   SLOTS: gl.constexpr):
    """Program (head_tile, i, split): BLOCK_H heads of decode row i over its context
    partition `split` (the module docstring's data flow); SPARSE: of token i over partition
    `split` of its `topk` selected positions (sel_ptr's row i; PACKED: valid ones first, at
    most the token's position + 1); PREFILL (grid (i, head_tile, 1)): query tile i, BLOCK_Q
    tokens x HPT heads of a row as the tile's 64 query rows, each over its causal context
    (rows_ptr: the tiles' rows, then their indices within the row, `topk` tiles)."""
    BH: gl.constexpr = 64
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    # register layouts: the copies' pointer tensors (16-byte vectors along a row), and the
    # two wgmma accumulators, warpgroups side by side along N
    lat_l: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [8, 1], [1, 0])
    pe_l: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (R // 8), R // 8], [8, 1], [1, 0])
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                  instr_shape=[16, BLOCK_N // 2, 16])
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                  instr_shape=[16, L // 2 if L <= 512
                                                               else 256, 16])
    q_lat_s = _nvmma_buffer(dtype, [BH, L])
    q_pe_s = _nvmma_buffer(dtype, [BH, R])
    k_lat_s = _nvmma_buffer(dtype, [STAGES, BLOCK_N, L])
    k_pe_s = _nvmma_buffer(dtype, [STAGES, BLOCK_N, R])
    p_s = _nvmma_buffer(dtype, [BH, BLOCK_N])

    if PREFILL:  # grid (query tiles, head tiles): the tiles past the grid's y limit
        i = gl.program_id(0)
        head_tile = gl.program_id(1)
    else:
        head_tile = gl.program_id(0)
        i = gl.program_id(1)
    split = gl.program_id(2)
    start = split * partition
    if PREFILL:  # keys: positions 0 .. the tile's last token's of the row's context
        req = gl.load(rows_ptr + i)
        q0 = gl.load(rows_ptr + topk + i) * BLOCK_Q  # the tile's first token in the row
        tok = gl.load(query_start_loc_ptr + req).to(gl.int64)
        q_len = (gl.load(query_start_loc_ptr + req + 1) - tok).to(gl.int32)
        seq_len = gl.load(seq_lens_ptr + req)
        end = seq_len - q_len + gl.minimum(q_len, q0 + BLOCK_Q)
        sel = sel_ptr  # unused
    else:  # a decode row's context, or (SPARSE) a token's selection
        req, tok, end, sel = _program_keys(i, start, split, partition, num_splits, topk,
                                           rows_ptr, query_start_loc_ptr, seq_lens_ptr,
                                           token_to_req_ptr, tok_pos_ptr, sel_ptr, stride_sel,
                                           USE_ROWS, SPARSE, PACKED)
    if not PREFILL:  # one query token: _query_rows' tile arguments unused
        q0 = 0
        q_len = 1
    table = block_tables_ptr + req.to(gl.int64) * stride_table
    max_pos = max_blocks * BLOCK_SIZE  # a selected position past the table: never read
    if SLOTS:  # the selection holds cache rows (-1 none): any row is within reach
        max_pos = 2147483647

    # the tile's query rows (padding rows zero-filled): one copy group
    q_at, q_ok = _query_rows(tok, q0, q_len, head_tile, stride_qt, stride_qh,
                             gl.SliceLayout(1, lat_l), NUM_HEADS, HPT, BLOCK_Q, PREFILL)
    dq = gl.arange(0, L, layout=gl.SliceLayout(0, lat_l))
    async_copy.async_copy_global_to_shared(q_lat_s, q_ptr + q_at[:, None] + dq[None, :],
                                           mask=q_ok[:, None])
    q_at, q_ok = _query_rows(tok, q0, q_len, head_tile, stride_qt, stride_qh,
                             gl.SliceLayout(1, pe_l), NUM_HEADS, HPT, BLOCK_Q, PREFILL)
    dp = gl.arange(0, R, layout=gl.SliceLayout(0, pe_l))
    async_copy.async_copy_global_to_shared(q_pe_s, q_ptr + q_at[:, None] + L + dp[None, :],
                                           mask=q_ok[:, None])
    async_copy.commit_group()
    if PREFILL:  # each query row's keys end at its token's position + 1
        r = gl.arange(0, BH, layout=gl.SliceLayout(1, s_l))
        row_end = seq_len - q_len + q0 + r // HPT + 1

    num_tiles = gl.cdiv(gl.maximum(end - start, 0), BLOCK_N)
    nl = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, lat_l))
    np_ = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, pe_l))
    for j in gl.static_range(STAGES - 1):  # the first tiles in flight
        _load_tile(cache_ptr, table, sel, max_pos, start + j * BLOCK_N, end, k_lat_s.index(j),
                   k_pe_s.index(j), nl, dq, np_, dp, L, R, BLOCK_SIZE, SPARSE, SLOTS)
        async_copy.commit_group()

    m_i = gl.full([BH], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_l))
    l_i = gl.full([BH], 0.0, gl.float32, layout=gl.SliceLayout(1, s_l))
    acc = gl.zeros([BH, L], gl.float32, layout=o_l)
    s_zero = gl.zeros([BH, BLOCK_N], gl.float32, layout=s_l)
    keys = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_l))
    if OVERLAP:  # tile 0's scores before the loop; each iteration then issues the next tile's
        async_copy.wait_group(STAGES - 2)  # the queries and tile 0 landed
        gl.thread_barrier()
        fence_async_shared()
        s_cur = _scores(q_lat_s, q_pe_s, k_lat_s.index(0), k_pe_s.index(0), s_zero)
        s_cur = warpgroup_mma_wait(num_outstanding=0, deps=(s_cur,))
    for t in range(num_tiles):
        # every warpgroup is done with the stage the next copy overwrites (tile t - 1's)
        gl.thread_barrier()
        ahead = t + STAGES - 1
        _load_tile(cache_ptr, table, sel, max_pos, start + ahead * BLOCK_N, end,
                   k_lat_s.index(ahead % STAGES), k_pe_s.index(ahead % STAGES), nl, dq, np_, dp,
                   L, R, BLOCK_SIZE, SPARSE, SLOTS)
        async_copy.commit_group()
        if OVERLAP:
            # tile t + 1 landed: its scores run on the tensor cores during tile t's softmax
            # (past the last tile a zero-filled stage's, unused)
            async_copy.wait_group(STAGES - 2)
            gl.thread_barrier()
            fence_async_shared()
            s_next = _scores(q_lat_s, q_pe_s, k_lat_s.index((t + 1) % STAGES),
                             k_pe_s.index((t + 1) % STAGES), s_zero)
            s = s_cur
        else:
            async_copy.wait_group(STAGES - 1)  # tile t's group (and the queries') landed
            gl.thread_barrier()
            fence_async_shared()  # the copies' writes, before the wgmmas read them
            s = _scores(q_lat_s, q_pe_s, k_lat_s.index(t % STAGES), k_pe_s.index(t % STAGES),
                        s_zero)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        if PREFILL:  # causal: a row's keys up to its own token
            s = gl.where((t * BLOCK_N + keys)[None, :] < row_end[:, None], s * scale_log2,
                         float("-inf"))
        else:
            _, valid = _valid_keys(sel, max_pos, start + t * BLOCK_N + keys, end, SPARSE)
            s = gl.where(valid[None, :], s * scale_log2, float("-inf"))
        m_i, l_i, acc = _softmax_to_p(s, m_i, l_i, acc, p_s, o_l)
        acc = warpgroup_mma(p_s, k_lat_s.index(t % STAGES), acc, is_async=True)
        if OVERLAP:  # wgmma groups complete in order: the next tile's scores first
            acc, s_cur = warpgroup_mma_wait(num_outstanding=0, deps=(acc, s_next))
        else:
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    async_copy.wait_group(0)  # no copy left in flight at exit

    # VEC_STORE (`vector_stores`): O leaves through a layout whose threads hold 8 consecutive
    # latent columns (16-byte stores, a warp 256 columns of a row; the conversion's shared
    # memory reuses the key stages, free by now), else from the accumulator's own layout
    # (column pairs: 4-byte pieces)
    st_l: gl.constexpr = (gl.BlockedLayout([1, 8], [1, 32], [8, 1], [1, 0]) if VEC_STORE
                          else o_l)
    do = gl.arange(0, L, layout=gl.SliceLayout(0, st_l))
    if PREFILL:  # each row to its token and head
        l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_l))
        o = gl.convert_layout((acc / gl.where(l_o == 0.0, 1.0, l_o)[:, None]).to(dtype), st_l)
        ro = gl.arange(0, BH, layout=gl.SliceLayout(1, st_l))
        o_tok = tok + q0 + ro // HPT
        o_head = head_tile * HPT + ro % HPT
        o_ok = (ro < BLOCK_Q * HPT) & (q0 + ro // HPT < q_len) & (o_head < NUM_HEADS)
        gl.store(out_ptr + o_tok[:, None] * stride_ot + o_head.to(gl.int64)[:, None] * stride_oh
                 + do[None, :], o, mask=o_ok[:, None])
        return
    ho = head_tile * BH + gl.arange(0, BH, layout=gl.SliceLayout(1, st_l))
    h_ok = ho < NUM_HEADS
    if SPLIT:
        hs = head_tile * BH + gl.arange(0, BH, layout=gl.SliceLayout(1, s_l))
        part = (i * NUM_HEADS + hs) * num_splits + split
        gl.store(part_m_ptr + part, m_i, mask=hs < NUM_HEADS)
        gl.store(part_l_ptr + part, l_i, mask=hs < NUM_HEADS)
        part_o = (i * NUM_HEADS + ho) * num_splits + split
        gl.store(part_acc_ptr + part_o.to(gl.int64)[:, None] * L + do[None, :],
                 gl.convert_layout(acc, st_l), mask=h_ok[:, None])
    else:
        l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_l))
        o = acc / gl.where(l_o == 0.0, 1.0, l_o)[:, None]  # an empty row writes 0
        gl.store(out_ptr + tok * stride_ot + ho.to(gl.int64)[:, None] * stride_oh
                 + do[None, :], gl.convert_layout(o.to(dtype), st_l), mask=h_ok[:, None])
