"""MLA's up-projected prefill (the MHA form) beyond the padded torch reference: one row over
its context in chunks (`attend_row_in_chunks`, for reference.mla_prefill_ref's rows that attend
alone: every row of a long context, paged.bounded_groups), and a step's fresh prompts in one
variable-length launch (`attend_fresh_rows`).

Why: up-projecting a whole context at once holds its per-head keys and values, (nope + R +
v) x heads x 2 bytes a token beside the latents: 5.7 GiB for GLM-4.7-Flash's 202,752 tokens
(20 heads of 192 + 64 + 256), 18 GiB for DeepSeek-V3's 163,840 (128 heads of 128 + 64 + 128),
and the engine's memory plan profiles exactly that step (kv_cache.profile_step: the token
budget at the end of a max_model_len context), so the KV cache gave those bytes up. Here the
context goes in chunks of at most CHUNK_BYTES of keys and values:

    row: Q queries at positions P - Q .. P - 1 of a P-token context
    pieces: the prefix [0, P - Q) in chunks (every query sees all of a chunk), then the
            queries' own span [P - Q, P) (causal, square)
    each piece: its latents gathered from the paged cache, up-projected, attended by every
            query -> (out_i [H, Q, v], lse_i [H, Q]: the log of the piece's softmax sum)
    out = sum_i exp(lse_i - max lse) out_i / sum_i exp(lse_i - max lse)   (fp32, folded in
          piece by piece: one running sum, not every piece's output, is held)

Fresh prompts (no cached prefix: a row's context is its own tokens, whose latents this step
wrote) need no gather through the block table, no padding and no mask: their latents are read
back at the step's slots, up-projected at once, and attended by one variable-length causal
flash launch over the rows' query offsets (torch's FlashAttention-2 on CUDA in bf16 / fp16:
the values zero-padded to the keys' width where narrower, DeepSeek-V3's 128 against 192;
otherwise, the CPU or fp32, SDPA a row at a time). layers/mla.py's `row_forms` says which
rows take it (prompts of 512 tokens and more; MOESERVE_MLA_FRESH_VARLEN=0 turns it off).

A piece's attention is a fused kernel that returns its log-sum-exp (no [Q, S] scores): on
CUDA in bf16 / fp16 with keys up to 256 wide (a multiple of 8) torch's FlashAttention-2, or
cuDNN's for large pieces of many heads (PIECE_KERNEL's "auto", `piece_kernel`), else torch's
memory-efficient SDPA; on the CPU torch's flash SDPA. The flash kernels and cuDNN's take the
values as wide as the keys: they are zero-padded, and the padding's output columns dropped.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from moeserve import envs

CHUNK_BYTES = 256 << 20  # a prefix chunk's up-projected keys and values, at most
MIN_CHUNK = 1024  # tokens a prefix chunk, at least
# set by `memory_probe`: a row attends only the pieces that differ in size, a wrong output
_probing = False


@contextlib.contextmanager
def memory_probe() -> Iterator[None]:
    """Within it, a row attends only its first two prefix chunks (and its own span): the
    memory plan's profile step (runner/kv_cache.profile_step: the token budget at the end of a
    max_model_len context) reaches the same peak without up-projecting the whole context in
    every layer. The pieces are folded one at a time into a running sum of fixed size, so the
    peak is a full chunk's keys and values beside that sum and the fold's temporaries: the
    second chunk's, and every later full chunk's alike (a partial last chunk holds less).
    Keeping one chunk of each size missed it: the first chunk folds into nothing (the H200
    measured 16.5 against 20.2 MB in a test, gpu_4705423/call1). Without it the profile was 12 of
    glm-4.7-flash's 31.7 s warm start-up (gpu_7c427c9/call6). The outputs are wrong: a
    profile discards them."""
    global _probing
    was, _probing = _probing, True
    try:
        yield
    finally:
        _probing = was


def attend_row_in_chunks(q: torch.Tensor, latent_cache: torch.Tensor, block_table: torch.Tensor,
                         context: int, scale: float, kv_b_proj: torch.Tensor, nope: int,
                         v_dim: int) -> torch.Tensor:
    """One row's queries q [Q, H, nope + R] (at the last Q positions of its `context`-token
    context; block_table [max_blocks] its blocks) -> [Q, H, v] in q's dtype."""
    num_queries, num_heads, qk_dim = q.shape
    prefix = context - num_queries
    if prefix < 0:
        raise ValueError(f"attend_row_in_chunks: {num_queries} queries in a context of "
                         f"{context} tokens")
    step = chunk_tokens(num_heads, qk_dim, v_dim)
    pieces = [(a, min(a + step, prefix), False) for a in range(0, prefix, step)]
    if _probing:  # the first two chunks: the second folds beside a full chunk's keys, the peak
        pieces = pieces[:2]
    pieces.append((prefix, context, True))
    qh = q.transpose(0, 1)[None]  # [1, H, Q, nope + R]
    merged = None
    for first, end, causal in pieces:
        k, v = _up_project(latent_cache, block_table, first, end, kv_b_proj, nope, v_dim,
                           q.dtype)
        merged = _attend_and_fold(merged, qh, k, v, scale, causal)
        del k, v
    acc, total, _ = merged
    return (acc / total[..., None]).to(q.dtype)[0].transpose(0, 1)  # [Q, H, v]


