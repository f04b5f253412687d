"""Start-up time: from a fresh Python process to an engine ready to serve, cold then warm.

Each run is a new process that builds `LLM(preset)` (imports, weights, activation profile, KV
cache, kernel compilation, CUDA-graph capture) and prints its capacity report. The first run
should find Triton's cache empty (a freshly started machine, or pass --fresh-cache to point
TRITON_CACHE_DIR at a new folder); later runs reuse that cache. Wall seconds are measured by
this parent process, so they include the interpreter start and imports. Writes
startup_<preset>.json with each run's wall seconds, the report's phase seconds and the
environment.

    python -m benchmarks.engine.startup --preset qwen3-30b-a3b --runs 2 --out DIR [--fresh-cache]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from benchmarks.engine.w1_offline import environment

CHILD = """
import json, sys
from moeserve import LLM
llm = LLM(sys.argv[1], **json.loads(sys.argv[2]))
print("REPORT" + json.dumps(llm.report.to_dict()), flush=True)
"""


def one_start(preset: str, engine_args: dict, env: dict[str, str]) -> dict:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", CHILD, preset, json.dumps(engine_args)],
                          capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"start-up run failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    line = next(x for x in proc.stdout.splitlines() if x.startswith("REPORT"))
    report = json.loads(line[len("REPORT"):])
    return {"wall_seconds": round(wall, 2), "phase_seconds": report["phase_seconds"],
            "cuda_graphs": report.get("cuda_graphs"), "moe_configs": report.get("moe_configs"),
            "capacity_report": report}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen3-30b-a3b")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--out", required=True)
    parser.add_argument("--fresh-cache", action="store_true",
                        help="a new empty TRITON_CACHE_DIR for the first (cold) run")
    parser.add_argument("--engine-args", default="{}", help="JSON of LLM keyword arguments")
    args = parser.parse_args()
    env = dict(os.environ)
    if args.fresh_cache:
        env["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton-cache-")
    engine_args = json.loads(args.engine_args)
    runs = []
    for i in range(args.runs):
        run = one_start(args.preset, engine_args, env)
        run["run"] = "cold" if i == 0 else "warm"
        print(f"{run['run']}: {run['wall_seconds']} s; phases {run['phase_seconds']}",
              flush=True)
        runs.append(run)
    for run in runs[1:]:
        run.pop("capacity_report")  # the first run's is kept: the config is the same
    os.makedirs(args.out, exist_ok=True)
    doc = {"benchmark": "startup", "preset": args.preset, "engine_args": engine_args,
           "triton_cache_dir": env.get("TRITON_CACHE_DIR", "default (~/.triton/cache)"),
           "runs": runs, "environment": environment()}
    path = os.path.join(args.out, f"startup_{args.preset}.json")
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
