"""Absorbed MLA decode in Gluon with its warpgroups given different work (warp
specialization), for 64 heads a program: `decode_ws` (decode_gluon.decode_gluon's contract) and
`sparse_ws` (DSA's sparse MLA, decode_gluon.sparse_gluon's contract).

Why: decode_gluon splits each key tile's scores between its warpgroups (32 keys each), so each
reads the whole query tile from shared memory for half the keys, and the softmax's row maxima
and sums cross the warpgroups through shared memory and a CTA barrier; scores, softmax and
P V then run in turn. Here one warpgroup computes a tile's scores whole and the others P V a
tile behind, as FlashMLA splits the work:

    program (head tile, row or token, partition): 64 heads, keys in tiles of 64, two stages
    scores warpgroup (the default partition, 4 warps; it issues every copy):
      Q -> shared [64, L] + [64, R]; tiles 0 and 1 -> stages 0 and 1     (cp.async;
                   S_0 waits for Q and tile 0 only)
      per tile t:  online softmax of S_t (fp32, base 2: a row's 64 keys in this warpgroup)
                   P_t (bf16) and the rescale alpha_t -> shared, `p_ready`
                   O_left = O_left * alpha_t + P_t V_t[:, :L/2]   (P_t from registers;
                   not with `two_pv`)
                   S_{t+1} = Q K_{t+1}^T issued, then (P V done with V_t: `kv_free`) tile
                   t + 2 copied into t's stage
    P V warpgroup (a worker, 4 warps; two with `two_pv`, O's halves):
      per tile t:  (SPARSE, `slots_by_pv`: tile t + 2's selection and block-table loads
                   issued) (`p_ready`) O_cols = O_cols * alpha_t + P_t V_t[:, cols]; (tile
                   t + 2's cache rows -> shared) `p_free`, `kv_free`
    the end: each stores its columns; the scores warpgroup hands over the row sums (`done`).

Shared memory: Q 72 KB, two key stages 144 KB, P 8 KB: 225 KB (and 1 KB of cache rows with
`slots_by_pv`). bf16 / fp16, L = 512 and R = 64 (DeepSeek and GLM's latent), an sm90 GPU.
SPARSE: a program's keys are a token's selected positions (decode_gluon's sparse form); with
`slots_by_pv` (on) the scores warpgroup's copies and mask read each tile's cache rows from
shared memory, where the P V warpgroup left them. Split partials are decode_gluon's (reduce_triton
combines them).

decode_gluon routes here (`decode_gluon.ws`, on unless MOESERVE_MLA_DECODE_WS=0) its launches
of more than decode_gluon_swapped's heads whose longest row has more than
decode_gluon.WS_SHORT_CONTEXT keys (decode CUDA graphs capture a bound there: decode_gluon's
`kernel_bounds`). On the H200 (benchmarks/results/gpu_fc67c12/call1, kernels_mla): at 4,096 keys
78.2-82.9% of the bound at 64 heads (decode_gluon 70.0-72.1%), 53.8-55.7% at 128 (47.7-48.4%);
at 1,024 keys level or faster in 5 of 6 cases (-0.9 to +2.7 points); at W1's ~192 keys slower
(29.9 / 33.7% against 36.7 / 41.9% at 64 heads: the prologue and the hand-offs of 3 tiles a
row), hence the threshold. The P V warpgroup's issuing the copies measured slower there (72.6-
72.9% at 64 heads and 4k keys) and was removed (git history at 14ca5ca, `wg1_loads`).

DSA's sparse form at 32 tokens x 8k (one program an SM, 128 programs: 4 splits of 512 selected
keys) reads DRAM at 48-51% of peak (Nsight Compute, H100, benchmarks/results/gpu_48511b5/
call1: 47.5 us for 78 MB, plus 16.8 MB of fp32 split partials written and 8.7 us of their
combine). Two changes aimed at its copies measured slower on the H100 in CUDA graphs and were
removed: loading tile t + 1's validity and tile t + 2's cache rows at tile t's start (the step
0.1137 against 0.1100 ms at 32 x 8k, 0.5364 against 0.5312 at 256 x 8k; gpu_6f54c80/call2, in
git's history there), and 32-key tiles in three or four stages, three tiles' copies in flight
(three / four stages: the step 0.1093 / 0.1109 against 0.1075 ms at 32 x 8k, 0.5423 / 0.5416
against 0.5141 at 256 x 8k, gpu_5c4e2c2/call3; 0.3134 / 0.3147 against 0.3095 at 32 x 64k,
gpu_2e525ad/call4; in git's history at 5c4e2c2). The copies in flight are not what holds it.
"""

