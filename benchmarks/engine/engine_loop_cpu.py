"""The engine loop's own CPU cost per step, with the model stubbed out: schedule, update, output
messages (what the engine process does besides launching kernels), at N running requests.

The runner's `launch` is replaced by a stub that "samples" token 7 for every row, so each step is
pure host work. Two workloads:

    mixed    the same 128-token prompt, 128 outputs; finished requests are replaced at once (as a
             benchmark client does), so each step decodes most rows and prefills a few
             (prefix-cache hits on the shared prompt)
    decode   distinct random 128-token prompts, outputs long enough that none finishes while
             measured: every measured step is decode-only at N rows (issue 14's figure)
    decode_sync  the same without overlap scheduling: each step's tokens are known when the next
             is planned, as benchmarks/engine/profile_step.py drives the scheduler on the GPU
    structured   mixed, every request held to W1's regex ([a-z]{128}, as structured_h200.sh) at
             the vocabulary of --vocab-size (qwen3's by default: a mask row is V bits): the
             grammar's host work apart, `masks` (StructuredSteps' prepare, begin and finish:
             the engine thread's part, waits for the masks thread included) and `intake`
             (add_request); the stub's token is "a", which the grammar always allows

`--device-ms D` gives the stub a device: a queue on which each step's forward takes D ms (its
sampling none), starting when it is enqueued or when the step before it ends, and a step's
tokens are read once its forward (and a deferred sampling, once enqueued) ended: the loop's
period is then max(device, host on the critical path) and shows what overlaps (the H200's
decode forward at 1,024 rows of qwen3-30b-a3b is about 27 ms).

Each runs in a fresh process per mode, with the heap frozen after start-up (as the engine does) or
not (mixed only), and writes JSON with per-step median / mean / p99 / max of the whole step and of
`Scheduler.schedule` and `Scheduler.update` apart, and the number of full (generation 2) GC
passes. The figures are this host's: the GPU machine's host is another CPU.

    python -m benchmarks.engine.engine_loop_cpu --running 1024 --steps 600 --out DIR --tag before
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import subprocess
import sys
import time

import numpy as np

PROMPT_LEN = 128
MIXED_MAX_TOKENS = 128


def _summary(ms: list[float]) -> dict:
    t = np.asarray(ms)
    return {"median_ms": float(np.median(t)), "mean_ms": float(t.mean()),
            "p99_ms": float(np.percentile(t, 99)), "max_ms": float(t.max())}


REGEX = "[a-z]{128}"


class SimulatedDevice:
    """A device queue for the stub (module docstring): enqueue an op, read when it ends."""

    def __init__(self, ms: float) -> None:
        self.seconds = ms / 1e3
        self.free_at = 0.0

    def enqueue(self, seconds: float) -> float:
        start = max(time.perf_counter(), self.free_at)
        self.free_at = start + seconds
        return self.free_at


def child(running: int, steps: int, freeze: bool, workload: str, vocab_size: int,
          device_ms: float = 0.0) -> dict:
    import torch

    from moeserve.engine.args import engine_config_from_kwargs
    from moeserve.engine.core import EngineCore
    from moeserve.engine.process import protocol as p
    from moeserve.runner.pending_output import PendingOutput
    from moeserve.structured.spec import StructuredOutput
    from moeserve.types import SamplingParams

    decode = workload.startswith("decode")
    max_tokens = steps + 200 if decode else MIXED_MAX_TOKENS
    blocks_per_req = -(-(PROMPT_LEN + max_tokens) // 16) + 1
    core = EngineCore(engine_config_from_kwargs(
        model="tiny-moe", device="cpu", max_running_requests=running,
        num_blocks=running * blocks_per_req, max_num_batched_tokens=8192,
        max_model_len=PROMPT_LEN + max_tokens, async_scheduling=workload != "decode_sync",
        hf_overrides={"vocab_size": vocab_size} if workload == "structured" else None))
    if not freeze:
        gc.unfreeze()  # start-up froze the heap: undo it to measure without

    token = ord("a") if workload == "structured" else 7
    device = SimulatedDevice(device_ms)

    class Pending(PendingOutput):
        ready_at = 0.0  # when the simulated device has the step's tokens

        def result(self):
            wait = self.ready_at - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
            return super().result()

    def stub_launch(out, defer_sampling=False):
        rows = np.flatnonzero(np.asarray(out.sample, dtype=bool))
        pending = Pending(out.num_reqs, rows)
        pending.params = [out.sampling_params[i] for i in rows]
        pending.token_ids = torch.full((len(rows),), token, dtype=torch.int64)
        pending.ready_at = device.enqueue(device.seconds) if device.seconds else 0.0
        return pending

    def stub_sample(pending, out):
        if device.seconds:
            pending.ready_at = device.enqueue(0.0)

    core.runner.launch = stub_launch
    core.runner.sample_deferred = stub_sample
    sched = core.scheduler
    phases: dict[str, list[float]] = {"schedule": [], "update": [], "masks": [], "intake": []}

    last = {}

    def timed(name: str, fn):
        def wrapper(*args):
            start = time.perf_counter()
            result = fn(*args)
            phases[name].append((time.perf_counter() - start) * 1e3)
            last["plan" if name == "schedule" else name] = result
            return result
        return wrapper

    sched.schedule = timed("schedule", sched.schedule)
    sched.update = timed("update", sched.update)
    for name in ("prepare", "begin", "finish"):  # the masks' time on the engine's thread
        if hasattr(core.structured, name):  # (begin / finish: since the masks thread)
            setattr(core.structured, name, timed("masks", getattr(core.structured, name)))
    add_request = timed("intake", core.add_request)
    structured = StructuredOutput("regex", REGEX) if workload == "structured" else None
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, structured=structured)
    rng = random.Random(0)
    added = 0

    def refill() -> None:
        nonlocal added
        while sched.num_running + sched.num_waiting < running:
            prompt = ([rng.randrange(1, 256) for _ in range(PROMPT_LEN)] if decode
                      else list(range(1, PROMPT_LEN + 1)))
            add_request(f"r{added}", prompt, params)
            added += 1

    refill()
    for _ in range(50):
        core.step()
        if not decode:
            refill()
    while decode and (sched.num_waiting or any(n > 1 for n in last["plan"].num_scheduled_tokens)):
        core.step()  # decode: until every request is admitted and its prompt computed
    full_passes = []
    gc.callbacks.append(lambda phase, info: full_passes.append(1)
                        if phase == "start" and info["generation"] == 2 else None)
    for v in phases.values():
        v.clear()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        outputs = core.step()
        if not decode:
            refill()
        p.encode(p.StepOutputs(outputs=[p.WireOutput.from_output(o) for o in outputs],
                               stats=p.EngineStats()))
        times.append((time.perf_counter() - start) * 1e3)
    if decode:
        assert sched.num_running == running and not sched.num_waiting, "a request finished"
    both = [s + u for s, u in zip(phases["schedule"], phases["update"])]
    per_step = {name: round(sum(phases[name]) / steps, 4) for name in ("masks", "intake")}
    return {"workload": workload, "heap_frozen": freeze, "device_ms": device_ms,
            **_summary(times),
            "schedule": _summary(phases["schedule"]), "update": _summary(phases["update"]),
            "schedule_plus_update": _summary(both),
            "masks_ms_per_step": per_step["masks"], "intake_ms_per_step": per_step["intake"],
            "num_grammar_waits": core.structured.num_overlap_waits,
            "full_gc_passes": len(full_passes), "tracked_objects": len(gc.get_objects())}


def _host() -> dict:
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f
                          if line.startswith("model name")), "")
    except OSError:
        pass
    status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                            capture_output=True, text=True)
    return {"cpu": model or platform.processor(), "cpu_count": os.cpu_count(),
            "git_dirty": bool(status.stdout.strip()) if status.returncode == 0 else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--running", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--tag", default="", help="suffix of the JSON's name (before, after)")
    parser.add_argument("--vocab-size", type=int, default=151_936,
                        help="the structured workload's vocabulary (a mask row is this many bits)")
    parser.add_argument("--device-ms", type=float, default=0.0,
                        help="a simulated device's forward per step (module docstring)")
    parser.add_argument("--workloads", nargs="+", default=["mixed", "decode", "decode_sync",
                                                           "structured"])
    parser.add_argument("--child", choices=["frozen", "unfrozen"], help=argparse.SUPPRESS)
    parser.add_argument("--workload", choices=["mixed", "decode", "decode_sync", "structured"],
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.running, args.steps, args.child == "frozen", args.workload,
                               args.vocab_size, args.device_ms)))
        return
    from benchmarks.engine.w1_offline import environment

    modes = {}
    runs = [(w, m) for w, m in (("mixed", "unfrozen"), ("mixed", "frozen"), ("decode", "frozen"),
                                ("decode_sync", "frozen"), ("structured", "frozen"))
            if w in args.workloads]
    for workload, mode in runs:
        proc = subprocess.run([sys.executable, "-m", "benchmarks.engine.engine_loop_cpu",
                               "--child", mode,
                               "--workload", workload, "--running", str(args.running),
                               "--steps", str(args.steps), "--vocab-size", str(args.vocab_size),
                               "--device-ms", str(args.device_ms)],
                              capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                  filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))})
        if proc.returncode:
            sys.exit(proc.stderr)
        name = mode if workload == "mixed" else f"{workload}_{mode}"
        modes[name] = json.loads(proc.stdout.strip().splitlines()[-1])
        print(name, modes[name], flush=True)
    os.makedirs(args.out, exist_ok=True)
    suffix = f"_{args.tag}" if args.tag else ""
    path = os.path.join(args.out, f"engine_loop_cpu_r{args.running}{suffix}.json")
    with open(path, "w") as f:
        json.dump({"benchmark": "engine_loop_cpu", "running": args.running, "steps": args.steps,
                   "vocab_size": args.vocab_size, "regex": REGEX,
                   "device_ms": args.device_ms, "modes": modes,
                   "environment": {**environment(), **_host()}}, f, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
