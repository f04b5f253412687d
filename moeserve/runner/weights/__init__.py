"""A model's weights into the runner: `loader` (safetensors checkpoints or dummy weights into the
packed parameters), `names` (every family's HF tensor names -> those parameters) and `quant` (a
quantized checkpoint's tensors, kept quantized or dequantized)."""