from __future__ import annotations

import functools
import math
from types import SimpleNamespace
from typing import Any

import torch

from moeserve.kernels.attention.metadata import AttentionMetadata
from moeserve.kernels.attention.mla import decode_gluon, gluon_parts, reduce_triton
from moeserve.kernels.triton_common import MAX_GRID_Y, pdl_kwargs, queries_early

BLOCK_H = 64  # heads a program (wgmma's M)
BLOCK_N = 64  # keys a tile
NUM_WARPS = 4  # the default partition's; each worker adds four
# registers a thread of the P V warpgroup (setmaxnreg): its accumulator [64, 256] fp32 is 128
WORKER_REGISTERS = 192
MAX_REGISTERS = 240  # the kernel's cap: the scores warpgroup takes what the worker leaves
# two P V warpgroups (`two_pv`: O's left and right halves, the scores warpgroup none of P V,
# so its path a tile is the scores and softmax alone; 12 warps): the cap a thread at launch is
# 168 (65,536 registers / 384 threads), each P V warpgroup raised to 176, the scores
# warpgroup left with 152. An A/B switch (kernels_mla's gluon-ws2 form) until the H200
# measures it
two_pv = False
MAX_REGISTERS_TWO_PV = 168
WORKER_REGISTERS_TWO_PV = 176
# The fewest heads it takes past decode_gluon.WS_SHORT_CONTEXT keys, by device (matched by
# name; others get the H100's): it pays where the decode nears the tensor cores' rate, and 64
# heads' 121 FLOPs a byte are 0.59 of the H200's ridge (787 TFLOP/s over 4.27 TB/s, measured)
# but 0.41 of the H100's (798 over 3.0). On an H100 (gpu_e6ddc73/call1, kernels_mla
# --crossover, ms this kernel -> it) 64 heads were slower at every context of 384 to 4,096
# keys (4,096 at 256-2,048 rows: 0.439 -> 0.454, 1.722 -> 1.739, 3.445 -> 3.471), 128 heads
# faster from 1,024 keys (2,048 rows: 1.623 -> 1.572; 1,024 x 4,096: 3.097 -> 2.695), level at 768.
WS_MIN_HEADS = {"H200": 33, "H100": 65}
WS_MIN_HEADS_OTHER = 65
# DSA's sparse form: the P V warpgroup leaves each tile's cache rows in shared memory two tiles
# ahead (the module docstring); off: the scores warpgroup loads them where it uses them, as it
# waited on them ~30% of its loop (gpu_de8d30e/call6). On since gpu_9144cb1/call8 (H100,
# graphs): DSA's step 0.4728 against 0.5046 ms at 256 x 8k (80.4 against 75.3% of the read
# bound), 0.1052 against 0.1069 at 32 x 8k; the same with two P V warpgroups
slots_by_pv = True

gl: Any = None  # bound by _kernels(), as in decode_gluon
async_copy: Any = None
fence_async_shared: Any = None
warpgroup_mma: Any = None
warpgroup_mma_wait: Any = None
mbarrier: Any = None
_load_tile: Any = None
_valid_keys: Any = None
_nvmma_buffer: Any = None
_program_keys: Any = None
_query_rows: Any = None
_scores: Any = None
_slots_of: Any = None  # gluon_parts' slot helpers and PDL gate, bound by _kernels()
_copy_rows: Any = None
_pdl_gate: Any = None
_store_o: Any = None


def takes(q: torch.Tensor, latent_cache: torch.Tensor, kv_lora_rank: int) -> bool:
    """Whether it takes this decode: decode_gluon's inputs at L 512, R 64."""
    return (decode_gluon.supports(q, latent_cache, kv_lora_rank)
            and takes_shape(kv_lora_rank, q.shape[-1] - kv_lora_rank))


