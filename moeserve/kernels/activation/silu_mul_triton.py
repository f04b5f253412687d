"""SwiGLU's activation, silu(gate) * up, in one Triton launch, and the torch reference.

    x [T, 2I]: gate columns [0, I), up columns [I, 2I) (a dense MLP's fused gate_up output)
    out [T, I] = silu(x[:, :I]) * x[:, I:]

The reference is Hugging Face's two ops, `F.silu(gate) * up`: two launches, and the [T, I]
silu written and read back between them. On the H200 at glm-4.7-flash's 1,024-row decode step
the pair took 0.58 ms of 33.6 (47 MLPs: the dense layer's and the shared experts';
benchmarks/results/gpu_bb408cc/call7_w1_glm47_2ae848a). The kernel reads x once and writes out
once.

Rounding: as torch's CUDA kernels, silu in fp32 as g / (1 + exp(-g)) (libdevice's expf and
an IEEE division, as nvcc compiles torch's `x / (1 + exp(-x))`), rounded to x's dtype, then
the product in fp32 rounded to x's dtype; so the result should equal the reference bit for bit
on CUDA (the GPU test asserts it). Under Triton's interpreter (CPU tests) exp is numpy's, so
the CPU test allows an ulp. Triton is imported on first use; on CPU the kernel runs only under
TRITON_INTERPRET=1. No host sync: CUDA-graph capturable.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F

from moeserve.kernels.triton_common import next_pow2, require_triton_device

BLOCK_COLS = 1024  # columns a program (at most; next_pow2 of I when smaller)
tl: Any = None  # triton.language, bound by _kernels(): the kernel reads it as a global
libdevice: Any = None  # triton's CUDA libdevice, bound by _kernels()


def silu_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] -> silu(x[:, :I]) * x[:, I:], Hugging Face's ops."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] (unit last stride, any row stride; fp32 / fp16 / bf16) -> [T, I] in x's dtype,
    contiguous. ValueError naming what is wrong."""
    if x.dim() != 2 or x.shape[1] % 2 or x.stride(-1) != 1:
        raise ValueError(f"silu_mul_triton: x must be [T, 2I] with a unit last stride, got "
                         f"{tuple(x.shape)} strides {x.stride()}")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"silu_mul_triton: x must be fp32, fp16 or bf16, got {x.dtype}")
    require_triton_device(x.device, "silu_mul_triton")
    rows, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty(rows, inter, dtype=x.dtype, device=x.device)
    if rows == 0 or inter == 0:
        return out
    block = min(BLOCK_COLS, next_pow2(inter))
    _kernels().silu_mul[(rows, -(-inter // block))](x, out, inter, x.stride(0), out.stride(0),
                                                    BLOCK=block, LIBDEVICE=x.is_cuda,
                                                    num_warps=4)
    return out


@functools.cache
def _kernels() -> SimpleNamespace:
    """Build the kernel on first use (the only place triton is imported)."""
    global tl, libdevice
    import triton
    import triton.language
    from triton.language.extra import libdevice as _libdevice

    tl, libdevice = triton.language, _libdevice

    @triton.jit
    def _silu_mul_kernel(x_ptr, out_ptr, inter, stride_x, stride_o, BLOCK: tl.constexpr,
                         LIBDEVICE: tl.constexpr):
        """Program (row, block of columns): out[row, cols] = silu(gate) * up; LIBDEVICE: exp
        by CUDA's libdevice (the interpreter has none: tl.exp there)."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < inter
        g = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
        u = tl.load(x_ptr + row * stride_x + inter + cols, mask=ok, other=0.0)
        g32 = g.to(tl.float32)
        if LIBDEVICE:
            e = libdevice.exp(-g32)
        else:
            e = tl.exp(-g32)
        silu = tl.math.div_rn(g32, 1.0 + e).to(g.dtype)
        out = (silu.to(tl.float32) * u.to(tl.float32)).to(g.dtype)
        tl.store(out_ptr + row * stride_o + cols, out, mask=ok)

    return SimpleNamespace(silu_mul=_silu_mul_kernel)
