"""sched/ imports neither torch nor triton (numpy is allowed: DESIGN.md): importing it must not
pull them in."""

from __future__ import annotations

import subprocess
import sys


def test_importing_sched_imports_no_torch_or_triton() -> None:
    code = ("import sys, moeserve.sched; "
            "print(sorted(m for m in ('torch', 'triton') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True)
    assert result.stdout.strip() == "[]", result.stdout + result.stderr
