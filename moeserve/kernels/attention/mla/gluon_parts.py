"""The Gluon MLA kernels' shared parts (decode_gluon.py's kernel, the swapped and the
warp-specialized ones beside it): a decode program's row, its keys (a context partition or
DSA's selection), the query rows a program reads, the key tiles' copies from the paged latent
cache (or from cache rows computed ahead into shared memory: `slots_of`, `copy_rows`, for
decode_gluon_ws's slots_by_pv), the scores' wgmmas, and the online softmax that writes P for
the P V wgmma.

Gluon functions, jitted by `jitted()` on first use with the Hopper builtins they call bound as
module globals (where the compiler resolves names); the kernels' modules bind the jitted
functions as their own globals from the namespace it returns.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

gl: Any = None  # triton.experimental.gluon.language, bound by jitted()
async_copy: Any = None
fence_async_shared: Any = None
warpgroup_mma: Any = None


@functools.cache
def jitted() -> SimpleNamespace:
    """The functions below, jitted (gluon imported here only); their names and the builtins
    they call bound as this module's globals."""
    global gl, async_copy, fence_async_shared, warpgroup_mma
    global _query_rows, _softmax_to_p, _scores, _valid_keys, _load_tile, _nvmma_buffer
    global _decode_row, _program_keys, _slots_of, _copy_rows, _pdl_gate, _store_o
    from triton.experimental import gluon
    from triton.experimental.gluon import language
    from triton.experimental.gluon.language.nvidia import hopper

    gl = language
    async_copy, fence_async_shared = hopper.async_copy, hopper.fence_async_shared
    warpgroup_mma = hopper.warpgroup_mma
    _query_rows, _softmax_to_p, _scores, _valid_keys, _load_tile, _nvmma_buffer = (
        gluon.jit(f) for f in (_query_rows, _softmax_to_p, _scores, _valid_keys, _load_tile,
                               _nvmma_buffer))
    _decode_row, _program_keys = gluon.jit(_decode_row), gluon.jit(_program_keys)
    _slots_of, _copy_rows = gluon.jit(_slots_of), gluon.jit(_copy_rows)
    _pdl_gate, _store_o = gluon.jit(_pdl_gate), gluon.jit(_store_o)
    return SimpleNamespace(query_rows=_query_rows, softmax_to_p=_softmax_to_p, scores=_scores,
                           valid_keys=_valid_keys, load_tile=_load_tile,
                           nvmma_buffer=_nvmma_buffer, decode_row=_decode_row,
                           program_keys=_program_keys, slots_of=_slots_of,
                           copy_rows=_copy_rows, pdl_gate=_pdl_gate,
                           store_o=_store_o)


def _pdl_gate(PDL: gl.constexpr):
    """Programmatic dependent launch's gate (triton_common.pdl, a level): 1 waits for the
    previous kernel (griddepcontrol.wait); 2 and 3 then let the next kernel launch."""
    if PDL:
        gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)
    if PDL >= 2:
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [],
                                  dtype=gl.int32, is_pure=False, pack=1)


def _nvmma_buffer(dtype: gl.constexpr, shape: gl.constexpr):
    """A shared-memory buffer of `shape` in the wgmma operands' default swizzle for its last
    two dimensions (a leading dimension: stages)."""
    return gl.allocate_shared_memory(
        dtype, shape, gl.NVMMASharedLayout.get_default_for(shape[len(shape) - 2:], dtype))


def _decode_row(i, rows_ptr, query_start_loc_ptr, seq_lens_ptr, USE_ROWS: gl.constexpr):
    """A decode program's row (rows_ptr[i] with USE_ROWS, else i), its query token's index
    and its context length: (req, tok int64, seq_len)."""
    if USE_ROWS:
        req = gl.load(rows_ptr + i)
    else:
        req = i
    tok = gl.load(query_start_loc_ptr + req).to(gl.int64)
    return req, tok, gl.load(seq_lens_ptr + req)