def takes_shape(kv_lora_rank: int, rope: int) -> bool:
    """Whether its one tile fits this latent: L 512, R 64 (DeepSeek's and GLM's)."""
    return kv_lora_rank == 512 and rope == 64


@functools.cache
def _device_name(index: int | None) -> str:
    return torch.cuda.get_device_name(index)


def min_heads(device: torch.device) -> int:
    """The fewest heads whose decodes on this CUDA device it takes (WS_MIN_HEADS)."""
    name = _device_name(device.index)
    return next((n for key, n in WS_MIN_HEADS.items() if key in name), WS_MIN_HEADS_OTHER)


def takes_heads(num_heads: int, device: torch.device) -> bool:
    """Whether a decode of `num_heads` heads on this device is its past WS_SHORT_CONTEXT keys
    (decode_gluon_swapped's heads never are)."""
    return num_heads >= min_heads(device) and not decode_gluon._swapped().takes(num_heads)


def decode_ws(q: torch.Tensor, latent_cache: torch.Tensor, meta: AttentionMetadata,
              scale: float, kv_lora_rank: int, out: torch.Tensor, rows: torch.Tensor | None,
              num_rows: int, max_seq_len: int, num_splits: int | None = None) -> None:
    """Decode rows (one query each) into out [T, H, L] (decode_gluon.decode_gluon's contract:
    `rows` [num_rows] int32 row ids, or None for rows 0..B-1). num_splits: context partitions
    a row (default reduce_triton.decode_num_splits over one wave)."""
    if not takes(q, latent_cache, kv_lora_rank):
        raise ValueError("decode_ws needs an sm90 GPU, bf16 / fp16 q and latent_cache of one "
                         f"dtype, L 512 and R 64; got {q.dtype} / {latent_cache.dtype} on "
                         f"{q.device}, L {kv_lora_rank}, R {q.shape[-1] - kv_lora_rank}")
    if num_rows > MAX_GRID_Y:
        raise ValueError(f"decode_ws: {num_rows} rows in one launch, at most {MAX_GRID_Y} "
                         "(the grid's y dimension)")
    if num_rows == 0:
        return
    _launch(q, latent_cache, meta, scale, kv_lora_rank, out, rows, num_rows, max_seq_len,
            num_splits)


def sparse_ws(q: torch.Tensor, latent_cache: torch.Tensor, meta: AttentionMetadata,
              positions: torch.Tensor, scale: float, kv_lora_rank: int, out: torch.Tensor,
              num_splits: int | None = None, packed: bool = False) -> None:
    """DSA's sparse MLA into out [T, H, L] (decode_gluon.sparse_gluon's contract, checked
    there: positions int32 [T, topk], -1 or past the block table skipped; packed: valid ones
    first, at most the token's position + 1 of them)."""
    if not takes(q, latent_cache, kv_lora_rank):
        raise ValueError("sparse_ws needs an sm90 GPU, bf16 / fp16 q and latent_cache of one "
                         f"dtype, L 512 and R 64; got {q.dtype} / {latent_cache.dtype} on "
                         f"{q.device}, L {kv_lora_rank}, R {q.shape[-1] - kv_lora_rank}")
    if q.shape[0] > MAX_GRID_Y:
        raise ValueError(f"sparse_ws: {q.shape[0]} tokens in one launch, at most {MAX_GRID_Y} "
                         "(the grid's y dimension)")
    if q.shape[0]:
        _launch(q, latent_cache, meta, scale, kv_lora_rank, out, None, q.shape[0],
                positions.shape[1], num_splits, sel=positions, packed=packed)


