"""Quantized checkpoints in their real layouts, loaded and served.

The checkpoints are tiny random models written by transformers (qwen3_moe at widths of 320 and
192: two full 128-blocks and a partial one, or one and a half; deepseek_v3 with MLA, shared
experts and a dense first layer), then every projection, expert and shared-expert weight is
quantized as the published releases hold it, some modules left unquantized by the format's own
list: FP8 block-scaled (e4m3 `weight` + fp32 `weight_scale_inv` per 128 x 128 block,
`quantization_config` in config.json), ModelOpt NVFP4 (declared in hf_quant_config.json only),
compressed-tensors INT4 (its own compressor writes the tensors). The reference is transformers
on the dequantized weights, computed independently of moeserve's code (block by block, e2m1 by
its formula, compressed-tensors' decompressor): in fp32, moeserve's greedy output must equal it
token for token.

moeserve holds these weights quantized in memory (quant/packed.py) and runs them through the
formats' arithmetic: NVFP4 and INT4 weight-only, so equal to the dequantized model; FP8 W8A8,
so equal to transformers with the same run-time activation quantization patched in. On CPU the
kernels' torch references run (layers/linear.py, kernels/moe/quant/ref.py); the Triton kernels
have their own tests. This also pins the loader: names, per-expert slices, the kept modules, the
checks.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from moeserve import LLM, SamplingParams
from moeserve.quant import int4_pack, nvfp4
from moeserve.quant.fp8_block import quantize_blockwise
from moeserve.quant.packed import QuantWeight
from moeserve.runner.weights.loader import WeightLoadError
from tests.engine.test_generate_vs_hf import _prompts, hf_generate, hf_greedy
from tests.models.checkpoints import write_tiny_checkpoint

FP8_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
              "weight_block_size": [128, 128]}
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
WIDE = {"qwen3_moe": {"hidden_size": 320, "intermediate_size": 320, "moe_intermediate_size": 192,
                      "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 80},
        "deepseek_v3": {"hidden_size": 320, "intermediate_size": 320,
                        "moe_intermediate_size": 192,
                        "q_lora_rank": 64}}  # in_features: NVFP4 16s, compressed-tensors 32s
KEPT = {"qwen3_moe": ["model.layers.0.self_attn.o_proj"],
        "deepseek_v3": ["model.layers.1.mlp.shared_experts"]}


def _quantizable(name: str, shape: tuple[int, ...], kept: list[str]) -> bool:
    if len(shape) != 2 or not name.endswith(".weight"):
        return False
    if any(name.startswith(k + ".") for k in kept):
        return False
    skip = ("embed_tokens", "lm_head", "norm", "mlp.gate.weight")  # the router stays
    return not any(s in name for s in skip)


def _dequantized_by_blocks(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    out = q.float()
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            out[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] *= float(scale[i, j])
    return out


def _fp8(name: str, w: torch.Tensor) -> tuple[dict, torch.Tensor]:
    q, s = quantize_blockwise(w)
    return {name: q, name + "_scale_inv": s}, _dequantized_by_blocks(q, s)


def _nvfp4(name: str, w: torch.Tensor) -> tuple[dict, torch.Tensor]:
    """ModelOpt's tensors; the reference decodes the nibbles by e2m1's formula, vectorised."""
    packed, scale, scale_2 = nvfp4.quantize(w)
    nib = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2).long()  # low first
    exp, man = (nib >> 1) & 3, (nib & 1).float()
    mag = torch.where(exp == 0, 0.5 * man, 2.0 ** (exp - 1).float() * (1 + man / 2))
    values = torch.where(nib >= 8, -mag, mag)
    ref = values * scale.float().repeat_interleave(16, 1) * scale_2
    base = name[:-len(".weight")]
    return {name: packed, base + ".weight_scale": scale, base + ".weight_scale_2": scale_2,
            base + ".input_scale": torch.tensor(1.0)}, ref


def _int4(name: str, w: torch.Tensor) -> tuple[dict, torch.Tensor]:
    """compressed-tensors' own compressor writes the tensors; its decompressor the reference
    (fp32 scales, so the product is exact there as here)."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    _, scale = int4_pack.quantize(w, 32)
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=4, type="int", symmetric=True, strategy="group", group_size=32))
    made = PackedQuantizationCompressor.compress({"weight": w, "weight_scale": scale}, scheme)
    ref = PackedQuantizationCompressor.decompress(dict(made), scheme)["weight"].float()
    base = name[:-len(".weight")]
    return {base + "." + k: v for k, v in made.items()}, ref


