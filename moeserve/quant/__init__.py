"""Quantized checkpoint formats (issue 18): what a checkpoint's config says it holds, and each
format's arithmetic as torch references.

    spec.py       the format detected from config.json's quantization_config (or ModelOpt's
                  hf_quant_config.json), checked field by field; refusals name the field
    fp8_block.py  FP8 block-scaled weights (DeepSeek's layout): quantize / dequantize, the
                  run-time activation quantization, the W8A8 linear reference
    nvfp4.py      NVFP4 weights (ModelOpt's layout): e2m1 nibbles, e4m3 group scales and a
                  global scale; quantize / dequantize, the weight-only (W4A16) linear reference
    int4_pack.py  INT4 weights (compressed-tensors' pack-quantized, Kimi K2-Thinking's): eight
                  values an int32, group scales; pack / unpack, the W4A16 linear reference

FP8 block-scaled checkpoints load, dequantized into the engine's dtype as they are copied
(runner/weights/loader.py); the FP8 kernels that keep them in FP8 come next. NVFP4 and INT4
checkpoints are recognised and refused with their format named.
"""
