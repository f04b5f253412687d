"""The roofline of a long-prompt benchmark run with the KV cache it has: an idealised engine
replayed step by step, each step at its parts' bounds.

Issue 14's long-prompt run (8,192 prompt tokens, 256 out, 128 requests at concurrency 128 on
qwen3-30b-a3b) is bound by more than the GPU: the KV cache holds 667,360 tokens, so at most
floor(667,360 / 8,448) = 78 requests run at once, and each holds its slot for 256 decode steps.
This replays the run with an engine that is ideal everywhere else:

- every request arrives at once; a request is admitted while the cache can hold its prompt and
  all its output (so none is ever preempted), first come first served;
- a step carries every running decode and, within the token budget (max_num_batched_tokens,
  which counts the decodes), the prompt chunks of admitted requests in order;
- a step takes the sum of its parts' roofline times (diagnose/roofline.py's StepCost: the
  routed experts, the dense weights, attention over each row's own context), each part at
  max(bytes / bandwidth, FLOPs / peak) on the device's measured ceilings; kernels run one after
  another, so parts do not overlap.

It reports the run's duration and input throughput at the bound, with the KV capacity given
and with room for every request (what the cache costs), so a measured run can be set beside
the bound that its configuration allows.

    python -m benchmarks.engine.long_prompt_bound --kv-tokens 667360 --out DIR
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from dataclasses import dataclass

from moeserve.config import load_model_config
from moeserve.diagnose.roofline import CEILINGS, Ceilings, step_cost
from moeserve.model_config import ModelConfig


@dataclass(frozen=True)
class Workload:
    num_prompts: int = 128
    input_len: int = 8192
    output_len: int = 256
    max_concurrency: int = 128
    token_budget: int = 8192  # max_num_batched_tokens


def step_seconds(model: ModelConfig, dtype_bytes: int, decode_contexts: list[int],
                 chunks: list[tuple[int, int]], ceilings: Ceilings) -> float:
    """One step's time at its parts' bounds: decodes at their contexts (keys before the new
    token) and prompt chunks (start, length), causal within the chunk."""
    tokens = len(decode_contexts) + sum(n for _, n in chunks)
    weights = step_cost(model, dtype_bytes, tokens, rows=len(decode_contexts) + len(chunks),
                        batch=0, context=0)
    kv_bytes = attention_flops = 0.0
    if decode_contexts:  # one query each over ctx + 1 keys; the cost is linear in the context,
        # so the decodes at their mean context cost what they do one by one
        n = len(decode_contexts)
        part = step_cost(model, dtype_bytes, n, n, n, sum(decode_contexts) / n + 1)
        kv_bytes, attention_flops = part.kv_bytes, part.attention_flops
    for start, n in chunks:  # query i of the chunk sees start + i + 1 keys: mean start + (n+1)/2
        part = step_cost(model, dtype_bytes, n, 1, 1, start + (n + 1) / 2)
        kv_bytes, attention_flops = kv_bytes + part.kv_bytes, attention_flops + part.attention_flops
    cost = dataclasses.replace(weights, kv_bytes=kv_bytes, attention_flops=attention_flops)
    return sum(max(b / ceilings.bytes_per_s, f / ceilings.flops_per_s)
               for b, f in cost.parts().values())


def replay(model: ModelConfig, work: Workload, kv_tokens: int, ceilings: Ceilings,
           dtype_bytes: int = 2) -> dict:
    """The idealised run (module doc): its steps, duration and throughputs at the bound."""
    need = work.input_len + work.output_len  # KV a request holds at its end
    slots = min(work.max_concurrency, kv_tokens // need)
    if slots < 1:
        raise ValueError(f"a KV cache of {kv_tokens} tokens cannot hold one request of {need}")
    waiting = list(range(work.num_prompts))
    prefilled: dict[int, int] = {}  # running request -> prompt tokens computed
    generated: dict[int, int] = {}
    elapsed, steps, prefill_steps = 0.0, 0, 0
    while waiting or prefilled:
        while waiting and len(prefilled) < slots:
            prefilled[waiting.pop(0)] = 0
        decodes = [r for r, done in prefilled.items() if done == work.input_len]
        budget = work.token_budget - len(decodes)
        chunks = []
        for r, done in prefilled.items():
            if done < work.input_len and budget > 0:
                n = min(work.input_len - done, budget)
                chunks.append((r, done, n))
                budget -= n
        contexts = [work.input_len + generated.get(r, 0) for r in decodes]
        elapsed += step_seconds(model, dtype_bytes, contexts, [(s, n) for _, s, n in chunks],
                                ceilings)
        steps, prefill_steps = steps + 1, prefill_steps + bool(chunks)
        for r in decodes:
            generated[r] = generated.get(r, 0) + 1
        for r, start, n in chunks:
            prefilled[r] = start + n
            if prefilled[r] == work.input_len:  # the last chunk samples the first token
                generated[r] = 1
        for r in [r for r, g in generated.items() if g >= work.output_len and r in prefilled]:
            del prefilled[r]
    return {"kv_tokens": kv_tokens, "concurrent": slots, "steps": steps,
            "steps_with_prompt_tokens": prefill_steps, "duration_s": round(elapsed, 3),
            "input_tok_per_s": round(work.num_prompts * work.input_len / elapsed, 1),
            "output_tok_per_s": round(work.num_prompts * work.output_len / elapsed, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen3-30b-a3b")
    parser.add_argument("--kv-tokens", type=int, required=True,
                        help="the KV cache's tokens (the capacity report's figure)")
    parser.add_argument("--num-prompts", type=int, default=Workload.num_prompts)
    parser.add_argument("--input-len", type=int, default=Workload.input_len)
    parser.add_argument("--output-len", type=int, default=Workload.output_len)
    parser.add_argument("--max-concurrency", type=int, default=Workload.max_concurrency)
    parser.add_argument("--token-budget", type=int, default=Workload.token_budget)
    parser.add_argument("--out", default=None, help="directory for long_prompt_bound.json")
    args = parser.parse_args()
    model, _ = load_model_config(args.preset)
    work = Workload(args.num_prompts, args.input_len, args.output_len, args.max_concurrency,
                    args.token_budget)
    ceilings = CEILINGS[0]
    room_for_all = work.max_concurrency * (work.input_len + work.output_len)
    result = {"preset": args.preset, "workload": dataclasses.asdict(work),
              "ceilings": {"device": ceilings.name, "tflop_per_s": ceilings.flops_per_s / 1e12,
                           "tb_per_s": ceilings.bytes_per_s / 1e12},
              "with_kv_given": replay(model, work, args.kv_tokens, ceilings),
              "with_room_for_all": replay(model, work, max(args.kv_tokens, room_for_all),
                                          ceilings),
              "commit": os.environ.get("MOESERVE_GIT_COMMIT")}
    print(json.dumps(result, indent=2))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "long_prompt_bound.json"), "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