def _launch(q: torch.Tensor, latent_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
            kv_lora_rank: int, out: torch.Tensor, rows: torch.Tensor | None, num_rows: int,
            keys: int, num_splits: int | None, sel: torch.Tensor | None = None,
            packed: bool = False) -> None:
    """One launch over (head tiles, rows or tokens, partitions of `keys`: a row's context, or
    a token's selection `sel`), then the splits' reduce."""
    num_heads = q.shape[1]
    head_tiles = -(-num_heads // BLOCK_H)
    if num_splits is None:
        num_splits = reduce_triton.decode_num_splits(num_rows, head_tiles, keys, q.device,
                                                     waves=decode_gluon.DECODE_WAVES)
    if not 1 <= num_splits <= reduce_triton.MAX_SPLITS:
        raise ValueError(f"decode_ws: num_splits must be in 1..{reduce_triton.MAX_SPLITS}, "
                         f"got {num_splits}")
    partition = -(-max(1, keys) // num_splits)
    partition = -(-partition // BLOCK_N) * BLOCK_N  # whole key tiles a partition
    part_m, part_l, part_acc = reduce_triton.split_partials(out, num_rows, num_splits)
    sparse = sel is not None
    pdl = pdl_kwargs(q.device)
    _kernels().decode[(head_tiles, num_rows, num_splits)](
        q, latent_cache, out, part_m, part_l, part_acc, meta.block_tables, meta.seq_lens,
        meta.query_start_loc, rows if rows is not None else meta.query_start_loc,
        sel if sparse else meta.seq_lens, meta.token_to_req, meta.positions,
        scale * math.log2(math.e), partition, num_splits, keys, meta.block_tables.shape[1],
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), meta.block_tables.stride(0),
        sel.stride(0) if sparse else 0,
        NUM_HEADS=num_heads, L=kv_lora_rank, R=q.shape[2] - kv_lora_rank,
        BLOCK_SIZE=latent_cache.shape[1], USE_ROWS=rows is not None, SPLIT=num_splits > 1,
        SPARSE=sparse, PACKED=packed, TWO_PV=two_pv, PV_SLOTS=sparse and slots_by_pv,
        WORKER_REGS=WORKER_REGISTERS_TWO_PV if two_pv else WORKER_REGISTERS,
        num_warps=NUM_WARPS, maxnreg=MAX_REGISTERS_TWO_PV if two_pv else MAX_REGISTERS,
        Q_EARLY=sparse and pdl["PDL"] >= 2 and queries_early(), **pdl)
    if num_splits > 1:
        reduce_triton.reduce_splits(part_m, part_l, part_acc, out,
                                    None if sparse else meta.query_start_loc, rows, num_rows,
                                    num_splits)


@functools.cache
def _kernels() -> SimpleNamespace:
    """Jit the kernel and its partitions on first use (gluon imported here only), bound with
    the builtins and gluon_parts' functions they call as module globals."""
    global gl, async_copy, fence_async_shared, warpgroup_mma, warpgroup_mma_wait, mbarrier
    global _load_tile, _valid_keys, _nvmma_buffer, _program_keys, _query_rows, _scores, _pdl_gate
    global _ws_kernel, _scores_partition, _pv_partition, _store_o, _slots_of, _copy_rows
    from triton.experimental import gluon
    from triton.experimental.gluon.language.nvidia import hopper

    parts = gluon_parts.jitted()
    gl = gluon_parts.gl
    async_copy, fence_async_shared = hopper.async_copy, hopper.fence_async_shared
    warpgroup_mma, warpgroup_mma_wait = hopper.warpgroup_mma, hopper.warpgroup_mma_wait
    mbarrier = hopper.mbarrier
    _load_tile, _valid_keys, _nvmma_buffer = parts.load_tile, parts.valid_keys, parts.nvmma_buffer
    _program_keys, _query_rows, _scores = parts.program_keys, parts.query_rows, parts.scores
    _scores_partition = gluon.jit(_scores_partition)
    _pv_partition = gluon.jit(_pv_partition)
    _slots_of, _copy_rows, _pdl_gate = parts.slots_of, parts.copy_rows, parts.pdl_gate
    _store_o = parts.store_o
    _ws_kernel = gluon.jit(do_not_specialize=["partition", "num_splits", "keys", "max_blocks",
                                              "stride_table"],
                           do_not_specialize_on_alignment=["rows_ptr"])(_ws_kernel)
    return SimpleNamespace(decode=_ws_kernel)


# ---- Gluon functions (jitted by _kernels; module globals, where the compiler finds names) ----

def _ws_kernel(q_ptr, cache_ptr, out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr,
               block_tables_ptr, seq_lens_ptr, query_start_loc_ptr, rows_ptr, sel_ptr,
               token_to_req_ptr, tok_pos_ptr, scale_log2, partition, num_splits, keys,
               max_blocks, stride_qt, stride_qh, stride_ot, stride_oh, stride_table, stride_sel,
               NUM_HEADS: gl.constexpr, L: gl.constexpr, R: gl.constexpr,
               BLOCK_SIZE: gl.constexpr, USE_ROWS: gl.constexpr, SPLIT: gl.constexpr,
               SPARSE: gl.constexpr, PACKED: gl.constexpr, TWO_PV: gl.constexpr,
               WORKER_REGS: gl.constexpr, PV_SLOTS: gl.constexpr, PDL: gl.constexpr,
               Q_EARLY: gl.constexpr):
    """Program (head_tile, i, split): 64 heads of decode row i over its context partition
    `split`, or (SPARSE) of token i over that partition of its selection (the module
    docstring's data flow; TWO_PV: two P V warpgroups, O's halves, none in the scores one).
    PDL: launched early, it waits for the previous kernel after its barriers' set-up
    (gluon_parts' pdl_gate); Q_EARLY (DSA's sparse form at PDL level 2, its queries made
    before the indexer's kernels: layers/dsa.py) after its queries' copies are issued."""
    BH: gl.constexpr = 64
    BN: gl.constexpr = 64
    HALF: gl.constexpr = L // 2
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    q_lat_s = _nvmma_buffer(dtype, [BH, L])
    q_pe_s = _nvmma_buffer(dtype, [BH, R])
    k_lat_s = _nvmma_buffer(dtype, [2, BN, L])
    k_pe_s = _nvmma_buffer(dtype, [2, BN, R])
    p_s = _nvmma_buffer(dtype, [BH, BN])
    vec_l: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    alpha_s = gl.allocate_shared_memory(gl.float32, [BH], vec_l)
    l_s = gl.allocate_shared_memory(gl.float32, [BH], vec_l)
    # PV_SLOTS: tile t's cache rows at slots_s[t % 4] (written two tiles ahead, read by the
    # softmax's mask two tiles later)
    slots_s = gl.allocate_shared_memory(gl.int32, [4 if PV_SLOTS else 1, BN], vec_l)
    bar_l: gl.constexpr = mbarrier.MBarrierLayout()
    p_ready = gl.allocate_shared_memory(gl.int64, [1], bar_l)
    p_free = gl.allocate_shared_memory(gl.int64, [1], bar_l)
    kv_free = gl.allocate_shared_memory(gl.int64, [2, 1], bar_l)
    done = gl.allocate_shared_memory(gl.int64, [1], bar_l)
    pv_groups: gl.constexpr = 2 if TWO_PV else 1  # the P V warpgroups, each arriving once
    mbarrier.init(p_ready, count=1)
    mbarrier.init(p_free, count=pv_groups)
    mbarrier.init(kv_free.index(0), count=pv_groups)
    mbarrier.init(kv_free.index(1), count=pv_groups)
    mbarrier.init(done, count=1)
    if not Q_EARLY:
        _pdl_gate(PDL)

    head_tile = gl.program_id(0)
    i = gl.program_id(1)
    split = gl.program_id(2)
    start = split * partition
    req, tok, end, sel = _program_keys(i, start, split, partition, num_splits, keys, rows_ptr,
                                       query_start_loc_ptr, seq_lens_ptr, token_to_req_ptr,
                                       tok_pos_ptr, sel_ptr, stride_sel, USE_ROWS, SPARSE,
                                       PACKED)
    num_tiles = gl.cdiv(gl.maximum(end - start, 0), BN)
    table = block_tables_ptr + req.to(gl.int64) * stride_table
    max_pos = max_blocks * BLOCK_SIZE  # a selected position past the table: never read
    bufs = (q_lat_s, q_pe_s, k_lat_s, k_pe_s, p_s, alpha_s, l_s, slots_s)
    bars = (p_ready, p_free, kv_free, done)
    # the output's rows: the first head, where this program's go (out, or its split partial)
    out_row = tok * stride_ot + (head_tile * BH).to(gl.int64) * stride_oh
    part_row = ((i * NUM_HEADS + head_tile * BH) * num_splits + split).to(gl.int64)
    # the partitions' arguments written out in each call: a tuple built beforehand would turn
    # its constexprs into tensors
    if TWO_PV:  # O[:, :L/2] and O[:, L/2:] by a P V warpgroup each
        gl.warp_specialize([
            (_scores_partition, (bufs, bars, q_ptr, cache_ptr, out_ptr, part_m_ptr, part_l_ptr,
                                 part_acc_ptr, table, sel, tok, head_tile, start, end,
                                 num_tiles, max_pos, scale_log2, stride_qt, stride_qh,
                                 stride_oh, out_row, part_row, num_splits, NUM_HEADS, L, R,
                                 BLOCK_SIZE, SPLIT, SPARSE, TWO_PV, PV_SLOTS, PDL, Q_EARLY)),
            (_pv_partition, (bufs, bars, out_ptr, part_acc_ptr, num_tiles, head_tile,
                             stride_oh, out_row, part_row, num_splits, table, sel, max_pos,
                             start, end, NUM_HEADS, L, SPLIT, 0, BLOCK_SIZE, PV_SLOTS,
                             Q_EARLY)),
            (_pv_partition, (bufs, bars, out_ptr, part_acc_ptr, num_tiles, head_tile,
                             stride_oh, out_row, part_row, num_splits, table, sel, max_pos,
                             start, end, NUM_HEADS, L, SPLIT, HALF, BLOCK_SIZE, False,
                             Q_EARLY)),
        ], [4, 4], [WORKER_REGS, WORKER_REGS])
    else:  # O[:, L/2:] by the P V warpgroup, O[:, :L/2] by the scores warpgroup
        gl.warp_specialize([
            (_scores_partition, (bufs, bars, q_ptr, cache_ptr, out_ptr, part_m_ptr, part_l_ptr,
                                 part_acc_ptr, table, sel, tok, head_tile, start, end,
                                 num_tiles, max_pos, scale_log2, stride_qt, stride_qh,
                                 stride_oh, out_row, part_row, num_splits, NUM_HEADS, L, R,
                                 BLOCK_SIZE, SPLIT, SPARSE, TWO_PV, PV_SLOTS, PDL, Q_EARLY)),
            (_pv_partition, (bufs, bars, out_ptr, part_acc_ptr, num_tiles, head_tile,
                             stride_oh, out_row, part_row, num_splits, table, sel, max_pos,
                             start, end, NUM_HEADS, L, SPLIT, HALF, BLOCK_SIZE, PV_SLOTS,
                             Q_EARLY)),
        ], [4], [WORKER_REGS])


def _scores_partition(bufs, bars, q_ptr, cache_ptr, out_ptr, part_m_ptr, part_l_ptr,
                      part_acc_ptr, table, sel, tok, head_tile, start, end, num_tiles, max_pos,
                      scale_log2, stride_qt, stride_qh, stride_oh, out_row, part_row,
                      num_splits, NUM_HEADS: gl.constexpr, L: gl.constexpr, R: gl.constexpr,
                      BLOCK_SIZE: gl.constexpr, SPLIT: gl.constexpr, SPARSE: gl.constexpr,
                      TWO_PV: gl.constexpr, PV_SLOTS: gl.constexpr, PDL: gl.constexpr,
                      Q_EARLY: gl.constexpr):
    """The scores warpgroup: every copy, each tile's scores and softmax, and O[:, :L/2]
    (unless TWO_PV); Q_EARLY: the PDL gate between the queries' copies and the tiles'."""
    BH: gl.constexpr = 64
    BN: gl.constexpr = 64
    HALF: gl.constexpr = L // 2
    q_lat_s, q_pe_s, k_lat_s, k_pe_s, p_s, alpha_s, l_s, slots_s = bufs
    p_ready, p_free, kv_free, done = bars
    lat_l: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
    pe_l: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (R // 8), R // 8], [4, 1], [1, 0])
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, BN, 16])
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, HALF, 16])
    p_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_l, k_width=2)
    nl = gl.arange(0, BN, layout=gl.SliceLayout(1, lat_l))
    np_ = gl.arange(0, BN, layout=gl.SliceLayout(1, pe_l))
    dq = gl.arange(0, L, layout=gl.SliceLayout(0, lat_l))
    dp = gl.arange(0, R, layout=gl.SliceLayout(0, pe_l))
    # Q with tile 0 in one copy group, tile 1 in the next (past the end: zeros): S_0 waits for Q
    q_at, q_ok = _query_rows(tok, 0, 1, head_tile, stride_qt, stride_qh,
                             gl.SliceLayout(1, lat_l), NUM_HEADS, BH, 1, False)
    async_copy.async_copy_global_to_shared(q_lat_s, q_ptr + q_at[:, None] + dq[None, :],
                                           mask=q_ok[:, None])
    q_at, q_ok = _query_rows(tok, 0, 1, head_tile, stride_qt, stride_qh,
                             gl.SliceLayout(1, pe_l), NUM_HEADS, BH, 1, False)
    async_copy.async_copy_global_to_shared(q_pe_s, q_ptr + q_at[:, None] + L + dp[None, :],
                                           mask=q_ok[:, None])
    if Q_EARLY:
        _pdl_gate(PDL)
    for j in gl.static_range(2):
        if PV_SLOTS:  # tiles 0 and 1's rows by this warpgroup, kept for their masks
            slots_s.index(j).store(_slots_of(table, sel, max_pos, start + j * BN, end,
                                             gl.SliceLayout(1, lat_l), BN, BLOCK_SIZE))
            gl.thread_barrier()
            _copy_rows(cache_ptr, slots_s.index(j), k_lat_s.index(j), k_pe_s.index(j), dq, dp,
                       lat_l, pe_l, L, R)
        else:
            _load_tile(cache_ptr, table, sel, max_pos, start + j * BN, end, k_lat_s.index(j),
                       k_pe_s.index(j), nl, dq, np_, dp, L, R, BLOCK_SIZE, SPARSE, False)
        async_copy.commit_group()

    m_i = gl.full([BH], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_l))
    l_i = gl.full([BH], 0.0, gl.float32, layout=gl.SliceLayout(1, s_l))
    acc = gl.zeros([BH, HALF], gl.float32, layout=o_l)  # O[:, :L/2] (unused with TWO_PV)
    s_zero = gl.zeros([BH, BN], gl.float32, layout=s_l)
    keys = gl.arange(0, BN, layout=gl.SliceLayout(0, s_l))
    async_copy.wait_group(1)  # Q and tile 0
    gl.thread_barrier()
    fence_async_shared()
    s = _scores(q_lat_s, q_pe_s, k_lat_s.index(0), k_pe_s.index(0), s_zero)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
    for t in range(num_tiles):
        stage = t % 2
        if PV_SLOTS:
            valid = slots_s.index(t % 4).load(gl.SliceLayout(0, s_l)) >= 0
        else:
            _, valid = _valid_keys(sel, max_pos, start + t * BN + keys, end, SPARSE)
        s = gl.where(valid[None, :], s * scale_log2, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        m_ref = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_ref)
        p = gl.exp2(s - m_ref[:, None])
        l_i = l_i * alpha + gl.sum(p, axis=1)
        m_i = m_new
        p16 = p.to(p_s.dtype)
        # hand P_t and alpha_t to the P V warpgroups once they are done with P_{t-1}
        mbarrier.wait(p_free, (t & 1) ^ 1)
        p_s.store(p16)
        alpha_s.store(alpha)
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(p_ready)
        if not TWO_PV:  # O_left += P_t V_t[:, :L/2], P_t from registers
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_l))[:, None]
            acc = warpgroup_mma(gl.convert_layout(p16, p_l),
                                k_lat_s.index(stage).slice(0, HALF, 1), acc, is_async=True)
        # tile t + 1's scores (its copies landed during tile t; past the last tile a zero
        # stage's, unused)
        async_copy.wait_group(0)
        gl.thread_barrier()
        fence_async_shared()
        s = _scores(q_lat_s, q_pe_s, k_lat_s.index(1 - stage), k_pe_s.index(1 - stage), s_zero)
        if not TWO_PV:
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))  # P_t V_t done, S pending
        # the P V warpgroups are done with V_t too: tile t + 2 into t's stage
        mbarrier.wait(kv_free.index(stage), (t // 2) & 1)
        gl.thread_barrier()
        if PV_SLOTS:  # its rows, left by the P V warpgroup before it freed the stage
            _copy_rows(cache_ptr, slots_s.index((t + 2) % 4), k_lat_s.index(stage),
                       k_pe_s.index(stage), dq, dp, lat_l, pe_l, L, R)
        else:
            _load_tile(cache_ptr, table, sel, max_pos, start + (t + 2) * BN, end,
                       k_lat_s.index(stage), k_pe_s.index(stage), nl, dq, np_, dp, L, R,
                       BLOCK_SIZE, SPARSE, False)
        async_copy.commit_group()
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
    async_copy.wait_group(0)  # no copy left in flight at exit

    rows = head_tile * BH + gl.arange(0, BH, layout=gl.SliceLayout(1, s_l))
    l_s.store(l_i)
    gl.thread_barrier()
    mbarrier.arrive(done)  # the row sums, for the P V warpgroups' stores
    if SPLIT:
        part = (rows - head_tile * BH).to(gl.int64) * num_splits + part_row
        gl.store(part_m_ptr + part, m_i, mask=rows < NUM_HEADS)
        gl.store(part_l_ptr + part, l_i, mask=rows < NUM_HEADS)
    if not TWO_PV:
        _store_o(acc, l_i, out_ptr, part_acc_ptr, head_tile, stride_oh, out_row, part_row,
                 num_splits, NUM_HEADS, L, SPLIT, 0, o_l)


def _pv_partition(bufs, bars, out_ptr, part_acc_ptr, num_tiles, head_tile, stride_oh, out_row,
                  part_row, num_splits, table, sel, max_pos, start, end,
                  NUM_HEADS: gl.constexpr, L: gl.constexpr, SPLIT: gl.constexpr,
                  COL: gl.constexpr, BLOCK_SIZE: gl.constexpr, PV_SLOTS: gl.constexpr,
                  Q_EARLY: gl.constexpr):
    """A P V warpgroup: O[:, COL:COL + L/2] from each tile's P and rescale; PV_SLOTS: also
    tile t + 2's cache rows into slots_s while it waits for P_t (slots_by_pv). Q_EARLY: it
    first waits for the previous kernel (the selection is its output)."""
    BH: gl.constexpr = 64
    BN: gl.constexpr = 64
    HALF: gl.constexpr = L // 2
    q_lat_s, q_pe_s, k_lat_s, k_pe_s, p_s, alpha_s, l_s, slots_s = bufs
    p_ready, p_free, kv_free, done = bars
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, HALF, 16])
    row_l: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    if Q_EARLY:
        _pdl_gate(1)
    acc = gl.zeros([BH, HALF], gl.float32, layout=o_l)
    for t in range(num_tiles):
        if PV_SLOTS:  # loads issued now, stored once P_t V_t is done
            ahead = _slots_of(table, sel, max_pos, start + (t + 2) * BN, end, row_l, BN,
                              BLOCK_SIZE)
        mbarrier.wait(p_ready, t & 1)
        alpha = alpha_s.load(gl.SliceLayout(1, o_l))
        acc = acc * alpha[:, None]
        acc = warpgroup_mma(p_s, k_lat_s.index(t % 2).slice(COL, HALF, 1), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        if PV_SLOTS:
            slots_s.index((t + 2) % 4).store(ahead)
        gl.thread_barrier()
        mbarrier.arrive(p_free)
        mbarrier.arrive(kv_free.index(t % 2))
    mbarrier.wait(done, 0)
    l_i = l_s.load(gl.SliceLayout(1, o_l))
    _store_o(acc, l_i, out_ptr, part_acc_ptr, head_tile, stride_oh, out_row, part_row,
             num_splits, NUM_HEADS, L, SPLIT, COL, o_l)
