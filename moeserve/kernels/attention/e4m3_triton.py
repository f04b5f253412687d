"""The float8 e4m3 KV cache's write rule as a Triton function, for the kernels that write a
cache (qk_rope_kv_triton: GQA's K/V; mla/rope_cache_triton: MLA's latent rows).

`round_e4m3(x)`: fp32 x -> the nearest e4m3 value, still in fp32 (paged.to_cache_dtype's rule:
saturated at +-448, ties to even, a zero's sign kept), so that the cast to the cache's type that
follows is exact. Spelled out because Triton's interpreter rounds its own fp32 -> e4m3 cast
wrongly (1.986 to 1.0, ties away from even); on the GPU the cast alone gives the same bytes.
A kernel module binds it with `jitted()` in its own `_kernels()`, under a global name its
kernels call (Triton resolves a callee by name in the caller's module).
"""

from __future__ import annotations

import functools
from typing import Any

tl: Any = None  # triton.language, bound by jitted()


@functools.cache
def jitted() -> Any:
    """round_e4m3, jitted once (interpreted if TRITON_INTERPRET=1 at the first call)."""
    global tl
    import triton
    import triton.language

    tl = triton.language
    return triton.jit(round_e4m3)


def round_e4m3(x):
    """fp32 x on e4m3's grid (module doc). The spacing of e4m3 values at x is
    2^(exponent(x) - 3), 2^-9 below the normals (2^-6): adding and subtracting 1.5 * 2^23
    times it rounds to that grid in fp32's own round-to-nearest-even."""
    x = tl.clamp(x, -448.0, 448.0)  # paged.FP8_MAX (a jitted function reads no plain global)
    biased = tl.maximum((x.to(tl.int32, bitcast=True) >> 23) & 0xFF, 127 - 6)
    step = ((biased - 3) << 23).to(tl.float32, bitcast=True)
    big = step * 12582912.0  # 1.5 * 2^23
    r = (x + big) - big
    return tl.where(r == 0.0, x * 0.0, r)
