"""Where the MLA presets' bf16 fast path departs from the torch reference (GPU only).

For each preset of tests/engine/test_gpu_bf16_agreement.py's MLA_PRESET_LAYERS (sliced at
its real widths, dummy weights, sharpened logits), the agreement of (attention, MoE) backend
pairs against the reference, over all positions and split into prefill and decode positions,
with the five worst rows; and the rounding floor (the reference with only the Triton RMSNorm).

    python -m benchmarks.engine.mla_bf16_breakdown OUT.json        # on the GPU machine
"""

from __future__ import annotations

import gc
import json
import sys

import torch

from tests.engine import test_gpu_bf16_agreement as agree


def breakdown(preset: str) -> dict:
    model = agree.mla_preset_model(preset)
    prompts = agree.random_prompts(model.config.vocab_size, agree.GPU_PROMPT_LENS)
    num_prefill = sum(len(p) for p in prompts)
    agree.set_backends(model, *agree.REFERENCE)
    with agree.torch_norm_and_rope():
        ref, tokens = agree.teacher_forced_logits(model, prompts, agree.GPU_DECODE_STEPS)
    out = {}
    for pair in [("triton", "triton"), ("triton", "torch"), ("torch", "triton"),
                 agree.REFERENCE]:  # the last: the floor (Triton norms only)
        agree.set_backends(model, *pair)
        fast, _ = agree.teacher_forced_logits(model, prompts, agree.GPU_DECODE_STEPS,
                                              feed=tokens)
        bound = agree.RTOL * ref.abs() + agree.ATOL_PER_STD * ref.std()
        worst = ((fast - ref).abs() / bound).max(-1).values.topk(5)
        out["/".join(pair)] = {
            "all": str(agree.compare_logits(fast, ref)),
            "prefill": str(agree.compare_logits(fast[:num_prefill], ref[:num_prefill])),
            "decode": str(agree.compare_logits(fast[num_prefill:], ref[num_prefill:])),
            "worst_rows": worst.indices.tolist(), "worst_vals": worst.values.tolist()}
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return out


def main() -> None:
    result = {preset: breakdown(preset) for preset in agree.MLA_PRESET_LAYERS}
    print(json.dumps(result, indent=1))
    with open(sys.argv[1], "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
