"""The input checks the Triton paged attention kernels share (GQA's paged_triton.py and MLA's
mla/absorbed_triton.py): the element types and block sizes they take, and what each needs of
its cache and the step's metadata beside the shapes, as ValueErrors naming the input."""

from __future__ import annotations

from collections.abc import Callable

import torch

from moeserve.kernels.attention.metadata import AttentionMetadata
from moeserve.kernels.attention.paged import FP8_CACHE_DTYPES
from moeserve.kernels.triton_common import require_attention_inputs_device

SUPPORTED_BLOCK_SIZES = (4, 8, 16, 32, 64, 128)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_cache_and_step(who: str, q: torch.Tensor, cache: torch.Tensor, cache_name: str,
                         block_size: int, meta: AttentionMetadata) -> None:
    """What the Triton paged kernels (GQA's and MLA's) all need of their
    inputs beside the shapes: q's dtype, the cache's (q's, or float8 e4m3) and device, a
    supported block size that meta agrees on, q's last dim and the cache contiguous, one q
    row a token of meta, and meta's index tensors contiguous int32 on q's device. ValueError
    "who: ..." naming the first that fails."""
    need = needer(who)
    need(q.dtype in SUPPORTED_DTYPES, f"q dtype {q.dtype} not in {SUPPORTED_DTYPES}")
    need(cache.dtype in (q.dtype, *FP8_CACHE_DTYPES),
         f"{cache_name} dtype {cache.dtype} is neither q's ({q.dtype}) nor one of "
         f"{FP8_CACHE_DTYPES}")
    need(cache.device == q.device, f"{cache_name} on {cache.device}, q on {q.device}")
    need(block_size in SUPPORTED_BLOCK_SIZES,
         f"block_size {block_size} not in {SUPPORTED_BLOCK_SIZES}")
    need(meta.block_size == block_size,
         f"meta.block_size {meta.block_size} != {cache_name} block_size {block_size}")
    need(q.stride(2) == 1, f"q's last dim must be contiguous, strides {q.stride()}")
    need(cache.is_contiguous(), f"{cache_name} must be contiguous")
    need(q.shape[0] == meta.num_tokens, f"q has {q.shape[0]} tokens, meta {meta.num_tokens}")
    for name in ("block_tables", "seq_lens", "query_start_loc"):
        t = getattr(meta, name)
        need(t.dtype == torch.int32 and t.is_contiguous(),
             f"meta.{name} must be contiguous int32, got {t.dtype}")
        need(t.device == q.device, f"meta.{name} on {t.device}, q on {q.device}")
    require_attention_inputs_device(q, who)


def needer(who: str) -> Callable[[bool, str], None]:
    """need(ok, what): ValueError "who: what" unless ok."""
    def need(ok: bool, what: str) -> None:
        if not ok:
            raise ValueError(f"{who}: {what}")
    return need
