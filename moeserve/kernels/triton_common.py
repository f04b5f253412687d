"""What the Triton kernel modules share: where their kernels may run, and tile-size arithmetic."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
from collections.abc import Iterator

import torch

from moeserve import envs

MAX_GRID_Y = 65535  # CUDA's limit on a grid's y dimension
# Programmatic dependent launch (Hopper's griddepcontrol): a kernel launched with it is
# scheduled while the stream's previous kernel drains, not after it, and its first instruction
# waits (griddepcontrol.wait) until that kernel has finished and its writes are visible; a
# kernel that finished before it has, so each launch stays ordered after all earlier work.
# Only a kernel with that wait takes it (`pdl_launch`): its PDL constexpr and the launch's
# `launch_pdl` set together. Levels: 0 plain; 1 the wait only (the successor is scheduled when
# this kernel exits); 2 also, right after the wait, griddepcontrol.launch_dependents: the
# successor's programs are scheduled onto free SMs as soon as every program of this one has
# passed its wait, and spin at their own wait, so a launch's ramp overlaps the previous
# kernel's tail (correct either way: the successor's wait still covers this kernel's writes).
# From 2, DSA's sparse MLA (decode_gluon_ws, Q_EARLY) also copies its queries in before its
# wait where its caller says they were made before its predecessor's own predecessor
# (`queries_made_earlier`): a full DSA layer's are, made before the indexer's projections,
# scores and top-k (layers/dsa.py); a shared layer's come from the launch just before it.
# Level 3 (an A/B, untimed): as 2, but the scores, bisect top-k and combine read the step's
# metadata (positions, lengths, rows: host copies made before the step's first kernel) before
# their wait and release, the previous kernel's outputs after them.
# 2 by default (MOESERVE_PDL=0 / 1 / 3 for A/Bs): on an H100 (benchmarks/results/gpu_56e6f7e/call1,
# kernels_dsa's dsa_graph_pdl_ms, the step's graph with GLM-5's served row width) 0.1032 /
# 0.1017 / 0.098 ms at levels 0 / 1 / 2 and 32 x 8k, 0.4816 / 0.4797 / 0.4756 at 256 x 8k.
pdl = envs.pdl()
_queries_early: contextvars.ContextVar[bool] = contextvars.ContextVar("queries_early",
                                                                      default=False)


@contextlib.contextmanager
def queries_made_earlier() -> Iterator[None]:
    """Within it, the attention launches may read their queries before their PDL wait: the
    caller made them before the previous kernel's own predecessor (the comment above)."""
    token = _queries_early.set(True)
    try:
        yield
    finally:
        _queries_early.reset(token)


def queries_early() -> bool:
    """Whether the caller is inside `queries_made_earlier`."""
    return _queries_early.get()


def pdl_launch(device: torch.device) -> bool:
    """Whether a kernel that waits on its predecessor (module comment) launches with
    programmatic dependent launch on `device`: pdl on, CUDA, compute capability 9+."""
    return pdl and device.type == "cuda" and _major_of(
        device.index if device.index is not None else torch.cuda.current_device()) >= 9


@functools.cache
def _major_of(index: int) -> int:
    """A CUDA device's compute capability major, looked up once (pdl_launch runs a launch)."""
    return torch.cuda.get_device_capability(index)[0]


def pdl_kwargs(device: torch.device) -> dict:
    """A launch's (or warmup's) keywords for a kernel with a PDL constexpr: PDL (the level:
    0 none, 1 its wait, 2 its wait and its successor's early launch) and launch_pdl (a
    compile option of Triton's, so both pick the variant) together."""
    return {"PDL": int(pdl), "launch_pdl": True} if pdl_launch(device) else {"PDL": 0}


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1): Triton block shapes are powers of two."""
    return 1 << max(0, n - 1).bit_length()


def require_triton_device(device: torch.device, who: str) -> None:
    """Raise ValueError unless a Triton kernel can run on `device`: CUDA, or any device under
    Triton's interpreter (TRITON_INTERPRET=1, set before triton is imported; tests on CPU)."""
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"{who}: runs on CUDA tensors, or on {device.type} only under Triton's "
                         "interpreter (TRITON_INTERPRET=1 before importing triton)")


def require_attention_inputs_device(q: torch.Tensor, who: str) -> None:
    """The attention kernels' device rule for their query tensor: CUDA, or CPU under Triton's
    interpreter and not in bf16 (the interpreter loads bf16 wrongly). ValueError otherwise."""
    if q.device.type == "cpu":
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"{who}: CPU tensors need Triton's interpreter: set "
                             "TRITON_INTERPRET=1 before importing triton")
        if q.dtype == torch.bfloat16:
            raise ValueError(f"{who}: bf16 is not supported on CPU (Triton's interpreter loads "
                             "bf16 wrongly); use fp16/fp32 on CPU, bf16 on the GPU")
    elif q.device.type != "cuda":
        raise ValueError(f"{who}: unsupported device {q.device}")


def require_step_indices(positions: torch.Tensor, slot_mapping: torch.Tensor, num_tokens: int,
                         who: str) -> None:
    """A cache-writing kernel's per-token inputs: integer positions [T] and int64 slots [T]
    (ValueError naming `who` and the tensor)."""
    if positions.shape != (num_tokens,) or positions.is_floating_point():
        raise ValueError(f"{who}: positions must be integer [{num_tokens}], got "
                         f"{tuple(positions.shape)} {positions.dtype}")
    if slot_mapping.shape != (num_tokens,) or slot_mapping.dtype != torch.int64:
        raise ValueError(f"{who}: slot_mapping must be int64 [{num_tokens}], got "
                         f"{tuple(slot_mapping.shape)} {slot_mapping.dtype}")


def split_k_for(tiles: int, steps: int, num_sms: int) -> int:
    """The power-of-two split of a GEMM's K `steps` that brings its `tiles` programs to about
    2 x num_sms, each split keeping at least 4 steps (1: enough programs already, or K too
    short): decode-sized GEMMs have too few output tiles to fill the SMs otherwise."""
    split = 1
    while tiles * split * 2 <= 2 * num_sms and steps // (split * 2) >= 4:
        split *= 2
    return split


@functools.cache
def _num_sms_of(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """The streaming multiprocessors of a CUDA device."""
    return _num_sms_of(device.index if device.index is not None else torch.cuda.current_device())
