"""Where a decode step's time goes: scheduler, runner (host + GPU), update, and GPU kernel time.

Fills the engine with B requests of 128 random prompt tokens, runs until all decode, then times
N decode steps phase by phase (synchronising the GPU after each phase) and profiles one step with
torch.profiler to sum GPU kernel time by kind. The profiled decode step and W1's mixed step also
report each part (MoE, attention, dense GEMMs, norms and RoPE, other) against its own roofline
bound (moeserve/diagnose/bounds/step_parts.py). Writes JSON with the environment.

    python benchmarks/engine/profile_step.py --preset qwen3-30b-a3b --batch 256 1024 --out DIR
    python -m benchmarks.engine.profile_step --preset deepseek-v3 --hf-overrides \
        '{"num_hidden_layers": 5}' --engine-args '{"moe_tiles": "default"}' --batch 1024
        # a preset too large for one GPU, sliced (issue 16's decode-step profile)
    python -m benchmarks.engine.profile_step --batch 72 --prompt-len 8192 --mixed-new 1 \
        --mixed-prompt-len 8192 --mixed-cuda-graphs
        # issue 14's long prompts: decodes at 8k context, and a step that takes in one 8k prompt
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time

import numpy as np
import torch

from benchmarks.engine.w1_offline import environment
from moeserve import LLM, SamplingParams
from moeserve.diagnose.bounds.roofline import ceilings_for, step_cost, weights_format
from moeserve.diagnose.bounds.step_parts import describe, part_shares, part_times_ms
from moeserve.types import SchedulerOutput

MIXED_NEW, MIXED_ROUNDS = 64, 3  # W1 at 1,024: a group of 64 finishes, 64 new prompts come in
PROMPT_LEN = 128  # W1's prompts (the running requests' and the new ones')


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def profile_batch(preset: str, batch: int, num_steps: int, engine_args: dict,
                  prompt_len: int = PROMPT_LEN, mixed_new: int = MIXED_NEW,
                  mixed_prompt_len: int = PROMPT_LEN) -> dict:
    """B running requests of `prompt_len` random tokens, timed at decode; then MIXED_ROUNDS
    steps that each take in `mixed_new` prompts of `mixed_prompt_len` tokens."""
    llm = LLM(preset, max_running_requests=batch + MIXED_ROUNDS * mixed_new, **engine_args)
    rng = random.Random(batch)
    vocab = llm.engine.model_config.vocab_size
    params = SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True)
    for _ in range(batch):
        llm.add_request([rng.randrange(vocab) for _ in range(prompt_len)], params)
    engine, sched = llm.engine, llm.engine.scheduler
    while True:  # prefill everything
        out = sched.schedule()
        sched.update(out, engine.runner.execute(out))
        if all(n == 1 for n in out.num_scheduled_tokens) and out.num_reqs >= batch:
            break
    phases: dict[str, list[float]] = {"schedule": [], "execute": [], "update": [], "step": []}
    for _ in range(num_steps):
        _sync()
        t0 = time.perf_counter()
        out = sched.schedule()
        t1 = time.perf_counter()
        result = engine.runner.execute(out)  # ends with .tolist(): the GPU is done
        t2 = time.perf_counter()
        sched.update(out, result)
        t3 = time.perf_counter()
        for k, v in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t3 - t0)):
            phases[k].append(v * 1e3)
    engine_steps = []
    for _ in range(num_steps):  # the whole engine step, as LLM.generate drives it
        _sync()
        t0 = time.perf_counter()
        llm.step()
        _sync()
        engine_steps.append((time.perf_counter() - t0) * 1e3)
    phases["engine_step"] = engine_steps
    kernels = {}
    if torch.cuda.is_available():
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            out = sched.schedule()
            sched.update(out, engine.runner.execute(out))
        events = [e for e in prof.key_averages() if e.device_time_total > 0]
        gpu_total = sum(e.self_device_time_total for e in events) / 1e3
        top = sorted(events, key=lambda e: -e.self_device_time_total)[:25]
        kernels = {"gpu_busy_ms": gpu_total,
                   "top": [{"name": e.key[:120], "ms": e.self_device_time_total / 1e3,
                            "calls": e.count} for e in top],
                   "parts": step_parts(llm, out, events)}
    mixed = profile_mixed_steps(llm, rng, vocab, params, mixed_new, mixed_prompt_len)
    result = {"preset": preset, "batch": batch, "num_steps": num_steps, "mixed_step": mixed,
              "prompt_len": prompt_len,
              "median_ms": {k: statistics.median(v) for k, v in phases.items()},
              "graph_steps": engine.runner.num_graph_steps,
              "cuda_graph_fallbacks": engine.runner.num_eager_decode_fallbacks,
              "gpu_kernels_one_step": kernels, "capacity_report": llm.report.to_dict(),
              "environment": environment()}
    del llm
    torch.cuda.empty_cache()
    return result


def profile_mixed_steps(llm: LLM, rng: random.Random, vocab: int, params: SamplingParams,
                        new: int = MIXED_NEW, prompt_len: int = PROMPT_LEN) -> dict:
    """W1's other step: `new` new prompts of `prompt_len` tokens beside the running decodes.
    Times MIXED_ROUNDS such steps (the first also compiles) and profiles the last one's host
    and device time (a prompt longer than the step's token budget is chunked: the step
    timed is the one that takes in its first chunk)."""
    walls = []
    prof = None
    for i in range(MIXED_ROUNDS):
        for _ in range(new):
            llm.add_request([rng.randrange(vocab) for _ in range(prompt_len)], params)
        _sync()
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        last = i == MIXED_ROUNDS - 1
        t0 = time.perf_counter()
        if last:  # the step's plan kept (for its cost) by wrapping the scheduler's schedule
            sched = llm.engine.scheduler
            plans = _keep_plans(sched)
            with torch.profiler.profile(activities=activities) as prof:
                llm.step()
                _sync()
            del sched.schedule  # the instance attribute: the method is back
            out = plans[-1]
        else:
            llm.step()
            _sync()
        walls.append((time.perf_counter() - t0) * 1e3)
    events = list(prof.key_averages())
    gpu = [e for e in events if e.self_device_time_total > 0]
    cpu_top = sorted(events, key=lambda e: -e.self_cpu_time_total)[:15]
    gpu_top = sorted(gpu, key=lambda e: -e.self_device_time_total)[:40]
    return {"new_prompts": new, "new_prompt_len": prompt_len, "wall_ms": walls,
            "gpu_busy_ms_last": sum(e.self_device_time_total for e in gpu) / 1e3,
            "parts": step_parts(llm, out, events),
            "cpu_top": [{"name": e.key[:120], "self_cpu_ms": e.self_cpu_time_total / 1e3,
                         "calls": e.count} for e in cpu_top],
            "gpu_top": [{"name": e.key[:120], "ms": e.self_device_time_total / 1e3,
                         "calls": e.count} for e in gpu_top]}


def _keep_plans(sched: object) -> list[SchedulerOutput]:
    """Wrap sched.schedule (an instance attribute) so that each plan it returns is kept."""
    plans: list[SchedulerOutput] = []
    schedule = sched.schedule

    def keep() -> SchedulerOutput:
        plans.append(schedule())
        return plans[-1]

    sched.schedule = keep
    return plans


def step_parts(llm: LLM, out: SchedulerOutput, events: list) -> dict:
    """The profiled step's device kernels by part, each against its own bound: the step's cost
    from its plan (its tokens, sampling rows, batch, and mean row length after the step as the
    context attended)."""
    kernels = [(e.key, e.self_device_time_total / 1e3) for e in events
               if e.device_type == torch.autograd.DeviceType.CUDA
               and e.self_device_time_total > 0]
    measured = part_times_ms(kernels)
    lengths = (np.asarray(out.num_computed_tokens) + np.asarray(out.num_scheduled_tokens))
    step = {"tokens": int(sum(out.num_scheduled_tokens)), "rows": int(sum(out.sample)),
            "batch": out.num_reqs, "context": float(lengths.mean()) if out.num_reqs else 0.0}
    ceilings = ceilings_for(torch.cuda.get_device_name()) if torch.cuda.is_available() else None
    if ceilings is None:
        return {"step": step, "measured_ms": measured, "bounds": "no measured ceilings"}
    runner, model = llm.engine.runner, llm.engine.model_config
    quant = weights_format(llm.engine.cfg.quantization, model)  # the weights' bytes
    folded = any(b.folded_shared for b in runner.model.moe_blocks())  # fold_shared_experts
    cost = step_cost(model, runner.dtype.itemsize, **step, quant=quant,
                     kv_elem_bytes=runner.kv_dtype.itemsize, shared_in_moe=folded)
    shares = part_shares(cost, ceilings, measured)
    return {"step": step, "parts": [s.to_dict() for s in shares], "line": describe(shares)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen3-30b-a3b")
    parser.add_argument("--batch", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--moe-backend", default="auto")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--mixed-cuda-graphs", action="store_true",
                        help="mixed steps through the piecewise CUDA graphs")
    parser.add_argument("--hf-overrides", default=None,
                        help="JSON edits to the preset's config (e.g. fewer layers to fit)")
    parser.add_argument("--engine-args", default="{}",
                        help="JSON of more engine keywords (e.g. {\"moe_tiles\": \"default\"})")
    parser.add_argument("--prompt-len", type=int, default=PROMPT_LEN,
                        help="the running requests' prompt tokens (their decode context)")
    parser.add_argument("--mixed-new", type=int, default=MIXED_NEW,
                        help="new prompts a profiled mixed step takes in")
    parser.add_argument("--mixed-prompt-len", type=int, default=PROMPT_LEN)
    parser.add_argument("--tag", default="")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    engine_args = {"moe_backend": args.moe_backend, "enforce_eager": args.enforce_eager,
                   "mixed_cuda_graphs": args.mixed_cuda_graphs, **json.loads(args.engine_args)}
    if args.hf_overrides:
        engine_args["hf_overrides"] = args.hf_overrides
    for b in args.batch:
        r = profile_batch(args.preset, b, args.steps, engine_args, args.prompt_len,
                          args.mixed_new, args.mixed_prompt_len)
        name = f"profile_step_{args.preset}_b{b}{args.tag}.json"
        with open(os.path.join(args.out, name), "w") as f:
            json.dump(r, f, indent=2)
        for kind, parts in (("decode", r["gpu_kernels_one_step"].get("parts", {})),
                            ("mixed", r["mixed_step"]["parts"])):
            print(f"{kind} step at batch {b}: {parts.get('line', parts)}", flush=True)
        print(json.dumps({"batch": b, "mixed_wall_ms": r["mixed_step"]["wall_ms"],
                          "mixed_gpu_ms": r["mixed_step"]["gpu_busy_ms_last"],
                          **r["median_ms"],
                          "gpu_busy_ms": r["gpu_kernels_one_step"].get("gpu_busy_ms")}), flush=True)


if __name__ == "__main__":
    main()
