"""The doctor's w4a16_linears rule: projections outside the routed experts packed in NVFP4 /
INT4 name --dequantize-linears with the GiB it adds; quiet with it, for the routed experts
alone, for FP8 and on the CPU; the capacity report's text parsed back as the engine writes it."""

from __future__ import annotations

import pytest
import torch

from moeserve.diagnose.doctor import diagnose
from moeserve.diagnose.quant_rules import parse_weights_by_class
from tests.diagnose.synthetic import make_run

PACKED = ("routed experts nvfp4 15.27 GiB, LM head bfloat16 0.58 GiB, embedding bfloat16 "
          "0.58 GiB, attention nvfp4 0.48 GiB, routers bfloat16 12.00 MiB")  # call2's, GiB


def _fired(text: str, **knobs) -> dict:
    run = make_run(capacity_extra={"weights_by_class": text}, **knobs)
    return {v.rule: v for v in diagnose(run)}


def test_packed_projections_name_dequantize_linears_and_its_cost() -> None:
    v = _fired(PACKED, quantization="nvfp4")["w4a16_linears"]
    assert v.severity == "info" and v.settings == {"dequantize_linears": True}
    assert v.evidence["packed_linears"] == [{"class": "attention", "format": "nvfp4",
                                             "gib": 0.48}]
    # 0.48 GiB at 0.5625 bytes a weight -> 2 bytes: 1.71 GiB, 1.23 more (call2: 0.48 -> 1.69)
    assert v.evidence["extra_gib_in_bf16"] == pytest.approx(0.48 * (2 / 0.5625 - 1), abs=0.01)
    assert "--dequantize-linears" in v.knob and "1.23 GiB" in v.knob
    assert "attention (nvfp4, 0.48 GiB)" in v.message
    int4 = _fired("routed experts int4 10.00 GiB, attention int4 1.00 GiB, shared experts "
                  "int4 0.50 GiB")["w4a16_linears"]
    assert [c["class"] for c in int4.evidence["packed_linears"]] == ["attention",
                                                                      "shared experts"]


@pytest.mark.parametrize(("text", "knobs"), [
    (PACKED, {"dequantize_linears": True}),  # already on
    ("routed experts nvfp4 15.27 GiB, attention bfloat16 1.69 GiB", {}),  # experts alone
    ("routed experts fp8 30.00 GiB, attention fp8 1.00 GiB", {}),  # W8A8 on tensor cores
    (PACKED, {"device": "cpu"}),
    ("not a report", {}),  # a foreign server's text: no figures, no verdict
])
def test_quiet_where_nothing_runs_weight_only_outside_the_experts(text: str, knobs: dict
                                                                  ) -> None:
    device = knobs.pop("device", "cuda")
    run = make_run(capacity_extra={"weights_by_class": text}, device=device, **knobs)
    assert "w4a16_linears" not in {v.rule for v in diagnose(run)}


def test_the_engines_own_text_parses_back() -> None:
    from moeserve.quant.packed import QuantWeight
    from moeserve.runner.capacity import weights_by_class

    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([torch.nn.Module()])
    model.layers[0].self_attn = torch.nn.Module()
    model.layers[0].self_attn.o_proj = QuantWeight("nvfp4", 1, 64, 64, scale_dtype=torch.float32,
                                                   device="cpu")
    model.embed_tokens = torch.nn.Embedding(1024, 64)
    text = weights_by_class(model)
    parsed = parse_weights_by_class(text)
    assert {(c, f) for c, f, _ in parsed} == {("attention", "nvfp4"), ("embedding", "float32")}
    assert dict(((c, g) for c, _, g in parsed))["embedding"] == pytest.approx(
        1024 * 64 * 4 / 2**30, abs=1e-5)
    with pytest.raises(ValueError, match="'attention nvfp4 lots' is not"):
        parse_weights_by_class("attention nvfp4 lots")
