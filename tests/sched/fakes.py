"""Test helpers: a scheduler built from numbers alone, requests, and a fake runner.

`FakeRunner` stands in for the model runner: it keeps a fake paged KV cache (one token id per
slot), writes each scheduled token into the slot its block table names, and checks that every row
sees exactly its own sequence in the KV cache at positions [0, end of its chunk). That checks block
tables, prefix hits, preemption by recompute and the overlap placeholders end to end.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable

from moeserve.config import SchedulerConfig
from moeserve.sched import NULL_BLOCK, Request, Scheduler
from moeserve.types import ModelOutput, RequestOutput, SamplingParams, SchedulerOutput

EOS = 2
_prompt_bases = itertools.count(1)


def make_scheduler(num_blocks: int = 64, block_size: int = 4, max_num_batched_tokens: int = 64,
                   max_running_requests: int = 8, enable_prefix_caching: bool = True,
                   enable_chunked_prefill: bool = True, watermark: float = 0.0,
                   max_model_len: int = 64) -> Scheduler:
    cfg = SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens,
                          max_model_len=max_model_len, watermark=watermark,
                          enable_chunked_prefill=enable_chunked_prefill)
    return Scheduler(cfg, num_blocks=num_blocks, block_size=block_size,
                     max_running_requests=max_running_requests,
                     enable_prefix_caching=enable_prefix_caching)


def make_request(req_id: str, prompt: list[int] | int, max_tokens: int = 16,
                 eos_token_ids: tuple[int, ...] = (EOS,), seed: int = 0,
                 **params: object) -> Request:
    """A request; an int prompt means that many token ids no other prompt shares."""
    if isinstance(prompt, int):
        base = 1000 * next(_prompt_bases)
        prompt = [base + i for i in range(prompt)]
    return Request(request_id=req_id, prompt_token_ids=list(prompt),
                   sampling_params=SamplingParams(max_tokens=max_tokens, **params),
                   eos_token_ids=eos_token_ids, seed=seed)


def model_output(out: SchedulerOutput, tokens: dict[str, int] | int = 7) -> ModelOutput:
    """One token per sampling row: `tokens[req_id]` (or the same int for every row)."""
    sampled = []
    for req_id, sample in zip(out.req_ids, out.sample):
        tok = (tokens if isinstance(tokens, int) else tokens.get(req_id, 7)) if sample else -1
        sampled.append(tok)
    return ModelOutput(sampled_token_ids=sampled)


def step(sched: Scheduler, tokens: dict[str, int] | int = 7,
         ) -> tuple[SchedulerOutput, list[RequestOutput]]:
    """One synchronous step with chosen sampled tokens; checks integrity after it."""
    out = sched.schedule()
    sched.check_integrity()
    outputs = sched.update(out, model_output(out, tokens))
    sched.check_integrity()
    return out, outputs


def row(out: SchedulerOutput, req_id: str) -> dict[str, object]:
    """The row of `req_id` in a step, as a dict (with its slice of token_ids)."""
    i = out.req_ids.index(req_id)
    start = sum(out.num_scheduled_tokens[:i])
    return {"num_scheduled": out.num_scheduled_tokens[i],
            "num_computed": out.num_computed_tokens[i],
            "token_ids": out.token_ids[start:start + out.num_scheduled_tokens[i]],
            "block_table": out.block_tables[i], "sample": out.sample[i],
            "num_output_tokens": out.num_output_tokens[i]}


class FakeRunner:
    """A fake model runner over a fake paged KV cache (see the module docstring)."""

    def __init__(self, block_size: int, sample_fn: Callable[[str], int]) -> None:
        self.block_size = block_size
        self.sample_fn = sample_fn
        self.kv: dict[tuple[int, int], int] = {}  # (block, offset) -> token id
        self.truth: dict[str, list[int]] = {}  # req id -> prompt + every token sampled for it

    def add(self, req: Request) -> None:
        self.truth[req.request_id] = list(req.prompt_token_ids)

    def execute(self, out: SchedulerOutput) -> ModelOutput:
        bs = self.block_size
        assert len(out.token_ids) == sum(out.num_scheduled_tokens)
        assert len(set(out.req_ids)) == len(out.req_ids), "request twice in one step"
        written: list[set[int]] = []  # per row, the blocks it writes
        sampled = []
        pos = 0
        for i, req_id in enumerate(out.req_ids):
            seq, table = self.truth[req_id], out.block_tables[i]
            start, num = out.num_computed_tokens[i], out.num_scheduled_tokens[i]
            end = start + num
            assert num >= 1 and NULL_BLOCK not in table and len(table) * bs >= end
            written.append({table[p // bs] for p in range(start, end)})
            for p, tok in zip(range(start, end), out.token_ids[pos:pos + num]):
                assert p < len(seq), f"{req_id}: position {p} has no token yet"
                assert tok in (-1, seq[p]), f"{req_id}: token {tok} at {p}, expected {seq[p]}"
                self.kv[table[p // bs], p % bs] = seq[p]  # -1 is resolved on the "device"
            pos += num
            kv = [self.kv.get((table[p // bs], p % bs)) for p in range(end)]
            assert kv == seq[:end], f"{req_id}: KV {kv} != tokens {seq[:end]}"
            assert out.sample[i] == (end == len(seq)), f"{req_id}: sample flag wrong"
            tok = -1
            if out.sample[i]:
                tok = self.sample_fn(req_id)
                seq.append(tok)
            sampled.append(tok)
        for i, blocks in enumerate(written):  # no row writes into a block another row reads
            for j, table in enumerate(out.block_tables):
                assert i == j or not blocks & set(table), f"row {i} writes a block of row {j}"
        return ModelOutput(sampled_token_ids=sampled)


def random_sampler(rng: random.Random, vocab: int, eos_prob: float) -> Callable[[str], int]:
    def sample(req_id: str) -> int:
        return EOS if rng.random() < eos_prob else rng.randrange(3, vocab)
    return sample
