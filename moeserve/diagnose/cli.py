"""`moeserve doctor RUNS.jsonl` and `moeserve report RUN.jsonl [RUN.jsonl ...] --out DIR`.

The lead's moeserve/cli.py wires them: `add_doctor_args(parser)` + `run_doctor(args)`,
`add_report_args(parser)` + `run_report(args)`. Both read the JSON lines `moeserve bench
--output-json` writes (with --diagnose for the telemetry-based rules and plots). Exit codes:
0 done, 2 bad input (a missing file, a line that is not a bench result; the message names it).
"""

from __future__ import annotations

import argparse
import json
import sys

from moeserve.diagnose import doctor
from moeserve.diagnose.report import load_runs, write_report


def add_doctor_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs", nargs="+", metavar="RUNS.jsonl",
                        help="bench results (JSON lines of `moeserve bench --output-json`)")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON line per run ({label, verdicts}) instead of text")


def run_doctor(args: argparse.Namespace) -> int:
    """Print each run's summary and verdicts."""
    try:
        runs = load_runs(args.runs)
        results = [(r, doctor.diagnose(r.data)) for r in runs]
    except ValueError as e:
        print(f"moeserve doctor: error: {e}", file=sys.stderr)
        return 2
    for run, verdicts in results:
        if args.json:
            print(json.dumps({"run": run.label, "verdicts": [v.to_dict() for v in verdicts]}))
            continue
        print(f"== {run.label}")
        for line in doctor.summary_lines(run.data) + doctor.format_verdicts(verdicts):
            print(f"  {line}")
    return 0


def add_report_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs", nargs="+", metavar="RUN.jsonl",
                        help="bench results; each file is one line in the concurrency plots")
    parser.add_argument("--out", required=True, metavar="DIR",
                        help="folder for report.md and its PNGs (created if needed)")


def run_report(args: argparse.Namespace) -> int:
    """Write the report; print where it is."""
    try:
        path = write_report(load_runs(args.runs), args.out)
    except ValueError as e:
        print(f"moeserve report: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0
