"""Compare tp1_h200.sh's runs: the median output throughput of the plain path and of a world of
one through torch.distributed, and their ratio (issue 19's acceptance: within 2%).

    python benchmarks/engine/tp1_compare.py RUNS_DIR OUT.json
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def main(runs_dir: str, out: str) -> None:
    by: dict[str, list[dict]] = {"plain": [], "dist1": []}
    for path in sorted(Path(runs_dir).glob("w1_*.json")):
        run = json.loads(path.read_text())
        by[path.name.split("_")[1]].append({"file": path.name,
                                            "output_throughput": run["output_throughput"],
                                            "median_tpot_ms": run["median_tpot_ms"],
                                            "max_concurrency": run["max_concurrency"]})
    medians = {k: statistics.median(r["output_throughput"] for r in v) for k, v in by.items()
               if v}
    summary = {"runs": by, "median_output_throughput": medians,
               "dist1_over_plain": medians["dist1"] / medians["plain"]}
    Path(out).write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary["median_output_throughput"]), summary["dist1_over_plain"])


if __name__ == "__main__":
    main(*sys.argv[1:3])
