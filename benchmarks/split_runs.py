"""Split `moeserve bench --output-json` JSON lines into one committed JSON per run.

Every figure, the config, the server's /v1/engine and the environment are kept as they are. Per
request records keep all scalar fields; their per-chunk arrival lists are dropped (a W1 run at
concurrency 2,048 has 6,144 x 128 of them, tens of MB) because the ITL figures already summarise
them; `num_chunks` says how many there were.

    python benchmarks/split_runs.py RUNS.jsonl OUT_DIR PREFIX
"""

from __future__ import annotations

import json
import os
import sys


def main(path: str, out_dir: str, prefix: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(path) as f:
        for line in f:
            run = json.loads(line)
            for r in run["requests"]:
                r["num_chunks"] = len(r.pop("chunk_times", []))
                r.pop("chunk_tokens", None)
            name = f"{prefix}_c{run['max_concurrency']}.json"
            with open(os.path.join(out_dir, name), "w") as out:
                json.dump(run, out, indent=1)
            print(name, {k: run[k] for k in ("completed", "failed", "output_throughput",
                                             "server_api_cpu_fraction", "client_bound")})


if __name__ == "__main__":
    main(*sys.argv[1:4])
