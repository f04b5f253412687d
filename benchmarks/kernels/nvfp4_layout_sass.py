"""Would re-laying NVFP4 weights at load make a swapped MoE tile (the weights as wgmma's A, from
registers) beat the plain one? A static look with no GPU: four minimal NVFP4 GEMM tiles (no
routing, no gating: one K loop each) compiled for sm90, their K loop's SASS counted.

    plain     x [BM, BK] @ W [BK, BN]: linear/nvfp4_tile.nvfp4_step, the served tile's step
              (mma.sync with the decoded tile from registers below 64 rows; from 64, wgmma
              with the decoded tile stored to shared memory first)
    stored    W [BN, BK] @ x^T: the weights as the dot's A, bytes as stored (the transposed
              tile measured slower on the H200 and removed at 9de5cbf)
    relaid    as stored, each 16-byte group's bytes permuted so that a thread's 32-bit load
              holds its A fragment's bytes (storage p = 4c + 2h + e holds byte j = 8h + 2c + e;
              c the lane's column pair, as Marlin lays its weights out)
    halves    relaid, and byte j of each 64-K block holding k = j and j + 32 (not 2j and
              2j + 1), so the activations' two halves load as they are instead of split into
              even and odd columns through registers and shared memory

Every form dequantizes with the "asm" decode (halves: its scales per nibble half), so the
counts differ only by layout. The tiles are written to compute the same product up to the
order of their sums, but this script only compiles them: it runs none and checks no values
(a form worth building gets its tests against the served tile when it is built).

Found at 8bb4fa0 (Triton 3.6): with a warpgroup's 64 weight rows, the relaid tile's loop is
3% / 13% shorter than the plain tile's at 16 / 32 tokens and 21% at 64 x 128 with 8 warps, with
fewer registers (95 / 96 / 130 against 114 / 157 / 193); at 64 x 64 and at 64 x 128 with 4
warps (two 64-row blocks a warpgroup: the permutation matches one) 12-13% longer. Triton also
waits for each wgmma of the swapped tiles before the next (their A registers are reused).

    PYTHONPATH=/tmp/tri36:. python -m benchmarks.kernels.nvfp4_layout_sass --tile 32 64 128 4 3

--tile is BM (tokens) BN (weight rows) BK num_warps num_stages. Prints a JSON line a form:
registers, spills, the loop's instruction total and its PRMT, LDS, STS and matrix
instructions, shared bytes.
"""

from __future__ import annotations

import argparse
import json
import os

from benchmarks.kernels.sm90_compile import compile_sm90
from moeserve.kernels.linear import nvfp4_tile

FORMS = ("plain", "stored", "relaid", "halves")
# "halves": the low nibbles' four bf16 weights ($0, $1) times their scales ($5, $6) and the
# high nibbles' ($2, $3) times theirs ($7, $8): nvfp4_tile's decode with a scale a nibble half
_HALVES_ASM = nvfp4_tile._E2M1_BF16X2_ASM.replace("$2, m, $5", "$2, m, $7").replace(
    "$3, m, $6", "$3, m, $8")


