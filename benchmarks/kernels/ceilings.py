"""The device's two ceilings, measured as ANCHORS.md measured the H200's: the device copy rate
(bytes read + written a second, one large tensor copied into another) and the dense bf16
matrix rate (an 8192^3 product of random normal matrices). Their medians over `--repeats`
timings go into diagnose/bounds/roofline.CEILINGS for a device that lacks them.

    python -m benchmarks.kernels.ceilings --out DIR [--copy-gib 4] [--repeats 5]
        -> DIR/ceilings.json (environment, config, every timing, the medians)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

MATMUL_SIZE = 8192


def copy_tb_s(nbytes: int, timer) -> float:
    """Bytes read + written a second by a device-to-device copy of `nbytes`, in TB/s."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_(0, 256)
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))
    return 2 * nbytes / (ms * 1e-3) / 1e12


def matmul_tflop_s(size: int, timer) -> float:
    """Dense bf16 FLOPs a second of a size^3 product of random normal matrices, in TFLOP/s."""
    a = torch.randn(size, size, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(size, size, dtype=torch.bfloat16, device="cuda")
    ms = timer(lambda: a @ b)
    return 2 * size ** 3 / (ms * 1e-3) / 1e12


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--copy-gib", type=float, default=4.0, help="bytes copied a timing")
    ap.add_argument("--repeats", type=int, default=5, help="timings of each; medians kept")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("ceilings needs a CUDA GPU")
    import triton.testing

    from benchmarks.engine.w1_offline import environment

    def timer(fn) -> float:
        return float(triton.testing.do_bench(fn, warmup=25, rep=200))

    copies = [copy_tb_s(int(args.copy_gib * 2 ** 30), timer) for _ in range(args.repeats)]
    matmuls = [matmul_tflop_s(MATMUL_SIZE, timer) for _ in range(args.repeats)]
    result = {"environment": environment(),
              "config": {**vars(args), "matmul_size": MATMUL_SIZE,
                         "timer": "triton.testing.do_bench, warmup 25 ms, rep 200 ms"},
              "copy_tb_s": copies, "matmul_tflop_s": matmuls,
              "copy_tb_s_median": statistics.median(copies),
              "matmul_tflop_s_median": statistics.median(matmuls)}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "ceilings.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(f"{result['environment']['device']}: copy {result['copy_tb_s_median']:.3f} TB/s, "
          f"bf16 {MATMUL_SIZE}^3 {result['matmul_tflop_s_median']:.1f} TFLOP/s")


if __name__ == "__main__":
    main()
