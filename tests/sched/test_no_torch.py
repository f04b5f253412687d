"""sched/ is pure Python: importing it must not pull in torch, triton or numpy."""

from __future__ import annotations

import subprocess
import sys


def test_importing_sched_imports_no_torch_triton_or_numpy() -> None:
    code = ("import sys, moeserve.sched; "
            "print(sorted(m for m in ('torch', 'triton', 'numpy') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True)
    assert result.stdout.strip() == "[]", result.stdout + result.stderr
