"""The Triton kernels through Triton's compiler for sm90, on the CPU: what the interpreter
cannot see. The interpreter runs a kernel's Python, so a branch that is never taken never runs;
the compiler builds every branch it cannot rule out at compile time (a tile of height 0 is an
error there: the quantized MoE's SUB_M commits 0ee828a / c1c3ec8 passed every CPU test and would
not have compiled on a GPU). Each case runs benchmarks/kernels/kernel_sass.py in a process
without TRITON_INTERPRET and must get through code generation and lowering; ptxas itself may
fail where the CPU's Triton and its bundled ptxas disagree (that is not what is tested). The
Gluon kernels are left out: their API moves between Triton releases (CI's is not the GPU's)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CASES = {  # name: kernel_sass arguments
    "moe-bf16-plain": "moe --tile 64 128 64 4 3",
    "moe-bf16-one_dot-sub_m": "moe --tile 64 64 64 4 3 --one-dot --sub-m",
    "moe-bf16-persistent-down": "moe --tile 128 128 64 8 3 --persistent --down",
    "moe-quant-nvfp4-plain-64": "moe-quant --format nvfp4 --micro --decode asm "
                                "--tile 64 128 128 4 3",
    "moe-quant-nvfp4-sub_m-64": "moe-quant --format nvfp4 --micro --decode asm "
                                "--tile 64 128 128 4 3 --sub-m",
    "moe-quant-nvfp4-sub_m-32-down": "moe-quant --format nvfp4 --decode asm "
                                     "--tile 32 64 128 4 3 --sub-m --down",
    "moe-quant-int4-sub_m-128": "moe-quant --format int4 --micro --decode planes-asm "
                                "--tile 128 64 128 8 3 --sub-m",
    "moe-quant-fp8-plain-16": "moe-quant --format fp8 --tile 16 64 128 4 3",
    "w4a16-split": "w4a16 --tile 16 64 128 4 4 --split 4 --decode asm",
    "w4a16-dequant-micro": "w4a16-dequant --micro",
    "w4a16-dequant-epilogue": "w4a16-dequant --epilogue",
    "mla-decode-split": "mla-decode --tile 16 64 4 2 --heads 64 --split",
    "mla-decode-flat": "mla-decode-flat --tile 16 64 4 2 --heads 20",
    "mla-prefill": "mla-prefill --tile 64 64 4 2 --heads 20",
    "dsa-sparse": "dsa-sparse --tile 64 64 8 2 --heads 64",
    "gqa-prefill": "gqa-prefill --tile 128 64 4 3 --heads 8",
    "gqa-decode-split": "gqa-decode --tile 16 64 4 2 --heads 8 --split",
    "topk-row": "topk --form row",
    "topk-coop": "topk --form coop",
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_kernel_compiles_for_sm90(case: str) -> None:
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-m", "benchmarks.kernels.kernel_sass",
                          *CASES[case].split()], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    if run.returncode == 0:
        assert json.loads(run.stdout.splitlines()[-1])["registers"] <= 255
    else:  # only ptxas may fail, after code generation and lowering
        assert "CompilationError" not in run.stderr, run.stderr[-2000:]
        assert "ptxas" in run.stderr and "CalledProcessError" in run.stderr, run.stderr[-2000:]
