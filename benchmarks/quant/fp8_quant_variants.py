"""Which division makes the Triton e4m3 activation quantization byte-equal to the torch
reference on this GPU: the scale as amax / 448 or amax * (1 / 448), the values as x / s
(Triton's `/`), div_rn(x, s) or x * (1 / s). Prints, per variant and shape, the scales and
bytes that differ from quant/fp8_block.quantize_activations.

    python benchmarks/quant/fp8_quant_variants.py
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeserve.quant.fp8_block import E4M3, E4M3_MAX, quantize_activations


@triton.jit
def _kernel(x_ptr, q_ptr, s_ptr, K, SCALE: tl.constexpr, VALUE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    cols = g * 128 + tl.arange(0, 128)
    mask = cols < K
    x = tl.load(x_ptr + row * K + cols, mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), 0)
    if SCALE == 0:
        scale = amax / 448.0
    elif SCALE == 1:
        scale = amax * (1.0 / 448.0)
    else:
        scale = tl.math.div_rn(amax, 448.0)
    scale = tl.maximum(scale, 1e-12)
    if VALUE == 0:
        v = x / scale
    elif VALUE == 1:
        v = tl.math.div_rn(x, scale)
    else:
        v = x * (1.0 / scale)
    q = tl.minimum(tl.maximum(v, -448.0), 448.0)
    tl.store(q_ptr + row * K + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row * tl.cdiv(K, 128) + g, scale)


def main() -> None:
    g = torch.Generator().manual_seed(0)
    for t, k in [(5, 320), (7, 1000), (4096, 7168)]:
        x = (torch.randn(t, k, generator=g) * torch.logspace(-2, 1, t)[:, None]).cuda()
        for dtype in (torch.float32, torch.bfloat16):
            xd = x.to(dtype).contiguous()
            q_ref, s_ref = quantize_activations(xd)
            for scale_kind in range(3):
                for value_kind in range(3):
                    q = torch.empty(t, k, dtype=E4M3, device="cuda")
                    s = torch.empty(t, (k + 127) // 128, dtype=torch.float32, device="cuda")
                    _kernel[(t, (k + 127) // 128)](xd, q, s, k, SCALE=scale_kind,
                                                   VALUE=value_kind)
                    ds = int((s != s_ref).sum())
                    dq = int((q.view(torch.uint8) != q_ref.view(torch.uint8)).sum())
                    print(f"{t}x{k} {str(dtype)[6:]} scale{scale_kind} value{value_kind}: "
                          f"{ds} scales, {dq} bytes differ")
    assert E4M3_MAX == 448.0


if __name__ == "__main__":
    main()
