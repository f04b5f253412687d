"""The quantized fused MoE kernel through Triton's compiler for sm90, on the CPU: what the
interpreter cannot see. The interpreter runs a kernel's Python, so a branch that is never taken
never runs; the compiler builds every branch it cannot rule out at compile time (a tile of
height 0 is an error there). Each case runs benchmarks/kernels/kernel_sass.py in a process
without TRITON_INTERPRET and must get through code generation; ptxas itself may fail where
the CPU's Triton and its bundled ptxas disagree (that is not what is tested)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
CASES = {  # name: kernel_sass moe-quant arguments
    "nvfp4-plain-64": "--format nvfp4 --micro --decode asm --tile 64 128 128 4 3",
    "nvfp4-sub_m-64": "--format nvfp4 --micro --decode asm --tile 64 128 128 4 3 --sub-m",
    "nvfp4-sub_m-32-down": "--format nvfp4 --decode asm --tile 32 64 128 4 3 --sub-m --down",
    "int4-sub_m-128": "--format int4 --micro --decode planes-asm --tile 128 64 128 8 3 --sub-m",
    "fp8-plain-16": "--format fp8 --tile 16 64 128 4 3",
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_kernel_compiles_for_sm90(case: str) -> None:
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-m", "benchmarks.kernels.kernel_sass", "moe-quant",
                          *CASES[case].split()], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    if run.returncode == 0:
        assert json.loads(run.stdout.splitlines()[-1])["registers"] <= 255
    else:  # only ptxas may fail, after code generation and lowering
        assert "CompilationError" not in run.stderr, run.stderr[-2000:]
        assert "ptxas" in run.stderr and "CalledProcessError" in run.stderr, run.stderr[-2000:]