QUANTIZE = {"fp8": _fp8, "nvfp4": _nvfp4, "int4": _int4}
INT4_CONFIG = {"quant_method": "compressed-tensors", "format": "pack-quantized",
               "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                   "num_bits": 4, "type": "int", "symmetric": True, "group_size": 32,
                   "strategy": "group", "dynamic": False}}}}


def write_quantized_pair(arch: str, root: str, fmt: str = "fp8", kept: list[str] | None = None,
                         **overrides) -> tuple[str, str, int]:
    """(the quantized checkpoint in `fmt`'s layout, the reference with its dequantized weights,
    tensors quantized); kept: the modules left unquantized (default KEPT[arch]); overrides:
    config fields over WIDE's. The unquantized source is beside them, in root/src."""
    kept = KEPT[arch] if kept is None else kept
    src = write_tiny_checkpoint(arch, os.path.join(root, "src"), **(WIDE[arch] | overrides))
    quant, ref = os.path.join(root, fmt), os.path.join(root, "ref")
    for out in (quant, ref):
        shutil.copytree(src, out)
    files = [f for f in os.listdir(src) if f.endswith(".safetensors")]
    count = 0
    for fname in files:
        q_tensors, ref_tensors = {}, {}
        with safe_open(os.path.join(src, fname), framework="pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                if _quantizable(name, tuple(t.shape), kept):
                    made, ref_tensors[name] = QUANTIZE[fmt](name, t)
                    q_tensors |= made
                    count += 1
                else:
                    q_tensors[name] = ref_tensors[name] = t
        save_file(q_tensors, os.path.join(quant, fname), metadata={"format": "pt"})
        save_file(ref_tensors, os.path.join(ref, fname), metadata={"format": "pt"})
    path = os.path.join(quant, "config.json")
    with open(path) as f:
        config = json.load(f)
    if fmt == "fp8":
        config["quantization_config"] = {**FP8_CONFIG, "modules_to_not_convert": kept}
    elif fmt == "int4":
        config["quantization_config"] = {**INT4_CONFIG, "ignore": kept}
    else:  # ModelOpt: declared only in hf_quant_config.json
        with open(os.path.join(quant, "hf_quant_config.json"), "w") as f:
            json.dump({"producer": {"name": "modelopt"}, "quantization": {
                "quant_algo": "NVFP4", "group_size": 16, "exclude_modules": kept}}, f)
    with open(path, "w") as f:
        json.dump(config, f)
    return quant, ref, count


@pytest.fixture(scope="module", params=["qwen3_moe", "deepseek_v3"])
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple:
    folder = str(tmp_path_factory.mktemp(request.param))
    fp8, ref, count = write_quantized_pair(request.param, folder)
    prompts = _prompts(256, (5, 17, 9))
    return fp8, ref, count, prompts, hf_greedy(ref, prompts, GREEDY.max_tokens)


@contextlib.contextmanager
def _w8a8_activations(model: torch.nn.Module, quantized: set[str]):
    """Run the transformers model's FP8-held projections as W8A8: while it is on, every
    F.linear whose weight is one of them (by address: the 2-D weights named in `quantized`,
    every expert of the fused 3-D expert tensors) sees its input quantized per token and
    128-group and dequantized again (quantize_activations, the rule moeserve's kernels use);
    the weight itself is the checkpoint's dequantized one. MLA's kv_b_proj is left out:
    moeserve holds it dequantized (its absorbed views)."""
    from moeserve.quant.fp8_block import quantize_activations

    ptrs = set()
    for name, p in model.named_parameters():
        if p.dim() == 3 and ".mlp.experts." in name:
            ptrs.update(p[e].data_ptr() for e in range(p.shape[0]))
        elif name in quantized and "kv_b_proj" not in name:
            ptrs.add(p.data_ptr())
    linear = torch.nn.functional.linear

    def w8a8(x, weight, bias=None):
        if weight.dim() == 2 and weight.data_ptr() in ptrs:
            rows = x.reshape(-1, x.shape[-1])
            q, scale = quantize_activations(rows)
            x = (q.float() * scale.repeat_interleave(128, 1)[:, :rows.shape[1]]).reshape(
                x.shape).to(x.dtype)
        return linear(x, weight, bias)

    torch.nn.functional.linear = w8a8
    try:
        yield
    finally:
        torch.nn.functional.linear = linear


def hf_greedy_w8a8(ref: str, fp8: str, prompts: list[list[int]], new_tokens: int
                   ) -> list[list[int]]:
    """transformers' greedy tokens on the dequantized weights with W8A8 activations."""
    from transformers import AutoModelForCausalLM

    from tests.models.checkpoints import hf_config_as_published

    quantized = set()
    for fname in (f for f in os.listdir(fp8) if f.endswith(".safetensors")):
        with safe_open(os.path.join(fp8, fname), framework="pt") as f:
            quantized |= {n[:-len("_scale_inv")] for n in f.keys() if n.endswith("_scale_inv")}
    model = AutoModelForCausalLM.from_pretrained(ref, config=hf_config_as_published(ref),
                                                 dtype=torch.float32).eval()
    model.config._experts_implementation = "eager"  # the expert loop, through F.linear
    with _w8a8_activations(model, quantized):
        return hf_generate(model, prompts, new_tokens)


def _top1_agreement(llm: LLM, ref: str, prompts: list[list[int]]) -> float:
    """The share of prompt positions where moeserve's next token (greedy, after each prefix)
    is the dequantized model's top-1 (transformers, fp32, no activation quantization)."""
    from transformers import AutoModelForCausalLM

    from tests.models.checkpoints import hf_config_as_published

    prefixes = [p[:i] for p in prompts for i in range(1, len(p) + 1)]
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    got = [r.token_ids[0] for r in llm.generate(prefixes, one)]
    model = AutoModelForCausalLM.from_pretrained(ref, config=hf_config_as_published(ref),
                                                 dtype=torch.float32).eval()
    with torch.no_grad():
        want = [t for p in prompts for t in model(torch.tensor([p])).logits[0].argmax(-1).tolist()]
    return sum(g == w for g, w in zip(got, want, strict=True)) / len(want)


# W8A8 against the W8A16 arithmetic of the dequantized model, per prompt position (31 of
# them): measured 0.81 (qwen3_moe) and 0.74 (deepseek_v3), against 1/256 by chance. These tiny
# random models' logits are nearly flat (256 tokens, random weights), so an activation error of a
# few percent moves the top-1 often; the exact check is the W8A8 reference's, above
TOP1_AGREEMENT = 0.6


def test_fp8_checkpoint_runs_w8a8_as_its_reference(pair: tuple) -> None:
    """FP8 weights stay e4m3 in memory and run W8A8 (activations quantized per token and
    128-group): greedy tokens equal transformers on the dequantized weights with the same
    activation quantization, token for token in fp32; top-1 agreement with the dequantized
    model without it is at least TOP1_AGREEMENT over the prompts' positions."""
    fp8, ref, count, prompts, expected = pair
    assert count >= 8
    llm = LLM(fp8, device="cpu", dtype="float32")
    got = [r.token_ids for r in llm.generate(prompts, GREEDY)]
    assert got == hf_greedy_w8a8(ref, fp8, prompts, GREEDY.max_tokens)
    assert _top1_agreement(llm, ref, prompts) >= TOP1_AGREEMENT
    report = llm.report.format()
    assert "fp8 block-scaled W8A8" in report and "checkpoint weights kept quantized" in report
    assert "routed experts fp8" in report and "embedding float32" in report
    held = [n for n, m in llm.engine.runner.model.named_modules() if isinstance(m, QuantWeight)]
    assert any(n.endswith(".mlp.w13") for n in held)
    arch = {"Qwen3MoeForCausalLM": "qwen3_moe", "DeepseekV3ForCausalLM": "deepseek_v3"}[
        llm.engine.model_config.architecture]
    kept = KEPT[arch]
    assert not any(n.startswith(k) for n in held for k in kept)  # left in the engine's dtype


def _rewrite(folder: str, edit) -> None:
    for fname in [f for f in os.listdir(folder) if f.endswith(".safetensors")]:
        path = os.path.join(folder, fname)
        with safe_open(path, framework="pt") as f:
            tensors = {n: f.get_tensor(n) for n in f.keys()}
        edit(tensors)
        save_file(tensors, path, metadata={"format": "pt"})


def test_bad_fp8_tensors_are_named(tmp_path: str) -> None:
    fp8, _, _ = write_quantized_pair("qwen3_moe", str(tmp_path))
    name = "model.layers.0.self_attn.k_proj.weight"  # [160, 320]: scales [2, 3]

    def transpose_scale(t: dict) -> None:
        t[name + "_scale_inv"] = t[name + "_scale_inv"].t().contiguous()

    _rewrite(fp8, transpose_scale)
    with pytest.raises(WeightLoadError, match=rf"{name}_scale_inv: shape \(3, 2\) does not "
                                              rf"match {name}'s \(160, 320\) in 128x128 "
                                              rf"blocks \(expected \(2, 3\)\)"):
        LLM(fp8, device="cpu", dtype="float32")

    def drop_scale(t: dict) -> None:
        del t[name + "_scale_inv"]

    _rewrite(fp8, drop_scale)
    with pytest.raises(WeightLoadError, match=rf"tensor {name} is float8_e4m3fn .* has no "
                                              rf"{name}_scale_inv"):
        LLM(fp8, device="cpu", dtype="float32")


def test_fp8_tensors_without_the_config_are_refused(tmp_path: str) -> None:
    fp8, _, _ = write_quantized_pair("qwen3_moe", str(tmp_path))
    path = os.path.join(fp8, "config.json")
    with open(path) as f:
        config = json.load(f)
    del config["quantization_config"]
    with open(path, "w") as f:
        json.dump(config, f)
    with pytest.raises(WeightLoadError, match=r"holds quantized tensors \(.*weight_scale_inv, "
                                              r"\d+ in all\) but its config declares no "
                                              "quantization_config"):
        LLM(fp8, device="cpu", dtype="float32")


def test_the_quantization_flag_is_checked_against_the_checkpoint(pair: tuple) -> None:
    from moeserve.config import ConfigError

    fp8, ref, _, prompts, expected = pair
    llm = LLM(fp8, device="cpu", dtype="float32", quantization="fp8")
    assert len(llm.generate(prompts[:1], GREEDY)[0].token_ids) == GREEDY.max_tokens
    assert llm.engine.model_config.quantization.format == "fp8"
    with pytest.raises(ConfigError, match="--quantization nvfp4 contradicts the checkpoint, "
                                          "which holds fp8 weights"):
        LLM(fp8, device="cpu", quantization="modelopt_fp4")
    with pytest.raises(ConfigError, match="--quantization 'awq' is not a format"):
        LLM(fp8, device="cpu", quantization="awq")


def test_an_fp8_config_over_unquantized_tensors_is_reported(pair: tuple) -> None:
    _, ref, _, prompts, expected = pair
    path = os.path.join(ref, "config.json")
    with open(path) as f:
        config = json.load(f)
    with open(path, "w") as f:
        json.dump(config | {"quantization_config": FP8_CONFIG}, f)
    try:
        llm = LLM(ref, device="cpu", dtype="float32")
        assert [r.token_ids for r in llm.generate(prompts, GREEDY)] == expected
        assert "declares fp8 but the checkpoint holds no quantized tensors" in (
            llm.report.format())
    finally:
        with open(path, "w") as f:
            json.dump(config, f)


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
@pytest.mark.parametrize("fmt", ["nvfp4", "int4"])
def test_nvfp4_and_int4_checkpoints_match_transformers_on_their_dequantized_weights(
        tmp_path: str, fmt: str, arch: str) -> None:
    """ModelOpt's NVFP4 (declared in hf_quant_config.json only) and compressed-tensors' INT4
    (written by its own compressor), held packed in memory and run weight-only (W4A16): exact
    dequantization, so greedy tokens equal transformers on the dequantized weights in fp32."""
    quant, ref, count = write_quantized_pair(arch, str(tmp_path), fmt)
    prompts = _prompts(256, (5, 17, 9))
    expected = hf_greedy(ref, prompts, GREEDY.max_tokens)
    llm = LLM(quant, device="cpu", dtype="float32")
    assert [r.token_ids for r in llm.generate(prompts, GREEDY)] == expected
    report = llm.report.format()
    assert "checkpoint weights kept quantized" in report and f"routed experts {fmt}" in report
    assert llm.engine.model_config.quantization.format == fmt
    held = {n: m for n, m in llm.engine.runner.model.named_modules()
            if isinstance(m, QuantWeight)}
    assert held and all(m.format == fmt for m in held.values())
    assert not any(n.startswith(k) for n in held for k in KEPT[arch])
    assert not any("kv_b_proj" in n for n in held)  # MLA's absorbed views stay dequantized


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4", "int4"])
def test_an_unquantized_checkpoint_is_quantized_as_it_loads(tmp_path: str, fmt: str) -> None:
    """`--quantization F` on the unquantized checkpoint quantizes each projection tensor by the
    format's rule as it loads (vLLM's online quantization): the same tokens as the checkpoint
    quantized offline by that rule with nothing kept (FP8 in 128 x 128 blocks per tensor, INT4
    by compressed-tensors' compressor on the same scales), and the same weights held."""
    quant, _, _ = write_quantized_pair("qwen3_moe", str(tmp_path), fmt, kept=[])
    src = os.path.join(str(tmp_path), "src")
    prompts = _prompts(256, (5, 17, 9))
    offline = LLM(quant, device="cpu", dtype="float32")
    online = LLM(src, device="cpu", dtype="float32", quantization=fmt)
    assert ([r.token_ids for r in online.generate(prompts, GREEDY)]
            == [r.token_ids for r in offline.generate(prompts, GREEDY)])
    assert "quantized as they loaded" in online.report.format()
    got = dict(online.engine.runner.model.named_modules())
    for name, m in offline.engine.runner.model.named_modules():
        if isinstance(m, QuantWeight):
            assert isinstance(got[name], QuantWeight) and torch.equal(
                got[name].dequantize(), m.dequantize()), name


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "int4"])
def test_gpu_4bit_many_token_paths_match_transformers(tmp_path: str, fmt: str,
                                                      monkeypatch: pytest.MonkeyPatch,
                                                      no_tf32: None) -> None:
    """The 4-bit formats' many-token paths forced at every step (the linears dequantized
    once, then cuBLAS; the experts dequantized, then the fused MoE): in fp32 the same greedy
    tokens as transformers on the dequantized weights, and each path ran."""
    from moeserve.kernels.linear import w4a16_dequant
    from moeserve.kernels.moe.quant import dequant

    calls = {"linear": 0, "moe": 0}
    for module, name, key in ((w4a16_dequant, "w4a16_linear_dequant", "linear"),
                              (dequant, "moe_dequant", "moe")):
        real = getattr(module, name)

        def counted(*a, _real=real, _key=key, **kw):
            calls[_key] += 1
            return _real(*a, **kw)
        monkeypatch.setattr(module, name, counted)
    monkeypatch.setattr(w4a16_dequant, "backend", "dequant")
    monkeypatch.setattr(dequant, "mode", "on")
    quant, ref, _ = write_quantized_pair("qwen3_moe", str(tmp_path), fmt)
    prompts = _prompts(256, (5, 17, 9))
    expected = hf_greedy(ref, prompts, GREEDY.max_tokens)
    # default tiles: a start-up tune of this tiny shape's quantized MoE would take minutes; the
    # heads (head_dim 80) go to the torch attention, which "auto" picks for them
    llm = LLM(quant, device="cuda", dtype="float32", mem_fraction=0.1, moe_tiles="default")
    assert llm.engine.cfg.attention_backend == "torch"
    assert [r.token_ids for r in llm.generate(prompts, GREEDY)] == expected
    assert calls["linear"] > 0 and calls["moe"] > 0


