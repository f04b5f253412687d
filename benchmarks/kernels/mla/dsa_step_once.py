"""One DSA decode step per layer (kernels_dsa's: GLM-5's indexer scores and top-k, then the
64-head sparse MLA over the selected latents) for a kernel profiler (Nsight Compute): built as
kernels_dsa's decode cases build it (random data, blocks scattered over the pools), compiled
and warmed up, then `--calls` steps between cudaProfilerStart and cudaProfilerStop, so that
`ncu --profile-from-start off` sees every kernel of those steps and nothing else. Prints one
JSON line: the median ms of those eager steps (host launch time included) and the step's read
bound (kernels_dsa's: context x 256 + 2,048 x 1,152 bytes a row at the device's copy rate).

    source benchmarks/gpu_env.sh
    ncu --profile-from-start off --section SpeedOfLight ... \
        python3 -m benchmarks.kernels.mla.dsa_step_once --batch 32 --context 8192 --calls 1
"""

from __future__ import annotations

import argparse
import json

import torch

from benchmarks.kernels.kernel_runs import device_ceilings, profiled_median_ms
from benchmarks.kernels.mla.dsa_inputs import full_layer_step
from benchmarks.kernels.mla.kernels_dsa import (
    BLOCK,
    LATENT,
    MLA_HEADS,
    ROPE,
    TOPK,
    make_step,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--calls", type=int, default=1, help="profiled steps")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("dsa_step_once needs a CUDA GPU")
    rows = [args.context - 1] * args.batch, [1] * args.batch
    q_i, w, index_cache, meta = make_step(*rows, BLOCK, "cuda", torch.bfloat16, integers=False)
    gen = torch.Generator(device="cuda").manual_seed(5)
    q = torch.randn(args.batch, MLA_HEADS, LATENT + ROPE, generator=gen,
                    device="cuda").to(torch.bfloat16)
    cache = torch.randn(index_cache.shape[0], BLOCK, LATENT + ROPE, generator=gen,
                        device="cuda").to(torch.bfloat16)
    scale, mla_scale = q_i.shape[-1] ** -0.5, (128 + 64) ** -0.5

    def step() -> torch.Tensor:  # as a full DSA layer runs it
        return full_layer_step(q_i, w, index_cache, meta, q, cache, scale, mla_scale, LATENT,
                               TOPK)
    ms = profiled_median_ms(step, args.calls)
    rate = device_ceilings("cuda").bytes_per_s
    bound_ms = args.batch * (args.context * 256 + TOPK * 1152) / rate * 1e3
    print(json.dumps({**vars(args), "ms": round(ms, 4), "read_bound_ms": round(bound_ms, 4)}),
          flush=True)


if __name__ == "__main__":
    main()
