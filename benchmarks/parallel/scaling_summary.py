"""Issue 20's scaling table from benchmarks/h200/scaling_h200.sh's runs: for each run
w1_<mode>_w<W>_c<C>.jsonl in a folder (a `moeserve bench` JSON), the output tok/s, the same per
GPU, its ratio to one GPU's at the same streams per GPU (the issue's target: at least 0.8 at
2,048 streams a GPU), the step's collectives as a share of its device time (the doctor's
figure, diagnose/parallel_rules.comm_times: the engine samples' mean over a `--diagnose` run of
the latest eagerly run sampled step's; "-" without them), and whether the client or the API
processes were the limit (the bench's client_bound, the API servers' CPU share).

    python -m benchmarks.parallel.scaling_summary DIR    # prints the table; exit 1 if no run
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from moeserve.diagnose.parallel_rules import comm_times

NAME = re.compile(r"^w1_(?P<mode>[a-z]+)_w(?P<world>\d+)_c(?P<streams>\d+)\.jsonl$")


@dataclass(frozen=True)
class Run:
    mode: str
    world: int
    streams: int
    output_tok_s: float
    completed: int
    failed: int
    comm_share: float | None
    client_bound: bool
    api_cpu: float | None

    @property
    def per_gpu_streams(self) -> int:
        return self.streams // self.world

    @property
    def per_gpu_tok_s(self) -> float:
        return self.output_tok_s / self.world


def load_runs(folder: Path) -> list[Run]:
    """The runs in folder, by name (each file's last result); a file not named as a run is
    skipped, a run that is not a bench result is an error naming it."""
    runs = []
    for path in sorted(folder.glob("w1_*.jsonl")):
        m = NAME.match(path.name)
        if not m:
            continue
        try:
            # the last result: `moeserve bench --output-json` appends one a run
            result = json.loads([ln for ln in path.read_text().splitlines() if ln.strip()][-1])
            times = comm_times(result)
            runs.append(Run(
                mode=m["mode"], world=int(m["world"]), streams=int(m["streams"]),
                output_tok_s=float(result["output_throughput"]),
                completed=int(result["completed"]), failed=int(result["failed"]),
                comm_share=times[0] / times[1] if times else None,
                client_bound=bool(result.get("client_bound")),
                api_cpu=result.get("server_api_cpu_fraction")))
        except (IndexError, KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path}: not a moeserve bench result ({exc!r})") from exc
    return runs


def table(runs: list[Run]) -> str:
    """One line a run, by world size, mode and streams, with its ratio to W 1's per-GPU figure
    at the same streams per GPU ("-" where that run is missing)."""
    base = {r.per_gpu_streams: r.per_gpu_tok_s for r in runs if r.world == 1}
    lines = ["mode  W  streams  per GPU  output tok/s  per GPU tok/s  x one GPU  comm share  "
             "done/failed  client bound  API CPU"]
    for r in sorted(runs, key=lambda r: (r.world, r.mode, r.streams)):
        one = base.get(r.per_gpu_streams)
        ratio = f"{r.per_gpu_tok_s / one:.2f}" if one else "-"
        comm = f"{100 * r.comm_share:.1f}%" if r.comm_share is not None else "-"
        api = f"{100 * r.api_cpu:.0f}%" if r.api_cpu is not None else "-"
        lines.append(f"{r.mode:<5} {r.world:>2} {r.streams:>8} {r.per_gpu_streams:>8} "
                     f"{r.output_tok_s:>13,.0f} {r.per_gpu_tok_s:>14,.0f} {ratio:>10} "
                     f"{comm:>11} {r.completed:>6}/{r.failed:<5} {str(r.client_bound):>12} "
                     f"{api:>8}")
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) != 2:
        raise SystemExit("usage: scaling_summary.py DIR")
    runs = load_runs(Path(sys.argv[1]))
    if not runs:
        print(f"no w1_<mode>_w<W>_c<C>.jsonl runs in {sys.argv[1]}")
        raise SystemExit(1)
    print(table(runs))


if __name__ == "__main__":
    main()