@pytest.mark.parametrize("fmt", ["nvfp4", "int4"])
def test_dequantize_linears_keeps_only_the_routed_experts_quantized(tmp_path: str,
                                                                     fmt: str) -> None:
    """--dequantize-linears: the attention and shared-expert projections of an NVFP4 / INT4
    checkpoint dequantized as they load (exact), the routed experts held packed: the same
    greedy tokens as transformers on the dequantized weights, more weight bytes, the report
    naming each class's format."""
    quant, ref, _ = write_quantized_pair("deepseek_v3", str(tmp_path), fmt)
    prompts = _prompts(256, (5, 17, 9))
    expected = hf_greedy(ref, prompts, GREEDY.max_tokens)
    packed = LLM(quant, device="cpu", dtype="float32")
    llm = LLM(quant, device="cpu", dtype="float32", dequantize_linears=True)
    assert [r.token_ids for r in llm.generate(prompts, GREEDY)] == expected
    held = {n for n, m in llm.engine.runner.model.named_modules() if isinstance(m, QuantWeight)}
    assert held and all(n.endswith((".mlp.w13", ".mlp.w2")) for n in held)
    was = {n for n, m in packed.engine.runner.model.named_modules() if isinstance(m, QuantWeight)}
    assert held < was and any("self_attn" in n for n in was - held)
    assert llm.engine.runner.weight_bytes > packed.engine.runner.weight_bytes
    report = llm.report.format()
    assert "for the routed experts only (--dequantize-linears)" in report
    assert f"routed experts {fmt}" in report and "attention float32" in report
