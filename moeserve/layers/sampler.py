"""Token sampling for one step, vectorised over the batch.

Owns `SamplingTensors` (the per-row sampling parameters as device tensors, built once per step
from the requests' SamplingParams) and `sample` (logits -> token ids, plus logprobs when asked).

    logits [B, V] --argmax----------------------------------------------> greedy rows
           |-- fp32 / temperature -> top-k -> top-p -> min-p -> softmax
           |        -> argmax(probs / E), E ~ Exp(1) = hash(seed, position, vocab index) -> others
           '-- logsumexp, topk -----------------------------------------> logprobs (raw model)

Randomness is counter-based: the exponential noise of row b at vocab index v is a pure function
of (seeds[b], positions[b], v), computed with integer ops on the logits' device. A seeded request
therefore samples the same tokens whatever else is in the batch, and the whole function runs
inside a CUDA graph (no torch.Generator, no host sync). Host flags on SamplingTensors skip the
work no row needs; a captured graph must be captured with the flags it will be replayed with.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from moeserve.types import SamplingParams

_MASK32 = 0xFFFFFFFF
# Odd multipliers below 2**31: a value < 2**32 times one stays < 2**63, so the int64 products
# never overflow and the hash is exact on every backend. 0x45D9F3B is Thomas Mueller's
# well-tested 32-bit mixing constant; 0x7FEB352D is from Chris Wellons' hash prospector.
_MUL_A = 0x045D9F3B
_MUL_B = 0x7FEB352D
_GOLDEN32 = 0x9E3779B9  # spreads consecutive vocab indices over the 32-bit space
_ROW_CHUNK_ELEMENTS = 1 << 27  # rows x vocab per chunk of the random path: int64 temporaries of
# 1 GiB. Over a whole [B, V] batch, top-k/top-p's sort (values + int64 indices), softmax, cumsum
# and noise are many such temporaries: the activation profile (4,096 rows, V 152k) measured
# 24.9 GB before the chunking and 7.4 GB after on the H200, memory that goes to the KV cache.


@dataclass
class SamplingTensors:
    """Per-row sampling parameters of one step, on the device, plus host flags to skip work.

    Row b samples the token at absolute position `positions[b]` of its request (e.g. the
    request's num_tokens) with the random stream of `seeds[b]`.
    """

    temperature: torch.Tensor  # [B] fp32; 0 = greedy
    top_k: torch.Tensor  # [B] int64; 0 = off
    top_p: torch.Tensor  # [B] fp32; 1 = off
    min_p: torch.Tensor  # [B] fp32; 0 = off
    seeds: torch.Tensor  # [B] int64 (the seed's low 64 bits, two's complement)
    positions: torch.Tensor  # [B] int64
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool
    max_num_logprobs: int | None
    """Most top logprobs any row asked for; None when no row wants logprobs."""

    @classmethod
    def build(cls, params: list[SamplingParams], seeds: list[int], positions: list[int],
              device: torch.device | str) -> SamplingTensors:
        """One row per request, in batch order. Two host->device copies in all."""
        if not len(params) == len(seeds) == len(positions):
            raise ValueError(f"params, seeds and positions differ in length: "
                             f"{len(params)}, {len(seeds)}, {len(positions)}")
        floats = torch.tensor([[p.temperature for p in params], [p.top_p for p in params],
                               [p.min_p for p in params]], dtype=torch.float32)  # [3, B]
        ints = torch.tensor([[max(p.top_k, 0) for p in params], [_wrap_int64(s) for s in seeds],
                             list(positions)], dtype=torch.int64)  # [3, B]
        if torch.device(device).type == "cuda":  # pinned: a pageable copy syncs the stream
            floats, ints = floats.pin_memory(), ints.pin_memory()
        floats, ints = floats.to(device, non_blocking=True), ints.to(device, non_blocking=True)
        wanted = [p.logprobs for p in params if p.logprobs is not None]
        return cls(
            temperature=floats[0], top_p=floats[1], min_p=floats[2],
            top_k=ints[0], seeds=ints[1], positions=ints[2],
            all_greedy=all(p.greedy for p in params),
            any_top_k=any(p.top_k > 0 for p in params),
            any_top_p=any(p.top_p < 1.0 for p in params),
            any_min_p=any(p.min_p > 0.0 for p in params),
            max_num_logprobs=max(wanted) if wanted else None,
        )


@dataclass
class SampleLogprobs:
    """Logprobs of the raw model distribution (log_softmax of the fp32 logits)."""

    token_logprob: torch.Tensor  # [B] fp32, of the sampled token
    top_ids: torch.Tensor  # [B, n] int64, most likely first
    top_logprobs: torch.Tensor  # [B, n] fp32


def _wrap_int64(value: int) -> int:
    """An arbitrary Python int reduced to the int64 with the same low 64 bits."""
    value &= 0xFFFFFFFFFFFFFFFF
    return value - (1 << 64) if value >= 1 << 63 else value


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijective avalanche mix of int64 tensors holding values in [0, 2**32).

    Values stay non-negative, so `>>` is a logical shift, and products stay below 2**63.
    """
    for shift, mul in ((16, _MUL_A), (15, _MUL_B), (16, _MUL_A)):
        x = (x >> shift).bitwise_xor_(x).mul_(mul).bitwise_and_(_MASK32)
    return (x >> 16).bitwise_xor_(x)


def _row_keys(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One 32-bit key per (seed, position): the seed's two halves and the position absorbed
    one word at a time."""
    key = _mix32((seeds & _MASK32) ^ 0x2545F491)  # [B]
    key = _mix32(key ^ ((seeds >> 32) & _MASK32))
    return _mix32(key ^ (positions & _MASK32))


def random_uniform(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Uniform draws in the open interval (0, 1), a pure function of (seed, position, index).

    Args:
        seeds: [B] int64. positions: [B] int64 (same device).
    Returns:
        [B, vocab_size] fp32; every value is (m + 0.5) / 2**23 for an integer m in [0, 2**23),
        so never 0 and never 1.
    """
    key = _row_keys(seeds, positions)  # [B]
    index = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)
    index = (index * _GOLDEN32) & _MASK32  # [V]
    # _mix32 of key ^ index, written for the [B, V] memory traffic: the first xorshift is
    # linear over xor, so it is applied to the row and column terms apart, on [B] and [V].
    x = (key ^ (key >> 16))[:, None] ^ (index ^ (index >> 16))[None, :]  # [B, V]
    x = x.mul_(_MUL_A).bitwise_and_(_MASK32)
    x = (x >> 15).bitwise_xor_(x).mul_(_MUL_B).bitwise_and_(_MASK32)
    x = (x >> 16).bitwise_xor_(x).mul_(_MUL_A).bitwise_and_(_MASK32)
    # The top 23 bits as m, then u = (2m + 1) / 2**24, exact in fp32.
    x = (x >> 8).bitwise_or_(1)  # [B, V], odd, < 2**24
    return x.to(torch.float32).mul_(1.0 / (1 << 24))


def exponential_noise(seeds: torch.Tensor, positions: torch.Tensor,
                      vocab_size: int) -> torch.Tensor:
    """E ~ Exp(1), [B, vocab_size] fp32, finite and > 0 (see random_uniform)."""
    return random_uniform(seeds, positions, vocab_size).log_().neg_()


def _apply_top_k_top_p(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """Mask (in place, with -inf) the tokens top-k and top-p exclude. Ties at the boundary are
    kept. logits: [B, V] fp32, already divided by the temperature."""
    vocab_size = logits.shape[-1]
    k = torch.where(t.top_k > 0, t.top_k.clamp(max=vocab_size), vocab_size)  # [B]
    sorted_logits = logits.sort(dim=-1, descending=True).values  # [B, V]
    num_kept = k
    if t.any_top_p:
        if t.any_top_k:
            rank = torch.arange(vocab_size, device=logits.device)
            sorted_logits.masked_fill_(rank[None, :] >= k[:, None], float("-inf"))
        probs = sorted_logits.softmax(dim=-1)  # [B, V]
        mass_before = probs.cumsum(dim=-1) - probs  # [B, V], exclusive prefix sums
        # The smallest prefix with mass >= top_p. top_p == 1 keeps everything, whatever the
        # rounding of the cumulative sum.
        keep = (mass_before < t.top_p[:, None]) | (t.top_p[:, None] >= 1.0)  # [B, V]
        # NOTE: at least rank 0 even when no mass_before is below top_p: a top_p of 0, one that
        # rounds to 0 in fp32 (1e-46, 5e-324), or NaN probabilities; gathering at rank -1
        # would fail the whole step (a device assert on CUDA).
        num_kept = torch.minimum(keep.sum(dim=-1), k).clamp_(min=1)  # [B]
    threshold = sorted_logits.gather(-1, (num_kept - 1)[:, None])  # [B, 1]
    return logits.masked_fill_(logits < threshold, float("-inf"))


def _sample_random(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p, then the exponential race, in chunks of rows so that
    the [rows, V] temporaries stay near _ROW_CHUNK_ELEMENTS elements. Returns [B] int64; each
    row's token depends on that row only, so the chunking does not change it."""
    batch, vocab_size = logits.shape
    rows = max(1, _ROW_CHUNK_ELEMENTS // vocab_size)
    token_ids = [_sample_random_rows(logits[s:s + rows], _row_slice(t, s, s + rows))
                 for s in range(0, batch, rows)]
    return token_ids[0] if len(token_ids) == 1 else torch.cat(token_ids)


def _row_slice(t: SamplingTensors, start: int, end: int) -> SamplingTensors:
    """Rows [start, end) of t; the host flags stay the whole batch's (a flag that is on for
    rows it does not concern only costs work, never changes a token)."""
    if start == 0 and end >= t.temperature.shape[0]:
        return t
    return dataclasses.replace(
        t, temperature=t.temperature[start:end], top_k=t.top_k[start:end],
        top_p=t.top_p[start:end], min_p=t.min_p[start:end], seeds=t.seeds[start:end],
        positions=t.positions[start:end])


def _sample_random_rows(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    temperature = torch.where(t.temperature > 0, t.temperature, 1.0)  # [B]; greedy rows unused
    scaled = logits.to(torch.float32, copy=True).div_(temperature[:, None])  # [B, V]
    if t.any_top_k or t.any_top_p:
        scaled = _apply_top_k_top_p(scaled, t)
    if t.any_min_p:
        # p < min_p * p_max  <=>  logit < max_logit + log(min_p); unchanged by renormalisation.
        floor = scaled.amax(dim=-1, keepdim=True) + t.min_p[:, None].log()  # [B, 1]
        scaled.masked_fill_(scaled < floor, float("-inf"))
    probs = scaled.softmax(dim=-1)
    del scaled
    # argmax(probs / E), E ~ Exp(1): a draw from probs.
    return probs.div_(exponential_noise(t.seeds, t.positions, vocab_size=probs.shape[-1])) \
        .argmax(dim=-1)


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num: int) -> SampleLogprobs:
    """Raw-model logprobs of the sampled tokens and the top `num`, without a [B, V] copy of
    log_softmax: logprob = logit - logsumexp, and top-k of logits == top-k of logprobs."""
    logits = logits.to(torch.float32)
    lse = logits.logsumexp(dim=-1)  # [B]
    token_logprob = logits.gather(-1, token_ids[:, None])[:, 0] - lse  # [B]
    top_logits, top_ids = logits.topk(num, dim=-1)  # [B, n]
    return SampleLogprobs(token_logprob, top_ids, top_logits - lse[:, None])


def mask_tokens_(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """A grammar's mask, in place: logits[rows[j], v] = -inf where bit v of bitmask[j] is 0.

    Args:
        logits: [R, V], any float dtype. rows: [C] int64, rows of logits (distinct).
        bitmask: [C, W] int32 on logits' device, W * 32 >= V; bit v % 32 of word v // 32.
    The rows go in chunks that bound the [rows, V] byte temporaries like the random path's.
    """
    vocab_size = logits.shape[-1]
    # NOTE: the int32 words read as bytes, low byte first (little-endian: x86 and CUDA): byte
    # v // 8 of a row holds token v at bit v % 8.
    shifts = torch.arange(8, dtype=torch.uint8, device=logits.device)
    chunk = max(1, _ROW_CHUNK_ELEMENTS // (4 * bitmask.shape[1] * 8))
    for start in range(0, rows.shape[0], chunk):
        index = rows[start:start + chunk]  # [c]
        words = bitmask[start:start + chunk].contiguous().view(torch.uint8)  # [c, 4W]
        allowed = ((words[:, :, None] >> shifts) & 1).view(words.shape[0], -1)  # [c, 32W]
        picked = logits[index]  # [c, V], a copy
        picked.masked_fill_(allowed[:, :vocab_size] == 0, float("-inf"))
        logits[index] = picked


def sample(logits: torch.Tensor, t: SamplingTensors
           ) -> tuple[torch.Tensor, SampleLogprobs | None, torch.Tensor]:
    """Sample one token per row.

    Args:
        logits: [B, V], any float dtype; not modified.
        t: the rows' parameters (B rows, on the logits' device).
    Returns:
        token_ids [B] int64, the logprobs when some row asked for them (else None), and
        finite [B] bool: False for a row whose logits hold a NaN or no finite maximum (its token
        is garbage; the runner fails that row's request alone). Greedy rows (temperature 0)
        take argmax, lowest index on ties.
    """
    token_ids = logits.argmax(dim=-1)  # [B]
    # NOTE: argmax returns a NaN's index when the row has one (NaN compares as the largest), so
    # one gather checks the row: NaN, +inf, or a row that is all -inf. O(B), no [B, V] pass.
    finite = logits.gather(-1, token_ids[:, None])[:, 0].isfinite()  # [B]
    if not t.all_greedy:
        sampled = _sample_random(logits, t)
        token_ids = torch.where(t.temperature == 0, token_ids, sampled)
    logprobs = None
    if t.max_num_logprobs is not None:
        logprobs = token_logprobs(logits, token_ids, t.max_num_logprobs)
    return token_ids, logprobs, finite
