"""The throughput a KV cache allows a fixed-length workload: an idealised engine replayed step
by step, each step at its parts' roofline bounds.

A run whose requests do not all fit in the KV cache at once (issue 14's long prompts: 128
requests of 8,192 + 256 tokens against 667,360 KV tokens, so 78 at a time, each holding its slot
for 256 decode steps) is bound by more than the GPU, and the serial roofline (roofline.py) that
assumes the whole batch at once overstates what it can reach. This replays the workload with an
engine that is ideal everywhere else:

- every request arrives at once; a request is admitted while the cache can hold its prompt and
  all its output (so none is ever preempted), first come first served, up to the concurrency;
- a step carries every running decode and, within the token budget (max_num_batched_tokens,
  which counts the decodes), the prompt chunks of admitted requests in order;
- a step takes the sum of its parts' roofline times (roofline.py's StepCost: the routed experts,
  the dense weights, attention over each row's own context), each part at max(bytes /
  bandwidth, FLOPs / peak) on the device's measured ceilings; kernels run one after another, so
  parts do not overlap.

    replay(model, workload, kv_tokens, ceilings) -> its steps, duration and throughputs
    run_kv_bound(run) -> the bound with the run's cache and with room for every request, and
                         the share of the first that the run reached (the doctor's kv_capacity
                         evidence); None where the run's figures cannot give it
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from moeserve.diagnose import figures
from moeserve.diagnose.bounds.roofline import (
    Ceilings,
    ceilings_for,
    dtype_bytes_of,
    kv_elem_bytes_of,
    model_of,
    quant_of,
    step_cost,
)
from moeserve.model_config import ModelConfig

# a replay is a loop over the run's steps in Python: runs larger than this are not replayed
MAX_REPLAY_PROMPTS = 20_000


@dataclass(frozen=True)
class Workload:
    """Fixed-length requests, all arriving at once (issue 14's long prompts by default)."""

    num_prompts: int = 128
    input_len: int = 8192
    output_len: int = 256
    max_concurrency: int = 128
    token_budget: int = 8192  # max_num_batched_tokens


def step_seconds(model: ModelConfig, dtype_bytes: int, decode_contexts: list[int],
                 chunks: list[tuple[int, int]], ceilings: Ceilings,
                 quant: str | None = None, kv_elem_bytes: int | None = None) -> float:
    """One step's time at its parts' bounds: decodes at their contexts (keys before the new
    token) and prompt chunks (start, length), causal within the chunk. quant, kv_elem_bytes:
    roofline.step_cost's."""
    tokens = len(decode_contexts) + sum(n for _, n in chunks)
    weights = step_cost(model, dtype_bytes, tokens, rows=len(decode_contexts) + len(chunks),
                        batch=0, context=0, quant=quant)
    kv_bytes = attention_flops = 0.0
    if decode_contexts:  # one query each over ctx + 1 keys; the cost is linear in the context,
        # so the decodes at their mean context cost what they do one by one
        n = len(decode_contexts)
        part = step_cost(model, dtype_bytes, n, n, n, sum(decode_contexts) / n + 1, quant,
                         kv_elem_bytes)
        kv_bytes, attention_flops = part.kv_bytes, part.attention_flops
    for start, n in chunks:  # query i of the chunk sees start + i + 1 keys: mean start + (n+1)/2
        part = step_cost(model, dtype_bytes, n, 1, 1, start + (n + 1) / 2, quant,
                         kv_elem_bytes)
        kv_bytes, attention_flops = kv_bytes + part.kv_bytes, attention_flops + part.attention_flops
    cost = dataclasses.replace(weights, kv_bytes=kv_bytes, attention_flops=attention_flops)
    return sum(max(b / ceilings.bytes_per_s, f / ceilings.flops_per_s)
               for b, f in cost.parts().values())


def replay(model: ModelConfig, work: Workload, kv_tokens: int, ceilings: Ceilings,
           dtype_bytes: int = 2, quant: str | None = None,
           kv_elem_bytes: int | None = None) -> dict[str, Any]:
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
                                ceilings, quant, kv_elem_bytes)
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


def workload_of(run: dict[str, Any]) -> Workload | None:
    """The run's workload when its requests have fixed lengths (range_ratio 1.0, or every
    recorded request the same) and its engine's token budget is known; else None."""
    cfg = run.get("config") if isinstance(run.get("config"), dict) else {}
    input_len, output_len = cfg.get("input_len"), cfg.get("output_len")
    if cfg.get("workload") != "random" or cfg.get("range_ratio", 1.0) != 1.0 or \
            not isinstance(input_len, int) or not isinstance(output_len, int):
        return None
    prompts = run.get("num_prompts")
    budget = figures.engine_section(run, "scheduler").get("max_num_batched_tokens")
    if not isinstance(prompts, int) or not 0 < prompts <= MAX_REPLAY_PROMPTS or \
            not isinstance(budget, int) or budget < 1:
        return None
    conc = figures.client_concurrency(run) or prompts
    cap = figures.max_running_cap(run)
    return Workload(prompts, input_len, output_len, min(conc, cap) if cap else conc, budget)


def run_kv_bound(run: dict[str, Any]) -> dict[str, Any] | None:
    """The run's workload replayed (module doc) with its KV cache and with room for every
    request at once, and the share of the first that its input throughput reached. None
    without fixed lengths, measured ceilings for the device, a readable model shape or the
    cache's size, or when the cache cannot hold one request."""
    work, kv = workload_of(run), figures.kv_tokens(run)
    ceilings = ceilings_for(figures.capacity_report(run).get("device_name"))
    model = model_of(run)
    if work is None or not kv or ceilings is None or model is None:
        return None
    dtype_bytes, quant, kv_elem = dtype_bytes_of(run), quant_of(run, model), kv_elem_bytes_of(run)
    room = work.max_concurrency * (work.input_len + work.output_len)
    try:
        given = replay(model, work, kv, ceilings, dtype_bytes, quant, kv_elem)
    except ValueError:
        return None
    out: dict[str, Any] = {
        "method": "KV-limited replay (diagnose/bounds/kv_bound.py)", "device": ceilings.name,
        "workload": dataclasses.asdict(work), "with_kv_given": given,
        "with_room_for_all": (given if kv >= room else
                              replay(model, work, room, ceilings, dtype_bytes, quant, kv_elem))}
    achieved = run.get("input_throughput")
    if isinstance(achieved, int | float) and given["input_tok_per_s"] > 0:
        out["percent"] = round(100 * achieved / given["input_tok_per_s"], 1)
    return out
