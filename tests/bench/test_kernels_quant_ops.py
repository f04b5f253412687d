"""benchmarks/quant/kernels_quant.py times the engine's quantized MoE dispatcher, so that its
--moe-dequant switch changes what runs (it once timed the fused kernel on both sides)."""

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
