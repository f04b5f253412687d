"""How fast the GPU reads the latent rows a DSA decode step selects, by a kernel that does
nothing else: the ceiling under the sparse MLA's own pattern of reads.

Why: DSA's read bound divides the step's bytes by the device's copy rate (a sequential copy),
but the sparse MLA gathers 2,048 rows of 1,152 bytes a token from anywhere in the latent pool
(in kernels_dsa, from random scores: about a quarter of each 64-row block, scattered). If such
gathers cannot reach the copy rate on this GPU at all, no MLA kernel can, and the figure to
hold the sparse MLA against is this one. `time_gather_rate` reads the same rows (the top-k's
selection turned into cache rows) by `_row_sum_kernel`: BLOCK_R rows a program, each row's
L + R values loaded and summed into one fp32 a program (so nothing is optimized away; 4 bytes
written a program), many programs an SM, at each of LAUNCHES (the fastest reported). The same
kernel over as many contiguous rows gives the sequential rate of the same loads, the pair's
ratio the gathers' cost.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from benchmarks.kernels.kernel_runs import graph_timed

# (rows a program, warps) timed: 16 rows are 18 KB of loads in flight a program at 576 bf16
# values a row; the fastest of them is the ceiling reported
LAUNCHES = ((16, 4), (32, 4), (64, 8))


def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def _row_sum_kernel(cache_ptr, rows_ptr, out_ptr, num_rows, L: tl.constexpr,
                        R: tl.constexpr, BLOCK_R: tl.constexpr):
        """Program p: rows p * BLOCK_R .. of rows_ptr (cache rows; -1 skipped), each row's L
        and R values read and summed; out[p] = the sum (fp32)."""
        p = tl.program_id(0)
        r = p * BLOCK_R + tl.arange(0, BLOCK_R)
        row = tl.load(rows_ptr + r, mask=r < num_rows, other=-1)
        ok = row >= 0
        base = row.to(tl.int64) * (L + R)
        lat = tl.load(cache_ptr + base[:, None] + tl.arange(0, L)[None, :], mask=ok[:, None],
                      other=0.0)
        pe = tl.load(cache_ptr + base[:, None] + L + tl.arange(0, R)[None, :],
                     mask=ok[:, None], other=0.0)
        total = tl.sum(tl.sum(lat.to(tl.float32), 1), 0)
        tl.store(out_ptr + p, total + tl.sum(tl.sum(pe.to(tl.float32), 1), 0))

    return _row_sum_kernel


def row_sums(cache: torch.Tensor, rows: torch.Tensor, latent: int, block_r: int = 16,
             warps: int = 4) -> torch.Tensor:
    """Each program's sum of its block_r rows of cache [blocks, block_size, L + R] (rows:
    int32 cache rows, -1 skipped): [programs] fp32."""
    flat = cache.reshape(-1, cache.shape[-1])
    rows = rows.reshape(-1).to(torch.int32).contiguous()
    out = torch.empty(-(-rows.numel() // block_r), dtype=torch.float32, device=cache.device)
    _kernel()[(out.numel(),)](flat, rows, out, rows.numel(), L=latent,
                              R=flat.shape[1] - latent, BLOCK_R=block_r, num_warps=warps)
    return out


def time_gather_rate(cache: torch.Tensor, rows: torch.Tensor, latent: int,
                     timer: Callable[[Callable[[], object]], float]) -> dict:
    """The selected rows' gather and as many contiguous rows at each of LAUNCHES, each checked
    against torch's sums and timed in a CUDA graph: {"gather_ms": {"selected": {"16,4": ms,
    ...}, "contiguous": {...}}, "gather_rate_tbs": {"selected": the fastest launch's TB/s,
    "contiguous": ...}} (bytes: the valid rows x (L + R) x the element size)."""
    valid = rows.reshape(-1)[rows.reshape(-1) >= 0]
    flat = cache.reshape(-1, cache.shape[-1])
    out: dict = {"gather_rate_tbs": {}, "gather_ms": {}}
    contiguous = torch.arange(valid.numel(), dtype=torch.int32, device=cache.device)
    sums = flat[valid.long()].float().sum(1), flat[contiguous.long()].float().sum(1)
    for (label, these), want_rows in zip((("selected", valid), ("contiguous", contiguous)),
                                         sums):
        times = out["gather_ms"].setdefault(label, {})
        for block_r, warps in LAUNCHES:
            got = row_sums(cache, these, latent, block_r, warps)
            want = torch.nn.functional.pad(want_rows, (0, got.numel() * block_r
                                                       - want_rows.numel()))
            want = want.reshape(-1, block_r).sum(1)
            assert torch.allclose(got, want, rtol=1e-3, atol=1e-2 * block_r), (
                f"{label} row sums at {block_r} rows, {warps} warps")
            times[f"{block_r},{warps}"] = round(graph_timed(
                timer, lambda t=these, b=block_r, w=warps: row_sums(cache, t, latent, b, w),
                cache.is_cuda), 4)
        out["gather_rate_tbs"][label] = round(
            these.numel() * flat.shape[1] * flat.element_size() / min(times.values()) / 1e9, 3)
    return out
