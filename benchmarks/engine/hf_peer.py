"""The naive peer: transformers' own `generate()` on a preset's shape, random bf16 weights.

W1-shaped batch on one device: B prompts of 128 random token ids, exactly 128 new tokens each
(greedy, EOS ignored: min_new_tokens = max_new_tokens), all in one `generate` call with
transformers' defaults (its default experts and attention implementations, DynamicCache), timed
after a warm-up call at the same batch. Output throughput = B * output_len / seconds. Weights
follow moeserve's dummy-weight recipe (runner/weights/loader.init_dummy_weights), so routing
spreads as it does in the engine's runs. Writes hf_peer_<preset>_b<B>.json to --out.

    python -m benchmarks.engine.hf_peer --preset qwen3-30b-a3b --batch 256 --out DIR
    python -m benchmarks.engine.hf_peer --preset tiny-moe --batch 2 --output-len 4 \
        --device cpu --out X
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, LogitsProcessor, PreTrainedModel

from benchmarks.engine.w1_offline import environment
from moeserve.presets import load_preset


def build_hf_model(preset: str, device: str, dtype: torch.dtype, seed: int = 0,
                   ) -> PreTrainedModel:
    """transformers' model of the preset's config, created on `device` without HF's init, then
    filled in place as moeserve's dummy weights: embeddings N(0, 1), norms 1, routers
    N(0, hidden^-0.5), residual writes (o_proj, down_proj) N(0, 0.002), the rest N(0, 0.02)."""
    hf = {k: v for k, v in load_preset(preset).items()
          if not k.startswith("moeserve_") and k not in ("architectures", "torch_dtype")}
    config = AutoConfig.for_model(hf.pop("model_type"), **hf)
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # an older layout: HF's init then runs (slower, same result)
        no_init_weights = contextlib.nullcontext
    with torch.device(device), no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
                continue
            if name.endswith("embed_tokens.weight"):
                std = 1.0
            elif name.endswith("mlp.gate.weight"):  # router [E, hidden]
                std = param.shape[-1] ** -0.5
            elif name.endswith(("o_proj.weight", "down_proj", "down_proj.weight")):
                std = 0.002
            else:
                std = 0.02
            param.normal_(0.0, std, generator=gen)
    return model.eval()


class Progress(LogitsProcessor):
    """Prints the decode step every `every` steps (host time only; returns scores unchanged)."""

    def __init__(self, every: int, start: float) -> None:
        self.every, self.start, self.step = every, start, 0

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.step += 1
        if self.step % self.every == 0:
            print(f"  step {self.step}: {time.perf_counter() - self.start:.1f} s", flush=True)
        return scores


def run(preset: str, batch: int, input_len: int, output_len: int, device: str,
        dtype: torch.dtype) -> dict:
    start = time.perf_counter()
    model = build_hf_model(preset, device, dtype)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    build_s = time.perf_counter() - start
    print(f"built {preset} in {build_s:.1f} s", flush=True)
    gen = torch.Generator().manual_seed(batch)
    input_ids = torch.randint(model.config.vocab_size, (batch, input_len), generator=gen)
    input_ids = input_ids.to(device)  # [B, input_len]
    kwargs = {"do_sample": False, "eos_token_id": None, "pad_token_id": 0, "use_cache": True}

    def generate(new_tokens: int, processors: list | None = None) -> torch.Tensor:
        with torch.inference_mode():
            return model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                                  max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                  logits_processor=processors, **kwargs)

    generate(min(4, output_len))  # warm-up: kernels, allocator, the same batch shape
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    print(f"warm-up done; timing {batch} x {output_len} new tokens", flush=True)
    start = time.perf_counter()
    out = generate(output_len, [Progress(max(1, output_len // 8), start)])
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    assert out.shape == (batch, input_len + output_len), out.shape
    return {
        "workload": (f"transformers generate(): {batch} prompts of {input_len} random token "
                     f"ids, exactly {output_len} new tokens each (greedy, EOS ignored), one "
                     "call, random bf16 weights, after a warm-up call"),
        "preset": preset, "batch": batch, "input_len": input_len, "output_len": output_len,
        "seconds": seconds, "output_throughput": batch * output_len / seconds,
        "build_seconds": build_s, "dtype": str(dtype).removeprefix("torch."),
        "generate_kwargs": {**kwargs, "max_new_tokens": output_len,
                            "min_new_tokens": output_len, "attention_mask": "all ones"},
        "attn_implementation": model.config._attn_implementation,
        "experts_implementation": getattr(model.config, "_experts_implementation", None),
        "transformers": transformers.__version__,
        "environment": environment(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen3-30b-a3b")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    result = run(args.preset, args.batch, args.input_len, args.output_len, args.device,
                 getattr(torch, args.dtype))
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"hf_peer_{args.preset}_b{args.batch}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps({k: result[k] for k in ("batch", "seconds", "output_throughput",
                                              "experts_implementation")}), flush=True)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
