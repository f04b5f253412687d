"""benchmarks/quant/kernels_quant.py times the engine's quantized MoE dispatcher, so that its
--moe-dequant switch changes what runs (it once timed the fused kernel on both sides); the
register cap switch (--maxnreg); a switch set by tag for a profiler's run."""

from __future__ import annotations

import pytest

from benchmarks.quant.kernels_quant import moe_op


def test_moe_op_goes_through_the_engine_dispatcher(monkeypatch: pytest.MonkeyPatch) -> None:
    import moeserve.kernels.moe.quant as quant

    calls = []
    monkeypatch.setattr(quant, "moe_quantized",
                        lambda *a, **kw: calls.append((a, kw)) or "out")
    fn = moe_op("nvfp4", "x", "w13", "w2", "weights", "ids", "tuned")
    assert fn() == "out"
    assert calls == [(("x", "w13", "w2", "weights", "ids"), {"tiles": "tuned"})]


def test_the_register_cap_switch_sets_the_kernel_module_while_its_rows_run() -> None:
    from benchmarks.quant.quant_switches import with_switch
    from moeserve.kernels.moe.quant import fused_triton

    seen = []

    def bench() -> list[dict]:
        seen.append(fused_triton.max_registers)
        return [{"format": "nvfp4"}, {"format": "bf16"}]

    rows = with_switch("maxnreg", "80", bench)
    assert seen == [80] and fused_triton.max_registers is None  # restored after
    assert rows == [{"format": "nvfp4", "maxnreg": 80}, {"format": "bf16"}]
    assert with_switch("maxnreg", "off", bench)[0]["maxnreg"] is None


def test_a_profilers_run_sets_a_switch_by_tag_and_refuses_unknown_tags(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    from benchmarks.quant.quant_switches import set_switch
    from moeserve.kernels.moe.quant import fp8_gluon

    monkeypatch.setattr(fp8_gluon, "one_dot", False)
    monkeypatch.setattr(fp8_gluon, "gated_block_n", 64)
    assert set_switch("fp8_gluon_dot=one") == "fp8_gluon_dot=one"
    set_switch("fp8_gluon_gated_n=32")
    assert fp8_gluon.one_dot is True and fp8_gluon.gated_block_n == 32
    for bad in ("fp8_gluon_dots=one", "fp8_moe", "=gluon"):
        with pytest.raises(argparse.ArgumentTypeError, match="TAG=VALUE"):
            set_switch(bad)


@pytest.mark.parametrize("value", ["0", "256", "12", "many", "-80"])
def test_a_register_cap_outside_what_ptxas_takes_is_refused(value: str) -> None:
    import argparse

    from benchmarks.quant.kernels_quant import register_cap

    with pytest.raises(argparse.ArgumentTypeError, match="register cap"):
        register_cap(value)
    assert register_cap("off") == "off" and register_cap("96") == "96"


def test_a_row_that_fails_is_recorded_and_the_others_still_run(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from benchmarks.quant import kernels_quant

    def op(fmt, x, *rest):
        def run():  # a launch compiles on its first call, where ptxas may refuse it
            if x.shape[0] == 5:
                raise RuntimeError("PTXAS error: Internal Triton PTX codegen error\n`ptxas` "
                                   "stderr:\nptxas fatal   : (C7602) Insufficient registers "
                                   "(80)\nmore")
            return torch.zeros(x.shape[0], 32)
        return run

    monkeypatch.setattr(kernels_quant, "moe_op", op)
    monkeypatch.setattr(kernels_quant, "moe_ref", lambda *a: None)
    monkeypatch.setattr(kernels_quant, "moe_tiles", lambda *a: {"config": "stub"})
    ctx = {"device": "cpu", "dtype": torch.float32, "timer": lambda fn: 1.0, "tiles": "default",
           **kernels_quant.device_ceilings("cpu")}
    rows = kernels_quant.bench_moe_format("nvfp4", "tiny", (4, 32, 32, 2), [3, 5, 7], ctx)
    assert [r["tokens"] for r in rows] == [3, 5, 7]
    assert rows[1]["error"] == "RuntimeError: ptxas fatal   : (C7602) Insufficient registers (80)"
    assert "error" not in rows[0] and rows[2]["ms"] == 1.0
    monkeypatch.setattr(kernels_quant, "READ_TARGETS", [("nvfp4", 5, 70), ("nvfp4", 7, 70)])
    assert [a["tokens"] for a in kernels_quant.acceptance(rows, None)] == [7]  # 5 not judged


def test_the_bounds_take_the_devices_own_ceilings(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from benchmarks.quant.kernels_quant import device_ceilings

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    assert device_ceilings("cuda") == {"copy_tbps": 3.0, "dense_tflops": 798.0,
                                       "ceilings_of": "H100 80GB HBM3"}
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    assert device_ceilings("cuda")["copy_tbps"] == 4.27
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA A10")
    unknown = device_ceilings("cuda")
    assert unknown["copy_tbps"] == 4.27 and "none measured for NVIDIA A10" in unknown["ceilings_of"]
