"""The Triton and Gluon kernels through the GPU machine's Triton release (3.6, which
scripts/setup.sh installs into .venv/gpu-triton beside CI's own) for sm90, on the CPU: what the
interpreter cannot see. The interpreter runs a kernel's Python, so a branch that is never taken
never runs; the compiler builds every branch it cannot rule out at compile time (a tile of
height 0 is an error there: the quantized MoE's SUB_M commits 0ee828a / c1c3ec8 passed every
CPU test and would not have compiled on a GPU), and the Gluon kernels (which the interpreter
does not run at all) have their layouts checked. Each case runs
benchmarks/kernels/kernel_sass.py in a process without TRITON_INTERPRET, with that release
first on its path, and must compile through ptxas (registers and spills are kernel_sass's
report)."""

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
    "moe-align-one": "moe-align-one --experts 128 --block-m 16",
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
    # DSA's bisect top-k at the served graph's width (four register chunks) and the indexer's
    # decode scores (every chunk branch and the key-tile helper built)
    "topk-bisect": "topk --form bisect --block 16384 --warps 16",
    "dsa-index-score": "index-score",
    # Gluon (kernels/attention/mla/*_gluon*.py): decode_gluon at 64 heads, its split and
    # 16-byte-store forms, the swapped one (20 heads), the warp-specialized one (64 heads, 4
    # warps), DSA's sparse forms, the prefill over query tiles
    "gluon-mla-decode": "mla-decode-gluon --tile 64 64 8 2 --heads 64",
    "gluon-mla-decode-split-vector": "mla-decode-gluon --tile 64 64 8 2 --heads 64 --split "
                                     "--vector-stores",
    "gluon-mla-decode-swapped": "mla-decode-gluon --tile 64 64 8 1 --heads 20 --swapped",
    "gluon-mla-decode-ws": "mla-decode-gluon --tile 64 64 4 2 --heads 64 --ws",
    "gluon-dsa-sparse": "mla-decode-gluon --tile 64 64 8 2 --heads 64 --sparse",
    "gluon-dsa-sparse-ws-slots": "mla-decode-gluon --tile 64 64 4 2 --heads 64 --ws --sparse "
                                 "--slots",
    "gluon-mla-prefill": "mla-decode-gluon --tile 64 64 8 2 --heads 20 --prefill",
    # the FP8 MoE's Gluon grouped GEMM (kernels/moe/quant/fp8_gluon.py): gated in both forms,
    # down, 64 and 128 rows
    "gluon-moe-fp8": "moe-fp8-gluon --block-m 128",
    "gluon-moe-fp8-one_dot-64": "moe-fp8-gluon --block-m 64 --one-dot",
    "gluon-moe-fp8-down": "moe-fp8-gluon --block-m 128 --down",
    "gluon-moe-fp8-down-64": "moe-fp8-gluon --block-m 64 --down",
    "gluon-moe-fp8-one_dot-n32": "moe-fp8-gluon --block-m 64 --one-dot --block-n 32",
    "gluon-moe-fp8-down-n64": "moe-fp8-gluon --block-m 128 --down --block-n 64",
    "gluon-moe-fp8-loaded-scales": "moe-fp8-gluon --block-m 64 --one-dot --loaded-scales",
    "gluon-moe-fp8-down-loaded-scales": "moe-fp8-gluon --block-m 64 --down --loaded-scales",
    "gluon-moe-fp8-ws": "moe-fp8-gluon-ws",
    "gluon-moe-fp8-ws-down": "moe-fp8-gluon-ws --down",
    # the bf16 MoE's warp-specialized Gluon grouped GEMM (kernels/moe/gluon_ws.py)
    "gluon-moe-ws": "moe-gluon-ws",
    "gluon-moe-ws-down": "moe-gluon-ws --down",
    "gluon-moe-ws-thread-arrive": "moe-gluon-ws --thread-arrive",
}
# cases whose point is wgmmas left running through other work: ptxas must not serialize them,
# and the main loop must keep one step's in flight (a wait above 0) without spilling
OVERLAPPED = {"gluon-moe-fp8", "gluon-moe-fp8-one_dot-64", "gluon-moe-fp8-down",
              "gluon-moe-fp8-down-64", "gluon-moe-fp8-one_dot-n32", "gluon-moe-fp8-down-n64",
              "gluon-moe-fp8-loaded-scales", "gluon-moe-fp8-down-loaded-scales",
              "gluon-moe-fp8-ws", "gluon-moe-ws", "gluon-moe-ws-down",
              "gluon-moe-ws-thread-arrive"}
GPU_TRITON = ROOT / ".venv" / "gpu-triton"  # scripts/setup.sh's


# the kernels that take programmatic dependent launch (triton_common.pdl), compiled with it
PDL_CASES = ("topk-bisect", "dsa-index-score", "gluon-dsa-sparse-ws-slots")


def compile_case(case: str, **env_vars: str) -> dict:
    """kernel_sass's report of CASES[case], compiled by the GPU machine's Triton release."""
    assert (GPU_TRITON / "triton" / "__init__.py").is_file(), (
        f"no GPU Triton in {GPU_TRITON}: run bash scripts/setup.sh")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | env_vars
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(GPU_TRITON), str(ROOT),
                                                      env.get("PYTHONPATH"))))
    run = subprocess.run([sys.executable, "-m", "benchmarks.kernels.kernel_sass",
                          *CASES[case].split()], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.splitlines()[-1])


@pytest.mark.parametrize("level", [0, 1, 2, 3])
@pytest.mark.parametrize("case", PDL_CASES)
def test_a_pdl_kernel_waits_and_releases_its_successor_only_when_asked(case: str,
                                                                        level: int) -> None:
    """At PDL level 1 the kernel's SASS holds one griddepcontrol.wait (ACQBULK); at 2 also one
    griddepcontrol.launch_dependents (PREEXIT), at 3 the same two after the metadata's loads;
    at 0 neither (a plain launch needs none). The warp-specialized sparse MLA from level 2
    waits in each warpgroup (its queries' copies go out before the scores warpgroup's wait:
    Q_EARLY), the P V one's wait too."""
    report = compile_case(case, SASS_PDL=str(level))
    waits = 2 if case == "gluon-dsa-sparse-ws-slots" and level >= 2 else int(level >= 1)
    assert (report["gdc_waits"], report["gdc_launches"]) == (waits, int(level >= 2))


@pytest.mark.parametrize("case", list(CASES))
def test_the_kernel_compiles_for_sm90(case: str) -> None:
    report = compile_case(case)
    dist = next(GPU_TRITON.glob("triton-*.dist-info")).name  # triton-<version>.dist-info
    installed = dist.removesuffix(".dist-info").split("-")[1]
    assert report["triton"] == installed  # the GPU machine's release, not CI's
    assert report["registers"] <= 255
    if case in OVERLAPPED:
        assert not report["wgmma_serialized"]
        assert max(report["loop_wgmma_waits"]) > 0, report["loop_wgmma_waits"]
        assert report["spill_store_bytes"] == 0
