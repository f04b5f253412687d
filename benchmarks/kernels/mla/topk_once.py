"""One case of DSA's decode top-k for a kernel profiler (Nsight Compute) or a quick A/B: the
indexer's scores of `--batch` decode rows of `--context` positions each (GLM-5's indexer
shape, kernels_dsa's make_step, random data), written once, then topk_triton.radix_topk in one
`--form` (with `--gather`: topk_triton.GATHER) timed between cudaProfilerStart and
cudaProfilerStop (kernel_runs.profiled_median_ms), so `ncu --profile-from-start off` sees only
those calls. Prints one JSON line: the median ms (eager: host launch time included; in a
CUDA graph the chunks form's six launches cost less), and the selection checked equal to the
chunks form's.

Why: at 32 rows of 8,192 positions the top-k takes ~0.036 ms in a CUDA graph on the H100
(gpu_77293e0/call4) in every form, for 1 MB of scores; the row form's loop is 1,188 sm90
instructions a thread for each 4,096-position step (kernel_sass topk --form row: 144 VOTE,
128 POPC and 459 LOP3 of them the ballot histogram), which at 8 warps an SM issues in ~10 us
for the four levels, so most of the time is latency: the loads, the barriers, and with two
warps a scheduler each thread's dependent chains (at 8,192 positions and 32 warps the step
is 799 instructions, 64 registers, no spill: --block 8192 --warps 32).

    source benchmarks/gpu_env.sh
    python3 -m benchmarks.kernels.mla.topk_once --form row --batch 32 --context 8192
    ncu --profile-from-start off -k regex:radix --section WarpStateStats ... \
        python3 -m benchmarks.kernels.mla.topk_once --form row --calls 1
"""

from __future__ import annotations

import argparse
import json

import torch

from benchmarks.kernels.kernel_runs import profiled_median_ms
from benchmarks.kernels.mla.kernels_dsa import BLOCK, TOPK, make_step

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--form", choices=("row", "chunks", "coop", "auto"), default="row")
parser.add_argument("--gather", action="store_true", help="topk_triton.GATHER on")
parser.add_argument("--batch", type=int, default=32)
parser.add_argument("--context", type=int, default=8192)
parser.add_argument("--calls", type=int, default=20, help="timed calls")
parser.add_argument("--block", type=int, default=None,
                    help="positions a step (row form) or a program (chunks); default the form's")
parser.add_argument("--warps", type=int, default=None,
                    help="the row form's warps (topk_triton.ROW_WARPS); default 8")


def main() -> None:
    from moeserve.kernels.attention.dsa import indexer_triton, topk_triton

    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("topk_once needs a CUDA GPU")
    rows = [args.context - 1] * args.batch, [1] * args.batch
    q, w, index_cache, meta = make_step(*rows, BLOCK, "cuda", torch.bfloat16, integers=False)
    scale = q.shape[-1] ** -0.5
    chunks = list(indexer_triton.index_score_chunks(q, w, index_cache, meta, scale))
    if len(chunks) != 1:
        raise SystemExit(f"topk_once: {args.batch} x {args.context} scores in {len(chunks)} "
                         "launches; take fewer rows")
    _, _, scores = chunks[0]
    want = torch.empty(args.batch, TOPK, dtype=torch.int32, device="cuda")
    topk_triton.radix_topk(scores, meta, 0, TOPK, want, form="chunks")
    got = torch.empty_like(want)
    topk_triton.GATHER = args.gather
    if args.warps:
        topk_triton.ROW_WARPS = args.warps

    def fn() -> None:
        topk_triton.radix_topk(scores, meta, 0, TOPK, got, chunk=args.block, form=args.form)
    fn()
    if not torch.equal(got, want):
        raise SystemExit(f"topk_once: the {args.form} form's selection differs from the "
                         "chunks form's")
    ms = profiled_median_ms(fn, args.calls)
    print(json.dumps({**vars(args), "ms": round(ms, 4),
                      "scores_mb": round(scores.numel() * 4 / 2 ** 20, 2)}), flush=True)


if __name__ == "__main__":
    main()
