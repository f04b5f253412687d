"""benchmarks/quant/kernels_quant.py times the engine's quantized MoE dispatcher, so that its
--moe-dequant switch changes what runs (it once timed the fused kernel on both sides); the
register cap switch (--maxnreg)."""

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


@pytest.mark.parametrize("value", ["0", "256", "12", "many", "-80"])
def test_a_register_cap_outside_what_ptxas_takes_is_refused(value: str) -> None:
    import argparse

    from benchmarks.quant.kernels_quant import register_cap

    with pytest.raises(argparse.ArgumentTypeError, match="register cap"):
        register_cap(value)
    assert register_cap("off") == "off" and register_cap("96") == "96"
