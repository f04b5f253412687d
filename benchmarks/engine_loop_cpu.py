"""The engine loop's own CPU cost per step, with the model stubbed out: schedule, update, output
messages (what the engine process does besides launching kernels), at N running requests.

The runner's `launch` is replaced by a stub that "samples" token 7 for every row, so each step is
pure host work: the scheduler at N running requests (finished ones replaced at once, as a
benchmark client does), and the outputs turned into the wire message the API process receives.
Runs in a fresh process per mode, with the heap frozen after start-up (as the engine does) or
not, and writes JSON with per-step median / mean / p99 / max and the number of full (generation
2) GC passes.

    python -m benchmarks.engine_loop_cpu --running 1024 --steps 600 --out DIR
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time

import numpy as np


def child(running: int, steps: int, freeze: bool) -> dict:
    import torch

    from moeserve.engine import protocol as p
    from moeserve.engine.args import engine_config_from_kwargs
    from moeserve.engine.core import EngineCore
    from moeserve.runner.model_runner import PendingOutput
    from moeserve.types import SamplingParams

    core = EngineCore(engine_config_from_kwargs(
        model="tiny-moe", device="cpu", max_running_requests=running, num_blocks=running * 20,
        max_num_batched_tokens=8192, async_scheduling=True))
    if not freeze:
        gc.unfreeze()  # start-up froze the heap: undo it to measure without

    def stub_launch(out):
        rows = np.flatnonzero(np.asarray(out.sample, dtype=bool))
        pending = PendingOutput(out.num_reqs, rows)
        pending.params = [out.sampling_params[i] for i in rows]
        pending.token_ids = torch.full((len(rows),), 7, dtype=torch.int64)
        return pending

    core.runner.launch = stub_launch
    params = SamplingParams(max_tokens=128, ignore_eos=True)
    added = 0

    def refill() -> None:
        nonlocal added
        while core.scheduler.num_running + core.scheduler.num_waiting < running:
            core.add_request(f"r{added}", list(range(1, 129)), params)
            added += 1

    refill()
    for _ in range(50):
        core.step()
        refill()
    full_passes = []
    gc.callbacks.append(lambda phase, info: full_passes.append(1)
                        if phase == "start" and info["generation"] == 2 else None)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        outputs = core.step()
        refill()
        p.encode(p.StepOutputs(outputs=[p.WireOutput.from_output(o) for o in outputs],
                               stats=p.EngineStats()))
        times.append((time.perf_counter() - start) * 1e3)
    t = np.asarray(times)
    return {"heap_frozen": freeze, "median_ms": float(np.median(t)), "mean_ms": float(t.mean()),
            "p99_ms": float(np.percentile(t, 99)), "max_ms": float(t.max()),
            "full_gc_passes": len(full_passes), "tracked_objects": len(gc.get_objects())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--running", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--child", choices=["frozen", "unfrozen"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.running, args.steps, args.child == "frozen")))
        return
    from benchmarks.w1_offline import environment

    modes = {}
    for mode in ("unfrozen", "frozen"):
        proc = subprocess.run([sys.executable, "-m", "benchmarks.engine_loop_cpu", "--child", mode,
                               "--running", str(args.running), "--steps", str(args.steps)],
                              capture_output=True, text=True, check=True,
                              env={**os.environ, "PYTHONPATH": os.getcwd()})
        modes[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
        print(mode, modes[mode], flush=True)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"engine_loop_cpu_r{args.running}.json")
    with open(path, "w") as f:
        json.dump({"benchmark": "engine_loop_cpu", "running": args.running, "steps": args.steps,
                   "modes": modes, "environment": environment()}, f, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
