"""The knob space on a machine of several GPUs: the parallel layouts join it."""

from __future__ import annotations

from moeserve.tune.space import knob_space


def test_several_gpus_add_the_parallel_layouts() -> None:
    assert "tensor_parallel_size" not in knob_space("cuda", {}).knobs  # one GPU: no layouts
    space = knob_space("cuda", {}, num_devices=8)
    assert space.knobs["tensor_parallel_size"].choices == (1, 2, 4, 8)
    assert space.knobs["expert_parallel_size"].choices == (None, 2, 4)
    params = space.complete({"tensor_parallel_size": 4, "enable_expert_parallel": True,
                             "expert_parallel_size": 2})
    assert space.flags(params) == ["--tensor-parallel-size", "4", "--enable-expert-parallel",
                                   "--expert-parallel-size", "2"]
    assert space.check(params, {}) is None
    bad = space.complete({"tensor_parallel_size": 2, "enable_expert_parallel": True,
                          "expert_parallel_size": 4})
    assert "expert_parallel_size 4 must divide" in space.check(bad, {})
    # EP off: the EP size does not apply, and is reset to its default
    assert space.complete({"tensor_parallel_size": 2, "expert_parallel_size": 2}
                          )["expert_parallel_size"] is None


def test_dummy_weights_add_the_quantized_format_and_the_kv_dtype() -> None:
    from moeserve.tune.cli import _dummy_weights

    assert "quantization" not in knob_space("cuda", {}).knobs  # a checkpoint's is its own
    space = knob_space("cuda", {}, dummy_weights=True)
    assert space.knobs["quantization"].choices == (None, "fp8", "nvfp4", "int4")
    assert space.flags(space.complete({"quantization": "nvfp4"})) == ["--quantization", "nvfp4"]
    assert space.flags(space.complete({})) == []  # None: the engine's default, no flag
    assert space.check(space.complete({"quantization": "fp8"}), {}) is None
    assert "quantization" not in knob_space("cpu", {}, dummy_weights=True).knobs
    # the KV cache's element type likewise: a study over real weights leaves it to the user
    assert "kv_cache_dtype" not in knob_space("cuda", {}).knobs
    assert space.knobs["kv_cache_dtype"].choices == ("auto", "fp8")
    assert space.flags(space.complete({"kv_cache_dtype": "fp8"})) == ["--kv-cache-dtype", "fp8"]
    assert _dummy_weights("qwen3-30b-a3b", {}) and _dummy_weights("/ckpt", {"load_format": "dummy"})
    assert not _dummy_weights("/ckpt", {}) and not _dummy_weights(
        "qwen3-30b-a3b", {"load_format": "safetensors"})


def test_mixed_graphs_and_the_shared_experts_fold_are_knobs() -> None:
    from moeserve.tune.cli import _shared_experts

    space = knob_space("cuda", {})
    assert space.knobs["mixed_cuda_graphs"].choices == (False, True)
    assert "mixed_cuda_graphs" not in knob_space("cpu", {}).knobs  # CUDA graphs: the GPU's
    eager = space.complete({"enforce_eager": True, "mixed_cuda_graphs": True})
    assert eager["mixed_cuda_graphs"] is False  # no graphs at all: the knob does not apply
    assert "fold_shared_experts" not in space.knobs  # the model has none
    shared = knob_space("cpu", {}, shared_experts=True)
    assert shared.flags(shared.complete({"fold_shared_experts": True})) == [
        "--fold-shared-experts"]
    assert _shared_experts("glm-4.7-flash") and _shared_experts("deepseek-v3")
    assert not _shared_experts("qwen3-30b-a3b") and not _shared_experts("/no/such/folder")


def test_dequantize_linears_is_a_knob_where_the_weights_are_quantized() -> None:
    from moeserve.tune.cli import _quantized_checkpoint

    assert "dequantize_linears" not in knob_space("cuda", {}).knobs
    assert "dequantize_linears" not in knob_space("cpu", {}, dummy_weights=True).knobs
    space = knob_space("cuda", {}, dummy_weights=True)
    assert list(space.knobs).index("quantization") < list(space.knobs).index(
        "dequantize_linears")  # its condition first
    none = space.complete({"quantization": None, "dequantize_linears": True})
    assert none["dequantize_linears"] is False  # unquantized: the knob does not apply
    nvfp4 = space.complete({"quantization": "nvfp4", "dequantize_linears": True})
    assert space.flags(nvfp4) == ["--quantization", "nvfp4", "--dequantize-linears"]
    checkpoint = knob_space("cuda", {}, quantized=True)  # no quantization knob: always applies
    assert checkpoint.flags(checkpoint.complete({"dequantize_linears": True})) == [
        "--dequantize-linears"]
    assert _quantized_checkpoint("qwen3-30b-a3b", {"quantization": "fp8"})
    assert not _quantized_checkpoint("qwen3-30b-a3b", {})
    assert not _quantized_checkpoint("/no/such/folder", {})


def test_the_expert_layout_is_a_knob_where_the_weights_are_quantized() -> None:
    assert "moe_weight_layout" not in knob_space("cuda", {}).knobs
    assert "moe_weight_layout" not in knob_space("cpu", {}, quantized=True).knobs
    space = knob_space("cuda", {}, dummy_weights=True)
    assert space.complete({"quantization": None, "moe_weight_layout": "rows"})[
        "moe_weight_layout"] == "auto"  # unquantized: the knob does not apply
    rows = space.complete({"quantization": "int4", "moe_weight_layout": "rows"})
    assert space.flags(rows) == ["--quantization", "int4", "--moe-weight-layout", "rows"]
