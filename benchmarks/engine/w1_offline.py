"""W1-offline(C): DESIGN.md's headline workload through the in-process engine (`LLM.generate`).

3C distinct requests of 128 random prompt tokens and exactly 128 output tokens (ignore_eos,
temperature 0), all submitted at once with max_running_requests = C, after a warm-up (one short
request, then 1 s). Output throughput = output tokens / wall seconds of the timed run. Writes one
JSON per concurrency with the git commit, device, torch/Triton versions, the full resolved engine
config and the capacity report.

    python benchmarks/engine/w1_offline.py --preset qwen3-30b-a3b --concurrency 256 1024 --out DIR
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import subprocess
import time

import torch

from moeserve import LLM, SamplingParams, envs


def environment() -> dict:
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    commit = envs.git_commit()
    if not commit and os.path.exists("GIT_COMMIT"):
        commit = open("GIT_COMMIT").read().strip()
    if not commit:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True,
                                text=True).stdout.strip() or None
    return {
        "git_commit": commit,
        "device": (torch.cuda.get_device_name() if torch.cuda.is_available()
                   else platform.processor()),
        "torch": torch.__version__,
        "triton": triton_version,
        "python": platform.python_version(),
        # the switches of envs.py this process ran with (A/B and experiment switches change
        # which kernels run)
        "moeserve_env": {k: v for k, v in sorted(os.environ.items())
                         if k.startswith("MOESERVE_")},
    }


def run_w1_offline(preset: str, concurrency: int, input_len: int, output_len: int,
                   engine_args: dict) -> dict:
    llm = LLM(preset, max_running_requests=concurrency, **engine_args)
    print(llm.report.format(), flush=True)
    vocab = llm.engine.model_config.vocab_size
    rng = random.Random(concurrency)
    num_prompts = 3 * concurrency
    prompts = [[rng.randrange(vocab) for _ in range(input_len)] for _ in range(num_prompts)]
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)

    warmup = [rng.randrange(vocab) for _ in range(16)]  # shares no block with the prompts
    llm.generate([warmup], SamplingParams(max_tokens=32, temperature=0.0))
    time.sleep(1.0)
    stats = llm.engine.scheduler.stats
    base_steps, base_hits = stats.num_scheduled_steps, stats.num_prefix_hit_tokens
    runner = llm.engine.runner
    base_graph, base_fallback = runner.num_graph_steps, runner.num_eager_decode_fallbacks
    start = time.perf_counter()
    results = llm.generate(prompts, params)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    duration = time.perf_counter() - start

    num_out = sum(len(r.token_ids) for r in results)
    assert num_out == num_prompts * output_len, "every request must produce exactly output_len"
    result = {
        "workload": "W1-offline", "preset": preset, "concurrency": concurrency,
        "num_prompts": num_prompts, "input_len": input_len, "output_len": output_len,
        "duration_s": duration, "output_throughput": num_out / duration,
        "total_throughput": (num_out + num_prompts * input_len) / duration,
        "request_throughput": num_prompts / duration,
        "num_steps": stats.num_scheduled_steps - base_steps,
        "prefix_hit_rate": (stats.num_prefix_hit_tokens - base_hits) / (num_prompts * input_len),
        "num_preemptions": stats.num_preemptions,
        "num_graph_steps": runner.num_graph_steps - base_graph,
        "cuda_graph_fallbacks": runner.num_eager_decode_fallbacks - base_fallback,
        "capacity_report": llm.report.to_dict(),
        "environment": environment(),
    }
    del llm, results
    gc.collect()
    torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen3-30b-a3b")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--moe-backend", default="auto")
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                        default=None, help="overlap the CPU's planning of step N+1 with the "
                        "device's step N (default: the engine's, on for CUDA)")
    parser.add_argument("--num-continuous-decode-steps", type=int, default=1)
    parser.add_argument("--tag", default="", help="suffix of the result file names")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    engine_args = {"moe_backend": args.moe_backend, "dtype": args.dtype,
                   "attention_backend": args.attention_backend,
                   "async_scheduling": args.async_scheduling,
                   "num_continuous_decode_steps": args.num_continuous_decode_steps,
                   "enforce_eager": args.enforce_eager}
    for c in args.concurrency:
        result = run_w1_offline(args.preset, c, args.input_len, args.output_len, engine_args)
        name = f"w1_offline_{args.preset}_c{c}{args.tag}.json"
        with open(os.path.join(args.out, name), "w") as f:
            json.dump(result, f, indent=2)
        print(json.dumps({k: result[k] for k in ("concurrency", "duration_s",
                                                  "output_throughput", "num_steps",
                                                  "prefix_hit_rate", "num_preemptions",
                                                  "num_graph_steps", "cuda_graph_fallbacks")}),
              flush=True)


if __name__ == "__main__":
    main()
