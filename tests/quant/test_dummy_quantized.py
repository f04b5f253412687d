"""`--quantization F --load-format dummy`: random weights made directly in each format's layout
(the presets' way to benchmark quantized with no download), served, and reported."""

from __future__ import annotations

import pytest
import torch

from moeserve import LLM, SamplingParams
from moeserve.config import ConfigError
from moeserve.quant.packed import QuantWeight

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
# tiny-moe's widths are not NVFP4's multiples of 16 everywhere: this slice is
WIDER = {"hidden_size": 128, "moe_intermediate_size": 64, "intermediate_size": 128}


@pytest.mark.parametrize("flag,fmt", [("fp8", "fp8"), ("modelopt_fp4", "nvfp4"),
                                      ("compressed-tensors", "int4")])
def test_dummy_weights_take_the_quantized_layout(flag: str, fmt: str) -> None:
    llm = LLM("tiny-moe", device="cpu", quantization=flag, hf_overrides=WIDER)
    plain = LLM("tiny-moe", device="cpu", hf_overrides=WIDER)
    held = {n: m for n, m in llm.engine.runner.model.named_modules()
            if isinstance(m, QuantWeight)}
    assert {n.rsplit(".", 1)[-1] for n in held} >= {"qkv_proj", "o_proj", "w13", "w2"}
    assert all(m.format == fmt for m in held.values())
    w13 = next(m for n, m in held.items() if n.endswith("w13"))
    dtype = {"fp8": torch.float8_e4m3fn, "nvfp4": torch.uint8, "int4": torch.int32}[fmt]
    assert w13.qweight.dtype == dtype
    deq = w13.dequantize()
    assert torch.isfinite(deq).all() and 0.005 < deq.std() < 0.05  # N(0, 0.02), quantized
    assert llm.engine.runner.weight_bytes < plain.engine.runner.weight_bytes
    report = llm.report.format()
    assert f"dummy weights in {fmt}" in report and f"routed experts {fmt}" in report
    outs = llm.generate([[1, 2, 3, 4], [5, 6]], GREEDY)
    assert all(len(o.token_ids) == GREEDY.max_tokens for o in outs)


def test_nvfp4_needs_its_group_along_every_input_width() -> None:
    with pytest.raises(ConfigError, match=r"model\.layers\.0\.self_attn\.qkv_proj \[\d+, 72\]: "
                                          "NVFP4 needs in_features a multiple of 16"):
        LLM("tiny-moe", device="cpu", quantization="nvfp4",
            hf_overrides={"hidden_size": 72})


def test_fp8_scales_fold_to_the_checkpoints_row_blocks() -> None:
    """Dummy FP8 weights are drawn in 128 x 128 blocks, so their per-row scales fold to one row
    per 128 (compact_fp8_scales); a weight whose rows do not share them keeps its rows."""
    from moeserve.quant.packed import compact_fp8_scales, quantize_into

    llm = LLM("tiny-moe", device="cpu", quantization="fp8", hf_overrides=WIDER)
    blocks = llm.engine.runner.model.moe_blocks()
    w13 = blocks[0].w13
    assert w13.scale_rows == 128 and w13.scale.shape[-2] == -(-w13.shape[-2] // 128)
    w = QuantWeight("fp8", 200, 256, scale_dtype=torch.float32, device="cpu")
    quantize_into(w[:], torch.randn(200, 256))
    before = w.dequantize()
    assert compact_fp8_scales(w) and w.scale.shape == (2, 2)
    assert torch.equal(w.dequantize(), before)
    rows = QuantWeight("fp8", 200, 256, scale_dtype=torch.float32, device="cpu")
    quantize_into(rows[:100], torch.randn(100, 256))  # a fused part ending off the blocks
    quantize_into(rows[100:], torch.randn(100, 256) * 3)
    assert not compact_fp8_scales(rows) and rows.scale_rows == 1


def test_dequantize_linears_draws_only_the_routed_experts_quantized() -> None:
    llm = LLM("tiny-moe", device="cpu", quantization="nvfp4", hf_overrides=WIDER,
              dequantize_linears=True)
    held = {n for n, m in llm.engine.runner.model.named_modules() if isinstance(m, QuantWeight)}
    assert held and {n.rsplit(".", 1)[-1] for n in held} == {"w13", "w2"}
    report = llm.report.format()
    assert "routed experts only (--dequantize-linears)" in report
    assert "routed experts nvfp4" in report and "attention float32" in report
    outs = llm.generate([[1, 2, 3, 4], [5, 6]], GREEDY)
    assert all(len(o.token_ids) == GREEDY.max_tokens for o in outs)
    plain = LLM("tiny-moe", device="cpu", hf_overrides=WIDER, dequantize_linears=True)
    assert not any(isinstance(m, QuantWeight) for m in plain.engine.runner.model.modules())


def test_the_expert_layout_is_reported_and_micro_tiles_need_cuda() -> None:
    llm = LLM("tiny-moe", device="cpu", quantization="nvfp4", hf_overrides=WIDER)
    assert llm.report.expert_layout.startswith("nvfp4 experts in rows: the fused MoE reads "
                                               "micro-tiles on CUDA only")
    assert "expert layout" in llm.report.format()
    with pytest.raises(ConfigError, match="moe_weight_layout micro: the fused MoE reads "
                                          "micro-tiles on CUDA only"):
        LLM("tiny-moe", device="cpu", quantization="nvfp4", hf_overrides=WIDER,
            moe_weight_layout="micro")
    with pytest.raises(ConfigError, match="moe_weight_layout must be one of auto, rows, micro"):
        LLM("tiny-moe", device="cpu", moe_weight_layout="tiles")
    assert LLM("tiny-moe", device="cpu", hf_overrides=WIDER).report.expert_layout == ""


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "int4"])
def test_gpu_micro_tiled_experts_serve_the_row_layouts_tokens(
        fmt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA "auto" micro-tiles the 4-bit experts (widths of 128) and the served tokens are
    the row layout's: both launches read the same bits, and the long prompt's step (past the
    dequantize-first path's threshold, lowered here) reads them back to rows."""
    import gc

    from moeserve.kernels.moe.quant import dequant

    monkeypatch.setitem(dequant.DEQUANT_MIN_TOKENS, fmt, 256)
    wide = WIDER | {"moe_intermediate_size": 128}
    prompts = [list(range(1, 9)), list(range(3, 400))]
    outs = {}
    for layout in ("rows", "auto"):
        llm = LLM("tiny-moe", device="cuda", dtype="bfloat16", quantization=fmt,
                  hf_overrides=wide, moe_weight_layout=layout, mem_fraction=0.1)
        w13 = llm.engine.runner.model.moe_blocks()[0].w13
        assert w13.micro_tiled == (layout == "auto")
        assert ("micro-tiled" in llm.report.expert_layout) == (layout == "auto")
        outs[layout] = [o.token_ids for o in llm.generate(prompts, GREEDY)]
        del llm
        gc.collect()
    assert outs["auto"] == outs["rows"]
