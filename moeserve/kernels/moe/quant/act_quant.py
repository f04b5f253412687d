"""fp8's activation quantization in the fused MoE's gated launch (fused_triton.py): act's
e4m3 bytes and per-row, per-128-group scales written by launch 1's epilogue, so no bf16 act
is written and read back and no quantize launch runs between the GEMMs. `enabled` (the
switch), `fuses` (where it applies), `ACT_ROUND` (the epilogue's rounding of act to x's dtype
first) and `quant_store`, the epilogue's Triton helper (jitted by fused_triton._kernel).

The arithmetic is quantize_activations_triton's (act rounded to x's dtype, amax / 448 with a
floor, IEEE division, clamp), so the bytes equal the separate launch's (a GPU test compares
them). Only up to MAX_BLOCK_M rows a block: on an H100 (benchmarks/results/gpu_9d50325/call1,
qwen3-30b-a3b's experts) the 16-row tiles of 64 / 256 tokens gain 2.4 / 2.9% (0.229 / 0.255
ms against 0.235 / 0.263), while the 64-row, 8-warp tile's epilogue (its group reduction)
costs more than the launch it saves (1,024 tokens 0.338 against 0.332, 8,192 1.438 against
1.386: the gated launch 774 against 661 us).
"""

from __future__ import annotations

from typing import Any

import torch

from moeserve.quant.packed import FP8_GROUP

enabled = True  # the switch (kernels_quant --fp8-act-quant fused apart)
MAX_BLOCK_M = 32
# the epilogue's rounding of act to x's dtype before it is quantized (the ACT_ROUND constexpr)
ACT_ROUND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
tl: Any = None  # triton.language, bound by fused_triton._kernel() before it jits quant_store


def fuses(fmt: str, device: torch.device, inter: int, config: dict[str, int]) -> bool:
    """Whether the gated launch may quantize act in its epilogue: fp8 on CUDA (the
    interpreter's e4m3 cast is wrong), `enabled`, row blocks of at most MAX_BLOCK_M, and
    each tile's columns whole 128-groups (BLOCK_N and I multiples of 128). fused_triton also
    needs its own kernel to run the launch."""
    return (fmt == "fp8" and enabled and device.type == "cuda"
            and config["BLOCK_M"] <= MAX_BLOCK_M and config["BLOCK_N"] % FP8_GROUP == 0
            and inter % FP8_GROUP == 0)


# ---- Triton helper (jitted by fused_triton._kernel; `tl` bound there first) ----

def quant_store(act, c_ptrs, s_rows, row_ok, pid_n, N, ACT_ROUND: tl.constexpr,
                 FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr, ROWS: tl.constexpr,
                 BLOCK_N: tl.constexpr):
    """fp8's run-time quantization of act [ROWS, BLOCK_N] (fp32), whole 128-column groups,
    as quantize_activations_triton does it (act rounded to x's dtype first: ACT_ROUND 1 bf16,
    2 fp16, 0 none): each row's group scale max(amax / FP8_MAX, MIN_SCALE) to s_rows + its
    group, the values divided by it (IEEE division, that kernel's NOTE), clamped, as e4m3 to
    c_ptrs."""
    if ACT_ROUND == 1:
        act = act.to(tl.bfloat16).to(tl.float32)
    elif ACT_ROUND == 2:
        act = act.to(tl.float16).to(tl.float32)
    G: tl.constexpr = BLOCK_N // 128
    groups = tl.reshape(act, (ROWS, G, 128))
    scale = tl.maximum(tl.max(tl.abs(groups), 2) / FP8_MAX, MIN_SCALE)  # [ROWS, G]
    q = tl.minimum(tl.maximum(tl.math.div_rn(groups, scale[:, :, None]), -FP8_MAX), FP8_MAX)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(c_ptrs, tl.reshape(q, (ROWS, BLOCK_N)).to(c_ptrs.dtype.element_ty),
             mask=row_ok[:, None] & (cols < N)[None, :])
    g = pid_n * G + tl.arange(0, G)
    tl.store(s_rows[:, None] + g[None, :], scale, mask=row_ok[:, None] & (g * 128 < N)[None, :])