def attend_fresh_rows(q: torch.Tensor, latents: torch.Tensor, query_start_loc: torch.Tensor,
                      query_lens: list[int], scale: float, kv_b_proj: torch.Tensor, nope: int,
                      v_dim: int) -> torch.Tensor:
    """Fresh rows' queries q [T, H, nope + R] over their own tokens' latents [T, L + R] (row b:
    tokens query_start_loc[b] .. query_start_loc[b + 1] - 1, int32 [B + 1] on q's device;
    query_lens, its host lengths), causal -> [T, H, v] in q's dtype."""
    num_tokens, num_heads, qk_dim = q.shape
    if latents.shape[0] != num_tokens or sum(query_lens) != num_tokens:
        raise ValueError(f"attend_fresh_rows: {num_tokens} queries, {latents.shape[0]} latents, "
                         f"rows of {sum(query_lens)} tokens")
    kv_lora_rank = kv_b_proj.shape[1]
    lat = latents.to(q.dtype)
    kv = torch.nn.functional.linear(lat[:, :kv_lora_rank], kv_b_proj)  # [T, H * (nope + v)]
    kv = kv.view(num_tokens, num_heads, nope + v_dim)
    k_rope = lat[:, None, kv_lora_rank:].expand(-1, num_heads, -1)  # [T, H, R]
    k = torch.cat([kv[..., :nope], k_rope], dim=-1)  # [T, H, nope + R]
    v = kv[..., nope:]  # [T, H, v]
    if q.is_cuda and q.dtype in (torch.bfloat16, torch.float16):
        if v_dim < qk_dim:  # FlashAttention-2 takes values as wide as the keys
            v = torch.nn.functional.pad(v, (0, qk_dim - v_dim))
        longest = max(query_lens)
        out = torch.ops.aten._flash_attention_forward(
            q, k, v, query_start_loc, query_start_loc, longest, longest, 0.0, True, False,
            scale=scale)[0]  # [T, H, qk or v]
        return out[..., :v_dim]
    out = q.new_empty(num_tokens, num_heads, v_dim)
    first = 0
    for n in query_lens:  # the CPU, or fp32: one causal SDPA a row
        rows = slice(first, first + n)
        out[rows] = torch.nn.functional.scaled_dot_product_attention(
            q[rows].transpose(0, 1), k[rows].transpose(0, 1), v[rows].transpose(0, 1),
            is_causal=True, scale=scale).transpose(0, 1)
        first += n
    return out


