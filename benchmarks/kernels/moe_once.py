"""One bf16 routed-experts call of a kernels_moe.py backend for a kernel profiler (Nsight
Compute): a preset's expert shape, token count and routing as kernels_moe.py draws them,
compiled and warmed up, then `--calls` calls between cudaProfilerStart and cudaProfilerStop,
so that `ncu --profile-from-start off` sees only them. Prints the median ms of those calls
(CUDA events, eager: launch gaps included), a check that the backend runs.

--breakdown (no profiler range) prints one JSON line per backend given (--backend repeatable):
the whole routed layer in a CUDA graph as kernels_moe times it (select, align, the two
launches, the combine) and each kernel's GPU time a call over eager calls (torch.profiler,
moe_quant_once.breakdown), so that the launches' share of the layer is seen:

    python3 -m benchmarks.kernels.moe_once --breakdown --backend triton --backend gluon_ws

    source benchmarks/gpu_env.sh
    ncu --profile-from-start off -k regex:_moe_ws_kernel --section SpeedOfLight \
        python3 -m benchmarks.kernels.moe_once --backend gluon_ws --preset glm-4.7-flash \
        --tokens 8192
"""

from __future__ import annotations

import argparse
import json

import torch

from benchmarks.kernels import kernels_moe
from benchmarks.kernels.kernel_runs import profiled_median_ms
from moeserve.kernels.routing.select import select_experts
from moeserve.kernels.routing.select_triton import select_experts_triton


def main() -> None:
    backends = kernels_moe.make_backends()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=sorted(backends), action="append",
                        help="a kernels_moe backend (default triton; repeatable with "
                             "--breakdown)")
    parser.add_argument("--preset", default="glm-4.7-flash", help="a preset's expert shape")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--routing", choices=("dummy", "skewed"), default="dummy")
    parser.add_argument("--calls", type=int, default=1, help="measured calls")
    parser.add_argument("--breakdown", action="store_true",
                        help="each backend's layer in a graph and its kernels' times")
    args = parser.parse_args()
    names = args.backend or ["triton"]
    if len(names) > 1 and not args.breakdown:
        parser.error("several --backend only with --breakdown")
    if not torch.cuda.is_available():
        raise SystemExit("moe_once needs a CUDA GPU")
    experts, hidden, inter, top_k = kernels_moe.expert_shape(args.preset)
    gen = torch.Generator(device="cuda").manual_seed(0)
    dtype = kernels_moe.DTYPE
    w13 = (torch.randn(experts, 2 * inter, hidden, device="cuda", generator=gen) / 32).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, device="cuda", generator=gen) / 32).to(dtype)
    x = torch.randn(args.tokens, hidden, device="cuda", generator=gen).to(dtype)
    logits = kernels_moe.router_logits(args.routing, args.tokens, experts, seed=args.tokens)
    if args.breakdown:
        from benchmarks.quant.moe_quant_once import breakdown

        counts = torch.zeros(experts, dtype=torch.int64, device="cuda")
        for name in names:
            def layer(fn: kernels_moe.MoeFn = backends[name]) -> torch.Tensor:
                weights, ids = select_experts_triton(logits, top_k, True, counts=counts)
                return fn(x, w13, w2, weights, ids, num_tokens=args.tokens)
            print(json.dumps({"backend": name, "preset": args.preset, "tokens": args.tokens,
                              "routing": args.routing} | breakdown(layer, 5)), flush=True)
        return
    weights, ids = select_experts(logits, top_k, renormalize=True)
    fn = backends[names[0]]
    ms = profiled_median_ms(lambda: fn(x, w13, w2, weights, ids, num_tokens=args.tokens),
                            args.calls)
    print(f"{names[0]} {args.preset} T{args.tokens} {args.routing}: {ms:.4f} ms "
          f"(median of {args.calls} eager calls)")


if __name__ == "__main__":
    main()
