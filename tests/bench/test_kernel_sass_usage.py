"""benchmarks/kernels/sm90_compile.py's reading of `ptxas -v`: registers, spilled bytes and
whether ptxas serialized the kernel's wgmmas."""

from __future__ import annotations

from benchmarks.kernels.sm90_compile import ptxas_usage

SPILLING = """ptxas info    : Compiling entry function '_decode_kernel' for 'sm_90a'
ptxas info    : Function properties for _decode_kernel
    1344 bytes stack frame, 2144 bytes spill stores, 2168 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 1344 bytes cumulative stack size"""


def test_a_spilling_kernel_reports_its_spills() -> None:
    assert ptxas_usage(SPILLING) == {"registers": 255, "spill_store_bytes": 2144,
                                     "spill_load_bytes": 2168, "wgmma_serialized": 0}


def test_a_clean_kernel_reports_zero_spills() -> None:
    text = ("    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
            "ptxas info    : Used 190 registers, used 1 barriers")
    assert ptxas_usage(text) == {"registers": 190, "spill_store_bytes": 0,
                                 "spill_load_bytes": 0, "wgmma_serialized": 0}


def test_serialized_wgmmas_are_reported() -> None:
    """ptxas's C7514 (as it printed it for fp8_gluon.py's first form, Triton 3.6)."""
    text = ("ptxas info    : (C7514) Potential Performance Loss: wgmma.mma_async instructions "
            "are serialized due to non wgmma instructions reading accumulator registers of  a "
            "wgmma between start and end of the pipeline stage in the function "
            "'_moe_fp8_kernel'\n"
            "ptxas info    : Used 242 registers, used 1 barriers")
    assert ptxas_usage(text)["wgmma_serialized"] == 1
    assert ptxas_usage(text)["registers"] == 242
