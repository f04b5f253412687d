"""Activation kernels: SwiGLU's silu(gate) * up in one Triton launch (silu_mul_triton.py)."""