def chunk_tokens(num_heads: int, qk_dim: int, v_dim: int) -> int:
    """Tokens a prefix chunk: CHUNK_BYTES of their 16-bit transients (the up-projection's
    output, H x (nope + v), and the joined keys, H x (nope + R): under H x (2 qk + v) values a
    token), a multiple of CUDNN_SHAPE_MULTIPLE (its pieces' shapes recur: `piece_kernel`), at
    least MIN_CHUNK."""
    per_token = num_heads * (2 * qk_dim + v_dim) * 2
    fits = CHUNK_BYTES // per_token
    return max(MIN_CHUNK, fits - fits % CUDNN_SHAPE_MULTIPLE)


def fold(merged: tuple | None, out: torch.Tensor, lse: torch.Tensor,
         rows: slice = slice(None)) -> tuple:
    """The pieces so far, (acc [..., Q, v], total [..., Q], top [..., Q]) fp32 with acc / total
    their softmax's output and `top` the largest log-sum-exp (None: none yet), with one more
    piece's output and log-sum-exp folded in, in place: into query rows `rows` only where
    the piece is a part of the queries (`_attend_split`; each part sees a key, so its lse is
    finite)."""
    lse = lse.float()
    if merged is None:  # copies even of fp32 inputs: the state is updated in place below
        return (out.to(torch.float32, copy=True), torch.ones_like(lse),
                lse.to(torch.float32, copy=True))
    acc, total, top = merged
    new_top = torch.maximum(top[..., rows], lse)
    old, new = torch.exp(top[..., rows] - new_top), torch.exp(lse - new_top)
    # in place, the piece's output read once in its own dtype: two passes over the fp32 [H, Q,
    # v] accumulator where out-of-place products took four and two more temporaries (W3's
    # chunk at 64 heads: a 512 MiB accumulator, folded once a piece)
    acc[..., rows, :].mul_(old[..., None]).addcmul_(out, new[..., None])
    total[..., rows] = total[..., rows] * old + new
    top[..., rows] = new_top
    return merged


