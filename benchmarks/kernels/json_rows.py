"""Prints chosen keys of a result file's rows, a line a row: the h200 scripts' summary of what
a benchmark wrote (kernels_dsa.json's "decode" rows, say), so that each script names its keys
rather than carrying its own reader.

    python3 -m benchmarks.kernels.json_rows FILE SECTION LABEL KEY [KEY ...]

LABEL names each row (its value first); a key the row lacks prints as None; a missing file
says so and exits 1.
"""

from __future__ import annotations

import json
import sys


def main(argv: list[str]) -> int:
    if len(argv) < 4:
        print(__doc__.strip().splitlines()[3].strip())
        return 2
    path, section, label, *keys = argv
    try:
        with open(path) as f:
            rows = json.load(f)[section]
    except (OSError, KeyError, ValueError) as e:
        print(f"no result in {path} [{section}]: {e!r}")
        return 1
    for row in rows:
        print(row.get(label), " ".join(f"{k} {row.get(k)}" for k in keys), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