def _kernels():
    """The four forms' kernels, jitted on first use (triton imported here)."""
    import triton
    import triton.language as tl

    step = nvfp4_tile.jitted().nvfp4_step
    asm = tl.constexpr(nvfp4_tile._E2M1_BF16X2_ASM)
    halves_asm = tl.constexpr(_HALVES_ASM)
    scale_shift = tl.constexpr(2.0 ** nvfp4_tile.ASM_SCALE_SHIFT)

    @triton.jit
    def spread(s, COLS: tl.constexpr):  # [R, G] -> [R, G x COLS]
        rows: tl.constexpr = s.shape[0]
        groups: tl.constexpr = s.shape[1]
        return tl.reshape(tl.broadcast_to(s[:, :, None], (rows, groups, COLS)),
                          (rows, groups * COLS))

    @triton.jit
    def unrelay(t, BN: tl.constexpr, BKH: tl.constexpr):  # storage order -> byte order
        t = tl.permute(tl.reshape(t, (BN, BKH // 16, 4, 2, 2)), (0, 1, 3, 2, 4))
        return tl.reshape(t, (BN, BKH))

    @triton.jit
    def plain(x_ptr, w_ptr, s_ptr, out_ptr, K, BM: tl.constexpr, BN: tl.constexpr,
              BK: tl.constexpr, FORM: tl.constexpr):
        offs_n = tl.program_id(0) * BN + tl.arange(0, BN)
        offs_m = tl.arange(0, BM)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            a = tl.load(x_ptr + offs_m[:, None] * K + (k0 + tl.arange(0, BK))[None, :])
            c = k0 // 2 + tl.arange(0, BK // 2)
            byte = tl.load(w_ptr + offs_n[None, :] * (K // 2) + c[:, None])  # [BK/2, BN]
            g = k0 // 16 + tl.arange(0, BK // 16)
            sc = tl.load(s_ptr + offs_n[None, :] * (K // 16) + g[:, None]).to(tl.float32)
            acc = step(acc, a, byte, sc, BM, BK, "tf32", 1)
        tl.store(out_ptr + offs_m[:, None] * BN + offs_n[None, :], acc.to(tl.bfloat16))

    @triton.jit
    def swapped(x_ptr, w_ptr, s_ptr, out_ptr, K, BM: tl.constexpr, BN: tl.constexpr,
                BK: tl.constexpr, FORM: tl.constexpr):  # FORM 1 stored, 2 relaid, 3 halves
        rows = tl.program_id(0) * BN + tl.arange(0, BN)
        offs_m = tl.arange(0, BM)
        i = tl.arange(0, BK // 2)
        acc = tl.zeros((BN, BM), dtype=tl.float32)
        for k0 in range(0, K, BK):
            byte = tl.load(w_ptr + rows[:, None] * (K // 2) + (k0 // 2 + i)[None, :])
            g = k0 // 16 + tl.arange(0, BK // 16)
            sc = (tl.load(s_ptr + rows[:, None] * (K // 16) + g[None, :]).to(tl.float32)
                  * scale_shift).to(tl.bfloat16)  # [BN, BK / 16]
            if FORM == 3:  # a 64-K block's groups: low nibbles' two, then high nibbles' two
                k_lo = (i // 32) * 64 + i % 32
                a_lo = tl.load(x_ptr + offs_m[:, None] * K + (k0 + k_lo)[None, :])
                a_hi = tl.load(x_ptr + offs_m[:, None] * K + (k0 + 32 + k_lo)[None, :])
                s_lo, s_hi = tl.split(tl.permute(tl.reshape(sc, (BN, BK // 64, 2, 2)),
                                                 (0, 1, 3, 2)))
                w_lo, w_hi = tl.inline_asm_elementwise(
                    halves_asm, "=r,=r,=r,=r,r,r,r,r,r",
                    [byte, spread(tl.reshape(s_lo, (BN, BK // 32)), 16),
                     spread(tl.reshape(s_hi, (BN, BK // 32)), 16)],
                    dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
            else:
                a = tl.load(x_ptr + offs_m[:, None] * K + (k0 + tl.arange(0, BK))[None, :])
                a_lo, a_hi = tl.split(tl.reshape(a, (BM, BK // 2, 2)))
                w_lo, w_hi = tl.inline_asm_elementwise(
                    asm, "=r,=r,=r,=r,r,r,r", [byte, spread(sc, 8)],
                    dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
            if FORM >= 2:
                w_lo = unrelay(w_lo, BN, BK // 2)
                w_hi = unrelay(w_hi, BN, BK // 2)
            acc = tl.dot(w_lo, tl.trans(a_lo), acc)
            acc = tl.dot(w_hi, tl.trans(a_hi), acc)
        tl.store(out_ptr + offs_m[None, :] * BN + rows[:, None], acc.to(tl.bfloat16))

    return plain, swapped


def report(form: str, tile: list[int]) -> dict:
    """One form compiled for sm90 at tile (BM, BN, BK, warps, stages): the module doc's line."""
    bm, bn, bk, warps, stages = tile
    plain, swapped = _kernels()
    os.environ["SASS_TOP"] = "100"  # kernel_sass's loop counts: every opcode, not the top 12
    pointers = {"x_ptr": "*bf16", "w_ptr": "*u8", "s_ptr": "*fp8e4nv", "out_ptr": "*bf16"}
    const = dict(BM=bm, BN=bn, BK=bk, FORM=FORMS.index(form))
    r = compile_sm90(plain if form == "plain" else swapped, pointers, const, set(), warps,
                     stages)
    loop = r["loop_instructions"]
    return {"form": form, "tile": tile, "registers": r["registers"],
            "spill_store_bytes": r["spill_store_bytes"], "loop_instructions": loop["total"],
            "PRMT": loop.get("PRMT", 0), "LDS": loop["LDS"], "STS": loop["STS"],
            "HMMA": loop.get("HMMA", 0), "HGMMA": loop.get("HGMMA", 0),
            "shared_bytes": r["shared_bytes"], "triton": r["triton"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tile", type=int, nargs=5, default=[32, 64, 128, 4, 3],
                   metavar=("BM", "BN", "BK", "WARPS", "STAGES"))
    p.add_argument("--forms", nargs="+", choices=FORMS, default=list(FORMS))
    args = p.parse_args()
    if args.tile[2] % 64:
        p.error("--tile's BK must be a multiple of 64 (the halves layout's block)")
    for form in args.forms:
        print(json.dumps(report(form, args.tile)), flush=True)


if __name__ == "__main__":
    main()