def _program_keys(i, start, split, partition, num_splits, keys, rows_ptr, query_start_loc_ptr,
                  seq_lens_ptr, token_to_req_ptr, tok_pos_ptr, sel_ptr, stride_sel,
                  USE_ROWS: gl.constexpr, SPARSE: gl.constexpr, PACKED: gl.constexpr):
    """A decode program's keys, partition `split` (from key `start`) of `num_splits`: (req,
    tok int64, end, sel): decode row i's context positions start .. end, or (SPARSE) token
    i's selected positions start .. end of `keys` in its row of sel_ptr (PACKED: up to the
    token's own position + 1, past which only -1 follows); sel is that row (else sel_ptr,
    unused)."""
    if SPARSE:  # keys: the token's selection; its request's block table
        tok = i.to(gl.int64)
        req = gl.load(token_to_req_ptr + tok)
        end = gl.where(split == num_splits - 1, keys, gl.minimum(keys, start + partition))
        if PACKED:
            end = gl.minimum(end, gl.load(tok_pos_ptr + tok).to(gl.int32) + 1)
        sel = sel_ptr + tok * stride_sel
    else:
        req, tok, seq_len = _decode_row(i, rows_ptr, query_start_loc_ptr, seq_lens_ptr,
                                        USE_ROWS)
        end = gl.where(split == num_splits - 1, seq_len, gl.minimum(seq_len, start + partition))
        sel = sel_ptr
    return req, tok, end, sel


def _query_rows(tok, q0, q_len, head_tile, stride_qt, stride_qh, layout: gl.constexpr,
                NUM_HEADS: gl.constexpr, HPT: gl.constexpr, BLOCK_Q: gl.constexpr,
                PREFILL: gl.constexpr):
    """The 64 query rows' element offsets into q and whether each is read: a decode token's
    heads head_tile * 64 + r, or (PREFILL) token q0 + r // HPT of the row's query (starting
    at token `tok`), head head_tile * HPT + r % HPT."""
    r = gl.arange(0, 64, layout=layout)
    if PREFILL:
        head = head_tile * HPT + r % HPT
        ok = (r < BLOCK_Q * HPT) & (q0 + r // HPT < q_len) & (head < NUM_HEADS)
        at = (tok + q0 + r // HPT) * stride_qt + head.to(gl.int64) * stride_qh
    else:
        head = head_tile * 64 + r
        ok = head < NUM_HEADS
        at = tok * stride_qt + head.to(gl.int64) * stride_qh
    return at, ok


def _softmax_to_p(s, m_i, l_i, acc, p_s, o_l: gl.constexpr):
    """Online softmax over a tile's masked base-2 scores s: the running max and sum updated,
    the accumulator rescaled, P written to shared memory for the P V wgmma (fenced, and both
    warpgroups' halves written). Returns (m_i, l_i, acc)."""
    m_new = gl.maximum(m_i, gl.max(s, axis=1))
    m_ref = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_ref)
    p = gl.exp2(s - m_ref[:, None])
    l_i = l_i * alpha + gl.sum(p, axis=1)
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_l))[:, None]
    p_s.store(p.to(p_s.dtype))
    fence_async_shared()
    gl.thread_barrier()
    return m_new, l_i, acc


