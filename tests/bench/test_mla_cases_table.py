"""benchmarks/kernels/mla/mla_cases_table.py: the H200 scripts' one-line-a-case summary."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.kernels.mla.mla_cases_table import lines


def test_a_line_a_case_and_a_line_for_an_unreadable_file(tmp_path: Path) -> None:
    case = {"form": "gluon", "heads": 20, "case": "b256_ctx1024", "ms": 0.1137,
            "pct_of_bound": 62.2, "tile": {"block_n": 64, "num_stages": 2}}
    good = tmp_path / "kernels_mla.json"
    good.write_text(json.dumps({"cases": [case, {**case, "heads": 64}]}))
    bad = tmp_path / "missing.json"
    out = lines([str(good), str(bad)])
    assert out[:2] == ["gluon 20 b256_ctx1024 (64, 2) 0.1137 62.2",
                       "gluon 64 b256_ctx1024 (64, 2) 0.1137 62.2"]
    assert len(out) == 3 and out[2].startswith(f"{bad}: FileNotFoundError")
