"""Where a kernel's warps wait, by SASS instruction: reads Nsight Compute's source page as CSV
(`ncu --import R.ncu-rep --page source --csv`, a report taken with --section SourceCounters)
and prints, for each kernel in it, its sampled warp stalls by reason and the instructions that
hold the most samples, each with its top reasons.

    python -m benchmarks.kernels.ncu_source_top R.source.csv [--top 25]

The page has a block a kernel: a "Kernel Name" line, a header ("Address", "Source", "Warp
Stall Sampling (All Samples)", ..., "stall_<reason>" columns), then a row an instruction.
"""

from __future__ import annotations

import argparse
import csv
from collections.abc import Iterator

SAMPLES = "Warp Stall Sampling (All Samples)"


def kernels(lines: list[str]) -> Iterator[tuple[str, list[dict[str, str]]]]:
    """(kernel name, its instruction rows as dicts) for each block of the page."""
    name, header, rows = None, None, []
    for rec in csv.reader(lines):
        if not rec:
            continue
        if rec[0] == "Kernel Name":
            if name is not None and header:
                yield name, rows
            name, header, rows = rec[1] if len(rec) > 1 else "?", None, []
        elif rec[0] == "Address" and header is None:
            header = rec
        elif header is not None:
            rows.append(dict(zip(header, rec, strict=False)))
    if name is not None and header:
        yield name, rows


def number(text: str | None) -> float:
    try:
        return float((text or "0").replace(",", ""))
    except ValueError:
        return 0.0


def reasons(row: dict[str, str]) -> dict[str, float]:
    """A row's sampled stalls by reason (the all-samples columns, not the not-issued ones)."""
    return {k[len("stall_"):]: number(v) for k, v in row.items()
            if k.startswith("stall_") and "Not Issued" not in k and number(v) > 0}


def summary(name: str, rows: list[dict[str, str]], top: int) -> list[str]:
    total = sum(number(r.get(SAMPLES)) for r in rows) or 1.0
    by_reason: dict[str, float] = {}
    for r in rows:
        for k, v in reasons(r).items():
            by_reason[k] = by_reason.get(k, 0.0) + v
    out = [f"== {name}: {int(total)} samples, {len(rows)} instructions",
           "   by reason: " + ", ".join(f"{k} {100 * v / total:.1f}%" for k, v in sorted(
               by_reason.items(), key=lambda kv: -kv[1])[:8])]
    for r in sorted(rows, key=lambda r: -number(r.get(SAMPLES)))[:top]:
        n = number(r.get(SAMPLES))
        if n <= 0:
            break
        why = ", ".join(f"{k} {int(v)}" for k, v in sorted(reasons(r).items(),
                                                           key=lambda kv: -kv[1])[:3])
        out.append(f"   {100 * n / total:5.1f}%  {r.get('Address', '?'):>6}  "
                   f"{(r.get('Source') or '').strip()[:70]:70}  {why}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv_path")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    with open(args.csv_path, newline="") as f:
        lines = f.read().splitlines()
    found = False
    for name, rows in kernels(lines):
        found = True
        print("\n".join(summary(name, rows, args.top)))
    if not found:
        raise SystemExit(f"{args.csv_path}: no kernel block (first lines: {lines[:3]})")


if __name__ == "__main__":
    main()
