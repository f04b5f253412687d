"""FP8 block-scaled W8A8 linear through cuBLASLt (torch's scaled matmul, DeepSeek-style
blockwise scaling: Hopper, CUDA >= 12.9), and `fp8_linear`: the one place that picks it or
the Triton kernel (fp8_block_triton.py) for a call.

    fp8_linear(x, w, s, bias, scale_rows, backend)  "auto" | "cublas" | "triton"
        auto: cuBLAS where `cublas_support` holds for the device, the shape qualifies
        (`cublas_unfit` is None) and T >= AUTO_CUBLAS_MIN_TOKENS; else Triton
    fp8_linear_cublas(x, w, s, bias)
        x [T, K] --quantize_activations_triton(pad_rows_to=4, mn_major_scales=True)-->
        A e4m3 [T4, K] + A_scale fp32 [T4, K / 128] strides (1, T4)   (BlockWise1x128)
        B = w.t() e4m3 [K, N] column-major + `weight_scale_cublas(s)`  (BlockWise128x128)
        -> scaled_mm -> [T4, N] in x's dtype -> rows [:T]

cuBLASLt's layout rules (pytorch PR 166752; torch's ScaledBlas.cpp checks them), L = K / 128,
L4 = L rounded up to 4:

    A_scale  [M, L]          strides (1, M)    M a multiple of 4 (the pad rows: quantized
                                               zeros; each output row reads only its own A
                                               row and scales, so the pad changes nothing)
    B_scale  [L4, N / 128]   strides (1, L4)   the K blocks past L are zeros (no data there)

and K, N multiples of 16 (here of 128: the weight's blocks whole). Per-row weight scales
(scale_rows 1, not compacted by quant/packed.py's `compact_fp8_scales`) stay on Triton.

The API: torch >= 2.10 has `F.scaled_mm` with explicit ScalingType recipes (used when
present); older torch only `torch._scaled_mm`, which infers the recipe from the scale shapes
with B_scale [L, N / 128]: taken only where L % 4 == 0 (L4 == L, the two layouts agree).

`cublas_support` probes once per device (a small case with padded M and K blocks, checked
against the reference; any error or a wrong answer means "unsupported", the reason logged
once). NOTE: the probe syncs the host: it must run before CUDA-graph capture. The engine's
warm-up calls every layer eagerly first; a first call inside a capture is not probed and
takes Triton (not cached, so the next eager call probes). The hot path is launch-only.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from moeserve.quant.fp8_block import BLOCK, quantize_activations

logger = logging.getLogger("moeserve.kernels")

BACKENDS = ("auto", "cublas", "triton")
# auto takes cuBLAS from this many tokens on (below: Triton). Measured on the H200
# (benchmarks/results/gpu_b606888/fp8_linear_backends.json, four projection shapes): from 64
# tokens cuBLAS is faster at every shape (qwen3 qkv at 1,024: 0.028 against 0.185 ms, 766
# TFLOP/s; GLM-5 o_proj 1,202 TFLOP/s); at 1 and 16 it is slower on two of the four.
AUTO_CUBLAS_MIN_TOKENS = 64
M_ALIGN = 4  # cuBLASLt: the rows of A (and of its 1x128 scales) a multiple of 4
_SUPPORT: dict[int, tuple[bool, str]] = {}  # device index -> (supported, reason)


def has_scaled_mm_v2() -> bool:
    """torch has F.scaled_mm with explicit scaling recipes (else only torch._scaled_mm)."""
    return hasattr(F, "scaled_mm") and hasattr(F, "ScalingType")


def cublas_unfit(n: int, k: int, scale_rows: int, row_major: bool = True) -> str | None:
    """Why a weight [n, k] with `scale_rows` cannot take the cuBLAS path (None: it can);
    row_major: the weight's last stride is 1 (its transpose then column-major)."""
    if not row_major:
        return "the weight's rows are not contiguous"
    if scale_rows != BLOCK[0]:
        return f"scale_rows {scale_rows}: cuBLAS takes 128x128 weight blocks only"
    if k % BLOCK[1] or n % BLOCK[0]:
        return f"N {n} and K {k} must be multiples of 128"
    if not has_scaled_mm_v2() and (k // BLOCK[1]) % 4:
        return f"torch._scaled_mm (no F.scaled_mm) needs K / 128 a multiple of 4, K is {k}"
    return None


def weight_scale_cublas(w_scale: torch.Tensor) -> torch.Tensor:
    """w_scale [N / 128, L] (the checkpoint's) -> B_scale fp32 [L4, N / 128] with strides
    (1, L4): a view of the transpose when L % 4 == 0 and w_scale is contiguous fp32, else a
    copy padded with zeros past L (one small kernel a call: the served shapes need none)."""
    nb, kb = w_scale.shape
    kb4 = -(-kb // 4) * 4
    if kb4 == kb and w_scale.dtype == torch.float32 and w_scale.is_contiguous():
        return w_scale.t()
    padded = w_scale.new_zeros(nb, kb4, dtype=torch.float32)  # [N / 128, L4]
    padded[:, :kb] = w_scale
    return padded.t()


def activation_scale_cublas(x_scale: torch.Tensor, rows: int) -> torch.Tensor:
    """x_scale [T, L] -> A_scale fp32 [rows, L] with strides (1, rows), rows >= T; the pad
    rows' scales 1. The torch form of what quantize_activations_triton writes directly (the
    probe and the tests use it)."""
    t, kb = x_scale.shape
    out = torch.ones(kb, rows, dtype=torch.float32, device=x_scale.device)  # [L, rows]
    out[:, :t] = x_scale.t()
    return out.t()


def scaled_mm_blockwise(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor,
                        b_scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """a e4m3 [M, K] row-major, b e4m3 [K, N] column-major, scales in cuBLAS's layouts
    (module doc) -> [M, N] in out_dtype, through whichever API this torch has."""
    if has_scaled_mm_v2():
        return F.scaled_mm(a, b, a_scale, F.ScalingType.BlockWise1x128, b_scale,
                           F.ScalingType.BlockWise128x128, output_dtype=out_dtype)
    out = torch._scaled_mm(a, b, a_scale, b_scale, out_dtype=out_dtype)
    return out[0] if isinstance(out, tuple) else out  # torch < 2.5 returned (out, amax)


def fp8_linear_cublas(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] through an FP8 weight [N, K] with 128x128 block scales [N / 128, K / 128]
    -> [..., N] in x's dtype, on cuBLASLt (module doc; the caller checks `cublas_unfit`)."""
    from moeserve.kernels.linear.fp8_block_triton import quantize_activations_triton

    rows = x.reshape(-1, x.shape[-1])  # [T, K]
    t, n = rows.shape[0], weight.shape[0]
    if t == 0:
        return x.new_empty(*x.shape[:-1], n)
    a, a_scale = quantize_activations_triton(rows, pad_rows_to=M_ALIGN,
                                             mn_major_scales=True)  # [T4, K], [T4, L]
    # with a bias: fp32 out (the probe's dtype), the bias added before the one rounding
    out_dtype = x.dtype if bias is None else torch.float32
    out = scaled_mm_blockwise(a, a_scale, weight.t(), weight_scale_cublas(scale_inv),
                              out_dtype)[:t]  # [T, N]
    if bias is not None:
        out = (out + bias.float()).to(x.dtype)
    return out.reshape(*x.shape[:-1], n)


def cublas_support(device: torch.device) -> tuple[bool, str]:
    """Whether this device and torch run the cuBLAS path correctly, and why not (probed once
    per device, outside CUDA-graph capture: module doc)."""
    if device.type != "cuda":
        return False, f"{device.type} is not CUDA"
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index in _SUPPORT:
        return _SUPPORT[index]
    if torch.cuda.is_current_stream_capturing():
        return False, "not probed yet (first call inside a CUDA-graph capture)"
    result = _probe(torch.device("cuda", index))
    _SUPPORT[index] = result
    logger.info("fp8 linear on cuda:%d: cuBLAS blockwise scaled_mm %s (%s)", index,
                "supported" if result[0] else "unsupported, Triton", result[1])
    return result


def _probe(device: torch.device) -> tuple[bool, str]:
    """One small case through `scaled_mm_blockwise` against the fp32 reference: M 6 (padded
    to 8) and, with F.scaled_mm, K 384 (L 3, padded to 4)."""
    major, minor = torch.cuda.get_device_capability(device)
    if major != 9:
        return False, f"sm{major}{minor}: torch's DeepSeek-style scaling is SM90 only"
    from moeserve.quant.fp8_block import quantize_blockwise, w8a8_linear_ref

    m, n, k = 6, 256, 384 if has_scaled_mm_v2() else 512
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(m, k, device=device, generator=g)
    w_q, w_s = quantize_blockwise(torch.randn(n, k, device=device, generator=g))
    a, x_s = quantize_activations(torch.cat([x, x.new_zeros(8 - m, k)]))  # [8, K]: padded
    try:
        out = scaled_mm_blockwise(a, activation_scale_cublas(x_s, 8), w_q.t(),
                                  weight_scale_cublas(w_s), torch.float32)[:m]
        torch.cuda.synchronize(device)
    except (RuntimeError, ValueError, TypeError, AttributeError) as e:
        return False, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    ref = w8a8_linear_ref(x, w_q, w_s)
    err = ((out - ref).abs().max() / ref.abs().max()).item()
    if not err < 2 ** -5:
        return False, f"wrong results: max error {err:.3g} of the output scale"
    api = "F.scaled_mm" if has_scaled_mm_v2() else "torch._scaled_mm"
    return True, f"{api}, torch {torch.__version__}, probe error {err:.2g}"


def choose_fp8_backend(num_tokens: int, n: int, k: int, scale_rows: int,
                       device: torch.device, backend: str = "auto",
                       row_major: bool = True) -> str:
    """"cublas" or "triton" for one call (module doc); backend "cublas" where it cannot run
    raises ValueError with the reason."""
    if backend not in BACKENDS:
        raise ValueError(f"fp8 linear backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "triton":
        return "triton"
    reason = cublas_unfit(n, k, scale_rows, row_major)
    if reason is None:
        ok, why = cublas_support(device)
        reason = None if ok else why
    if backend == "cublas":
        if reason is not None:
            raise ValueError(f"fp8 linear: the cuBLAS path cannot run: {reason}")
        return "cublas"
    return "cublas" if reason is None and num_tokens >= AUTO_CUBLAS_MIN_TOKENS else "triton"


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
               bias: torch.Tensor | None = None, scale_rows: int = BLOCK[0],
               backend: str = "auto") -> torch.Tensor:
    """x [..., K] through an FP8 block-scaled weight [N, K] -> [..., N] in x's dtype, on the
    backend `choose_fp8_backend` picks; scale_inv [ceil(N / scale_rows), ceil(K / 128)]."""
    num_tokens = x.numel() // x.shape[-1] if x.shape[-1] else 0
    choice = choose_fp8_backend(num_tokens, weight.shape[0], weight.shape[1], scale_rows,
                                x.device, backend, weight.stride(-1) == 1)
    if choice == "cublas":
        return fp8_linear_cublas(x, weight, scale_inv, bias)
    from moeserve.kernels.linear.fp8_block_triton import fp8_linear_triton

    return fp8_linear_triton(x, weight, scale_inv, bias, scale_rows=scale_rows)
