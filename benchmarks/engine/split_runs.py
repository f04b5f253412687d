"""Split `moeserve bench --output-json` JSON lines into one committed JSON per run.

Every figure, the config, the server's /v1/engine and the environment are kept as they are. The
per-request records are dropped by default (every figure was computed from them already, and a
W1 sweep's records come to several MB a run, while the repo travels to the GPU machine within
64 MiB); `num_request_records_dropped` says how many there were. With --keep-requests they stay,
each with its scalar fields only: the per-chunk arrival lists go (a W1 run at concurrency 2,048
has 6,144 x 128 of them, tens of MB; the ITL figures summarise them) and `num_chunks` says how
many there were.

A concurrency run again in the same file (`moeserve bench --max-concurrency 1024 1024`) gets
_run2, _run3, ... after its name instead of overwriting the first.

    python benchmarks/engine/split_runs.py RUNS.jsonl OUT_DIR PREFIX [--keep-requests]
"""

from __future__ import annotations

import argparse
import json
import os


def slim(run: dict, keep_requests: bool) -> dict:
    """The run as committed: request records dropped (counted), or kept without chunk lists."""
    if not keep_requests:
        run["num_request_records_dropped"] = len(run.pop("requests", None) or [])
        return run
    for r in run.get("requests") or []:
        r["num_chunks"] = len(r.pop("chunk_times", []))
        r.pop("chunk_tokens", None)
    return run


def main(path: str, out_dir: str, prefix: str, keep_requests: bool = False) -> None:
    os.makedirs(out_dir, exist_ok=True)
    seen: dict[object, int] = {}  # concurrency -> runs so far in this file
    with open(path) as f:
        for line in f:
            run = slim(json.loads(line), keep_requests)
            concurrency = run["max_concurrency"]
            seen[concurrency] = seen.get(concurrency, 0) + 1
            repeat = f"_run{seen[concurrency]}" if seen[concurrency] > 1 else ""
            name = f"{prefix}_c{concurrency}{repeat}.json"  # a repeat never overwrites
            with open(os.path.join(out_dir, name), "w") as out:
                json.dump(run, out, indent=1)
            print(name, {k: run[k] for k in ("completed", "failed", "output_throughput",
                                             "server_api_cpu_fraction", "client_bound")})


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs")
    parser.add_argument("out_dir")
    parser.add_argument("prefix")
    parser.add_argument("--keep-requests", action="store_true")
    args = parser.parse_args()
    main(args.runs, args.out_dir, args.prefix, args.keep_requests)