def _up_project(latent_cache: torch.Tensor, block_table: torch.Tensor, first: int, end: int,
                kv_b_proj: torch.Tensor, nope: int, v_dim: int,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions first .. end - 1's keys [1, H, n, nope + R] and values [1, H, n, v]."""
    block_size, width = latent_cache.shape[1], latent_cache.shape[2]
    kv_lora_rank = kv_b_proj.shape[1]
    pos = torch.arange(first, end, device=latent_cache.device)
    slots = block_table[pos // block_size].long() * block_size + pos % block_size
    rows = latent_cache.view(-1, width)[slots].to(dtype)  # [n, L + R]
    kv = torch.nn.functional.linear(rows[:, :kv_lora_rank], kv_b_proj)  # [n, H * (nope + v)]
    kv = kv.view(end - first, -1, nope + v_dim)  # [n, H, nope + v]
    k_rope = rows[:, None, kv_lora_rank:].expand(-1, kv.shape[1], -1)  # [n, H, R]
    k = torch.cat([kv[..., :nope], k_rope], dim=-1)  # [n, H, nope + R]
    return k.transpose(0, 1)[None], kv[..., nope:].transpose(0, 1)[None]


# A CUDA piece's kernel in bf16 / fp16 with keys up to 256 wide, a multiple of 8: "flash"
# (FlashAttention-2), "cudnn" (cuDNN's fused attention), "efficient" (the memory-efficient
# kernel, the only one past those) or "auto" (piece_kernel: cuDNN for large pieces of many
# heads, else flash). kernels_dsa_prefill times each (dense_mla_{flash,efficient,cudnn}_ms;
# `--pieces` the kernels alone). On an H100: FlashAttention-2 took W3's dense prefill chunk
# (8,192 queries after 24,576 tokens, GLM-5's 64 heads) from 134.6 to 72.6 ms
# (gpu_948136d/call11: 15.2 -> 28.2% of its compute bound); with the fold in place 67.4 ms,
# and cuDNN's 43.4 (gpu_77293e0/call4: 47.2%; 7.41 / 10.09 against 10.95 / 13.53 ms after 0 /
# 1,024 after 31,744; outputs as far from flash's as the efficient kernel's). But cuDNN builds
# a graph for each new shape: its first call 38.7 ms at a new shape of 20 heads, ~1,021
# queries, against 0.30 repeated (flash 0.30 either way; at 64 heads 0.57 against flash's 0.70
# repeated; call7). So "auto" takes it only where its builds are paid once, for a
# few dozen recurring shapes: pieces of CUDNN_MIN_HEADS heads and CUDNN_MIN_PRODUCTS queries
# x keys (W3's chunk of 8,192 queries after 24,576: ten pieces, ~2.4 ms faster each a layer),
# over a whole context chunk (chunk_tokens is a multiple of CUDNN_SHAPE_MULTIPLE) or the
# queries' own causal span, and only the queries' first multiple of CUDNN_SHAPE_MULTIPLE:
# the rest (a served chunk's length is the budget less the step's decodes) take flash, folded
# into their rows in place (`_attend_split`, no output-sized copy), as does a context's last
# piece. torch's cache of cuDNN graphs (one a shape, never evicted) then holds at most a
# couple of shapes a query multiple. kernels_dsa_prefill --pieces on an H100 (gpu_6b1031a
# call1): cuDNN about twice flash's speed at 20 heads too (1.16 / 2.18 ms against 2.31 / 4.48
# for 8,192 queries causal / over 8,704 keys; 0.045 / 0.40 against 0.076 / 0.85 at 1,024), so
# from GLM-4.7-Flash's 20 heads; at DeepSeek-V3's 128 (width 192) 5.61 / 2.71 against
# 10.55 / 5.19.
PIECE_KERNELS = ("auto", "flash", "cudnn", "efficient")
PIECE_KERNEL = envs.mla_piece_kernel("auto")  # MOESERVE_MLA_PIECE_KERNEL
CUDNN_MIN_HEADS = 20
CUDNN_MIN_PRODUCTS = 1 << 20
CUDNN_SHAPE_MULTIPLE = 256
_cudnn_refused: set[tuple] = set()  # (heads, width, dtype) cuDNN raised at: flash there since


def piece_kernel(q: torch.Tensor, num_keys: int, causal: bool = False) -> str:
    """The kernel of a CUDA piece of q [1, H, Q, D] over num_keys keys (causal: its own span):
    PIECE_KERNEL, or for "auto" cuDNN's where the piece has CUDNN_MIN_HEADS heads, its keys
    are a multiple of CUDNN_SHAPE_MULTIPLE or its own span, and its queries' first such
    multiple times its keys reach CUDNN_MIN_PRODUCTS (and cuDNN has not refused its heads and
    width; `_attend_and_fold` gives the other queries to flash), else flash's; "efficient"
    wherever the flash kernels' dtypes and widths are not met."""
    if PIECE_KERNEL not in PIECE_KERNELS:
        raise ValueError(f"up_projected.PIECE_KERNEL {PIECE_KERNEL!r} not in {PIECE_KERNELS}")
    heads, num_queries, width = q.shape[1], q.shape[2], q.shape[3]
    if q.dtype not in (torch.bfloat16, torch.float16) or width > 256 or width % 8:
        return "efficient"
    if PIECE_KERNEL != "auto":
        return PIECE_KERNEL
    whole = num_queries - num_queries % CUDNN_SHAPE_MULTIPLE
    keys = whole if causal else num_keys
    recurs = whole > 0 and (causal or num_keys % CUDNN_SHAPE_MULTIPLE == 0)
    large = heads >= CUDNN_MIN_HEADS and whole * keys >= CUDNN_MIN_PRODUCTS
    if recurs and large and (heads, width, q.dtype) not in _cudnn_refused:
        return "cudnn"
    return "flash"


def _attend_and_fold(merged: tuple | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     scale: float, causal: bool) -> tuple:
    """One piece (`_attend_piece`'s arguments) attended and folded into `merged` (`fold`'s):
    whole, or where "auto" gives it to cuDNN with queries past a multiple of
    CUDNN_SHAPE_MULTIPLE, split by `_attend_split`."""
    kernel = piece_kernel(q, k.shape[2], causal)
    whole = q.shape[2] - q.shape[2] % CUDNN_SHAPE_MULTIPLE
    if kernel == "cudnn" and PIECE_KERNEL == "auto" and whole < q.shape[2]:
        return _attend_split(merged, q, k, v, scale, causal, whole)
    return fold(merged, *_attend_piece(q, k, v, scale, causal, kernel))


def _attend_split(merged: tuple | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  scale: float, causal: bool, whole: int) -> tuple:
    """The piece's first `whole` queries by cuDNN (over the first `whole` keys where causal:
    their own span), the rest by flash (where causal: every one of those keys, then their own
    span), each folded into its query rows of `merged` in place (`fold`'s rows)."""
    if merged is None:  # an empty fold: no weight anywhere, the first part's lse on top
        acc = torch.zeros(*q.shape[:3], v.shape[-1], dtype=torch.float32, device=q.device)
        merged = (acc, torch.zeros(q.shape[:3], device=q.device),
                  torch.full(q.shape[:3], float("-inf"), device=q.device))
    head, tail = slice(0, whole), slice(whole, None)
    ka, va = (k[:, :, head], v[:, :, head]) if causal else (k, v)
    fold(merged, *_attend_piece(q[:, :, head], ka, va, scale, causal, "cudnn"), head)
    if causal:  # every key before the tail's own span, then that span
        fold(merged, *_attend_piece(q[:, :, tail], ka, va, scale, False, "flash"), tail)
        fold(merged, *_attend_piece(q[:, :, tail], k[:, :, tail], v[:, :, tail], scale, True,
                                    "flash"), tail)
    else:
        fold(merged, *_attend_piece(q[:, :, tail], k, v, scale, False, "flash"), tail)
    return merged


def _attend_piece(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                  causal: bool, kernel: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [1, H, Q, D], k [1, H, n, D], v [1, H, n, Dv] -> (out [1, H, Q, Dv], lse [1, H, Q]
    fp32); causal: the piece is the queries' own span (n == Q), square. kernel: default
    `piece_kernel`'s (the CPU runs its flash SDPA whatever it names but "efficient")."""
    num_queries, width, v_dim = q.shape[2], q.shape[-1], v.shape[-1]
    kernel = kernel or piece_kernel(q, k.shape[2], causal)
    if q.is_cuda and kernel == "efficient":
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, None, True, 0.0, causal, scale=scale)[:2]
        return out, lse[..., :num_queries]
    if v_dim < width:  # the flash kernels take values as wide as the keys
        v = torch.nn.functional.pad(v, (0, width - v_dim))
    if q.is_cuda and kernel == "cudnn":
        try:
            out, lse = _cudnn(q, k, v, scale, causal)
            return out[..., :v_dim], lse.reshape(q.shape[:3])  # cuDNN's may carry a last 1
        except torch.OutOfMemoryError:
            raise
        except RuntimeError:  # no plan for these shapes: flash here, and for them from now
            if PIECE_KERNEL != "auto":
                raise
            _cudnn_refused.add((q.shape[1], width, q.dtype))
    if q.is_cuda:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal, False, scale=scale)[:2]
    else:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, scale=scale)[:2]
    return out[..., :v_dim], lse


def _cudnn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
           causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """cuDNN's fused attention (out, lse); its own function so tests can make it refuse."""
    return torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, causal, False, scale=scale)[:2]