def _scores(q_lat_s, q_pe_s, k_lat, k_pe, s_zero):
    """Issue (asynchronously) the scores of a stage's keys: Q_lat K_lat^T + Q_pe K_pe^T."""
    s = warpgroup_mma(q_lat_s, k_lat.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    return warpgroup_mma(q_pe_s, k_pe.permute((1, 0)), s, is_async=True)


def _valid_keys(sel, max_pos, j, end, SPARSE: gl.constexpr):
    """Keys j (< end) and whether each is read: a position of the context, or (SPARSE) a
    selected position that is not -1 and lies within the block table."""
    if SPARSE:
        pos = gl.load(sel + j, mask=j < end, other=-1)
        ok = (pos >= 0) & (pos < max_pos)
    else:
        pos = j
        ok = j < end
    return pos, ok


def _load_tile(cache_ptr, table, sel, max_pos, n0, end, k_lat_dst, k_pe_dst, nl, dq, np_, dp,
               L: gl.constexpr, R: gl.constexpr, BLOCK_SIZE: gl.constexpr,
               SPARSE: gl.constexpr, SLOTS: gl.constexpr):
    """Copies (cp.async, zero-filled where a key is not read) of keys n0 .. n0 + BLOCK_N (a
    row's context positions, or SPARSE a token's selected ones) from the paged cache into a
    stage: latents [BLOCK_N, L], rope parts [BLOCK_N, R] (nl, np_: the keys in the two
    parts' copy layouts). SLOTS (with SPARSE): the selection holds cache rows already (-1
    none; max_pos then past any row), so no block-table load stands before the copies."""
    pos, ok = _valid_keys(sel, max_pos, n0 + nl, end, SPARSE)
    if SLOTS:
        row = pos.to(gl.int64) * (L + R)
        pos_p, ok_p = _valid_keys(sel, max_pos, n0 + np_, end, SPARSE)
        row_p = pos_p.to(gl.int64) * (L + R) + L
    else:
        block = gl.load(table + pos // BLOCK_SIZE, mask=ok, other=0)
        row = (block.to(gl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE) * (L + R)
        pos_p, ok_p = _valid_keys(sel, max_pos, n0 + np_, end, SPARSE)
        block_p = gl.load(table + pos_p // BLOCK_SIZE, mask=ok_p, other=0)
        row_p = (block_p.to(gl.int64) * BLOCK_SIZE + pos_p % BLOCK_SIZE) * (L + R) + L
    async_copy.async_copy_global_to_shared(k_lat_dst, cache_ptr + row[:, None] + dq[None, :],
                                           mask=ok[:, None])
    async_copy.async_copy_global_to_shared(k_pe_dst, cache_ptr + row_p[:, None] + dp[None, :],
                                           mask=ok_p[:, None])


def _slots_of(table, sel, max_pos, n0, end, layout: gl.constexpr, BN: gl.constexpr,
              BLOCK_SIZE: gl.constexpr):
    """The cache rows (int32, -1 where not read) of a token's selected keys n0 .. n0 + BN in
    `layout`: its selection's positions through its block table."""
    pos, ok = _valid_keys(sel, max_pos, n0 + gl.arange(0, BN, layout=layout), end, True)
    block = gl.load(table + pos // BLOCK_SIZE, mask=ok, other=0)
    return gl.where(ok, block * BLOCK_SIZE + pos % BLOCK_SIZE, -1)


def _copy_rows(cache_ptr, slots, k_lat_dst, k_pe_dst, dq, dp, lat_l: gl.constexpr,
               pe_l: gl.constexpr, L: gl.constexpr, R: gl.constexpr):
    """A stage's copies (cp.async, zero-filled where a slot is -1) of the cache rows in the
    shared-memory vector `slots`: latents [BN, L], rope parts [BN, R]."""
    slot = slots.load(gl.SliceLayout(1, lat_l))
    slot_p = slots.load(gl.SliceLayout(1, pe_l))
    row = slot.to(gl.int64) * (L + R)
    row_p = slot_p.to(gl.int64) * (L + R) + L
    async_copy.async_copy_global_to_shared(k_lat_dst, cache_ptr + row[:, None] + dq[None, :],
                                           mask=(slot >= 0)[:, None])
    async_copy.async_copy_global_to_shared(k_pe_dst, cache_ptr + row_p[:, None] + dp[None, :],
                                           mask=(slot_p >= 0)[:, None])


def _store_o(acc, l_i, out_ptr, part_acc_ptr, head_tile, stride_oh, out_row, part_row,
             num_splits, NUM_HEADS: gl.constexpr, L: gl.constexpr, SPLIT: gl.constexpr,
             COL: gl.constexpr, o_l: gl.constexpr):
    """O[:, COL:COL + L/2] stored: the split partial as it is, or out divided by the row
    sums l_i (an empty row writes 0)."""
    BH: gl.constexpr = 64
    HALF: gl.constexpr = L // 2
    ho = gl.arange(0, BH, layout=gl.SliceLayout(1, o_l))
    do = COL + gl.arange(0, HALF, layout=gl.SliceLayout(0, o_l))
    h_ok = head_tile * BH + ho < NUM_HEADS
    if SPLIT:
        part_o = ho.to(gl.int64) * num_splits + part_row
        gl.store(part_acc_ptr + part_o[:, None] * L + do[None, :], acc, mask=h_ok[:, None])
    else:
        l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_l))
        o = acc / gl.where(l_o == 0.0, 1.0, l_o)[:, None]
        gl.store(out_ptr + out_row + ho.to(gl.int64)[:, None] * stride_oh + do[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=h_ok[:, None])
