"""kernels_mla.json files' cases, one a line (form, heads, case, the tile's keys and stages, ms,
share of the bound): the summary the H200 scripts print.

    python -m benchmarks.kernels.mla.mla_cases_table DIR/kernels_mla.json [...]
"""

from __future__ import annotations

import json
import sys


def lines(paths: list[str]) -> list[str]:
    """A line per case of each file; an unreadable file is one line naming it."""
    out = []
    for path in paths:
        try:
            with open(path) as f:
                cases = json.load(f)["cases"]
        except (OSError, ValueError, KeyError) as exc:
            out.append(f"{path}: {exc!r}")
            continue
        for r in cases:
            t = r["tile"]
            out.append(f"{r['form']} {r['heads']} {r['case']} ({t['block_n']}, "
                       f"{t['num_stages']}) {r['ms']} {r['pct_of_bound']}")
    return out


if __name__ == "__main__":
    print("\n".join(lines(sys.argv[1:])))
