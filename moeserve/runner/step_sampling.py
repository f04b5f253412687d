"""One step's sampling as the runner runs it: parameters to tensors, sample, and the faults that
belong to single requests kept to those requests.

    logits [R, V] --grammar rows masked (mask_tokens_, in place: the step's own logits)
                  --rows with allowed_token_ids: every other token to -inf (allow_only_)
                  --logit_bias added (add_logit_bias_, in place: what is sampled and what
                    the logprobs report, as with the mask), then the presence / frequency
                    penalties subtracted (runner/penalties.py; the sampled tokens counted after)
                  --rows short of their min_tokens: EOS and stop ids to -inf (hold_stops_)
                  --SamplingTensors.build + sample--> token_ids [R], logprobs, finite [R]
         | the batch call raised?
         '--> each row alone: the rows that raise alone fail (row_errors); the others are
              sampled again together (a row's token depends on that row only, so this gives the
              tokens the batch would have), and their results are scattered back into [R]

A row whose logits are not finite (`finite` False: NaN, or no finite maximum) is failed by the
PendingOutput once its flags reach the host, with no sync here. What cannot be attributed to rows
propagates, and the engine then fails loudly: no row fails alone (a fault of the combination),
every row of several fails alone (the sampler, not a request), the good rows fail together, or a
device-side error. A step that samples one row only (one request in the batch, or the others
mid-prefill) that fails alone fails that request.

Fault injection (`envs.fault_injection`, tests only) raises the "sample" fault for a chosen
request wherever it is in the batch, and the "nan" fault writes NaN into its logits, so the
isolation above runs for real.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np
import torch

from moeserve.envs import InjectedFault
from moeserve.kernels.attention.metadata import to_device
from moeserve.layers.sampler import SampleLogprobs, SamplingTensors, mask_tokens_, sample
from moeserve.runner.penalties import OutputCounts
from moeserve.types import SamplingParams, SchedulerOutput


@dataclass
class StepSample:
    """What `sample_step` gives for the R sampled rows."""

    token_ids: torch.Tensor  # [R] int64; a failed row holds 0, a valid id the next step may read
    logprobs: SampleLogprobs | None
    finite: torch.Tensor  # [R] bool, on the device
    row_errors: dict[int, str] = field(default_factory=dict)  # row (of R) -> what failed


@dataclass
class GrammarMask:
    """A step's grammar rows, on the device: `rows` [C] of the R sampled rows, `bitmask`
    [C, W] int32 (structured/grammars.py's layout)."""

    rows: torch.Tensor
    bitmask: torch.Tensor

    @classmethod
    def of(cls, out: SchedulerOutput, sampled: np.ndarray,
           device: torch.device) -> GrammarMask | None:
        """The plan's grammar rows as rows of the sampled ones (`sampled` [R], batch rows)."""
        if not out.grammar_rows:
            return None
        rows = np.searchsorted(sampled, np.asarray(out.grammar_rows, dtype=np.int64))
        return cls(to_device(rows, device), to_device(out.grammar_bitmask, device))


def sample_step(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int],
                positions: list[int], req_ids: list[str],
                faults: dict[str, frozenset[str]],
                grammar: GrammarMask | None = None,
                counts: OutputCounts | None = None,
                num_outputs: Callable[[int], int] | None = None,
                eos_token_ids: tuple[int, ...] = ()) -> StepSample:
    """Sample R rows (see module doc). `req_ids` [R] name the rows for errors and faults;
    `grammar` masks its rows of `logits` in place (the caller's fresh logits of this step);
    `counts`: the penalized requests' output counts (runner/penalties.py), subtracted before
    sampling and given the sampled tokens after; `num_outputs(j)`: row j's output tokens
    before the one it samples (in-flight ones included), for min_tokens (hold_stops_). One
    scan of `params` finds the rows whose logits are edited (SamplingParams.edits_logits);
    the edits look at those alone (at 2,048 rows a scan is ~0.1 ms of host time)."""
    if grammar is not None:
        mask_tokens_(logits, grammar.rows, grammar.bitmask)
    edited = [j for j, p in enumerate(params) if p.edits_logits]
    penalized: list[int] = []
    if edited:
        allow_only_(logits, params, edited)
        add_logit_bias_(logits, params, edited)
        if counts is not None:
            penalized = counts.apply_(logits, req_ids, params, edited)
        if num_outputs is not None:
            hold_stops_(logits, params, edited, num_outputs, eos_token_ids)
    if faults.get("nan"):
        logits = _inject_nan(logits, req_ids, faults["nan"])
    try:
        got = StepSample(*_sample(logits, params, seeds, positions, req_ids, faults))
    except Exception as batch_error:
        got = _sample_row_by_row(logits, params, seeds, positions, req_ids, faults,
                                 batch_error)
    if penalized:
        counts.record(req_ids, penalized, got.token_ids)
    return got


def add_logit_bias_(logits: torch.Tensor, params: list[SamplingParams],
                    rows: Iterable[int] | None = None) -> None:
    """Each row's SamplingParams.logit_bias added to its logits, in place (the step's own
    logits [R, V], row j params[j]'s; `rows`: the ones to look at, default all): the sum in
    fp32, rounded once to the logits' dtype (a grammar's -inf stays -inf). No work when no row
    has a bias; otherwise one copy of the (row, id, bias) triples to the device, no sync."""
    biased = [(j, params[j].logit_bias) for j in _rows(params, rows) if params[j].logit_bias]
    if not biased:
        return
    rows = np.concatenate([np.full(len(b), j, dtype=np.int64) for j, b in biased])
    pairs = np.array([pair for _, b in biased for pair in b], dtype=np.float64)  # [N, 2]
    device = logits.device
    index = (to_device(rows, device), to_device(pairs[:, 0].astype(np.int64), device))
    values = to_device(pairs[:, 1].astype(np.float32), device)
    logits.index_put_(index, (logits[index].float() + values).to(logits.dtype))


def allow_only_(logits: torch.Tensor, params: list[SamplingParams],
                rows: Iterable[int] | None = None) -> None:
    """Rows j with params[j].allowed_token_ids keep those logits alone; the others are -inf,
    in place. No work when no row has them; otherwise one copy of the (row, id) pairs."""
    rows = [(j, params[j].allowed_token_ids) for j in _rows(params, rows)
            if params[j].allowed_token_ids]
    if not rows:
        return
    pairs = np.array([(j, t) for j, ids in rows for t in ids], dtype=np.int64).T.copy()
    at = to_device(pairs, logits.device)  # [2, N]
    kept = logits[at[0], at[1]]
    logits[to_device(np.array([j for j, _ in rows], dtype=np.int64), logits.device)] = \
        float("-inf")
    logits[at[0], at[1]] = kept


def hold_stops_(logits: torch.Tensor, params: list[SamplingParams], rows: Iterable[int],
                num_outputs: Callable[[int], int], eos_token_ids: tuple[int, ...]) -> None:
    """Rows j (of `rows`) whose request has generated fewer than params[j].min_tokens tokens
    (num_outputs(j)) cannot sample a token that would stop them: their stop_token_ids and,
    unless ignore_eos, the model's EOS ids set to -inf in `logits` [R, V], in place. No work
    when no row is held; otherwise one copy of the (row, id) pairs to the device, no sync."""
    held = [(j, p.stop_token_ids if p.ignore_eos else p.stop_token_ids + eos_token_ids)
            for j in rows if (p := params[j]).min_tokens and num_outputs(j) < p.min_tokens]
    pairs = [(j, t) for j, ids in held for t in ids]
    if not pairs:
        return
    index = to_device(np.array(pairs, dtype=np.int64).T.copy(), logits.device)  # [2, N]
    logits[index[0], index[1]] = float("-inf")


def _rows(params: list[SamplingParams], rows: Iterable[int] | None) -> Iterable[int]:
    return range(len(params)) if rows is None else rows


def _sample(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int],
            positions: list[int], req_ids: list[str], faults: dict[str, frozenset[str]]
            ) -> tuple[torch.Tensor, SampleLogprobs | None, torch.Tensor]:
    injected = faults.get("sample")
    if injected and not injected.isdisjoint(req_ids):
        raise InjectedFault(f"injected sampler fault for {sorted(injected & set(req_ids))}")
    return sample(logits, SamplingTensors.build(params, seeds, positions, logits.device))


def _sample_row_by_row(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int],
                       positions: list[int], req_ids: list[str],
                       faults: dict[str, frozenset[str]],
                       batch_error: Exception) -> StepSample:
    """The batch call raised: find the rows that raise alone, sample the rest together."""
    errors: dict[int, str] = {}
    for j in range(len(req_ids)):
        try:
            _sample(logits[j:j + 1], params[j:j + 1], seeds[j:j + 1], positions[j:j + 1],
                    req_ids[j:j + 1], faults)
        except Exception as e:
            errors[j] = f"sampling failed: {type(e).__name__}: {e}"
    good = [j for j in range(len(req_ids)) if j not in errors]
    if not errors or (not good and len(req_ids) > 1):
        raise batch_error  # no row is to blame, or every row of several: no one request's
    if not good:  # the step's one row: its request fails
        return StepSample(torch.zeros(1, dtype=torch.int64, device=logits.device), None,
                          torch.ones(1, dtype=torch.bool, device=logits.device), errors)
    index = torch.tensor(good, device=logits.device)  # [G]
    token_ids, logprobs, finite = _sample(logits[index], [params[j] for j in good],
                                          [seeds[j] for j in good],
                                          [positions[j] for j in good],
                                          [req_ids[j] for j in good], faults)
    num_rows = len(req_ids)
    full_ids = torch.zeros(num_rows, dtype=token_ids.dtype, device=logits.device)
    full_ids[index] = token_ids
    full_finite = torch.ones(num_rows, dtype=torch.bool, device=logits.device)
    full_finite[index] = finite
    if logprobs is not None:
        logprobs = SampleLogprobs(_scatter_rows(logprobs.token_logprob, index, num_rows),
                                  _scatter_rows(logprobs.top_ids, index, num_rows),
                                  _scatter_rows(logprobs.top_logprobs, index, num_rows))
    return StepSample(full_ids, logprobs, full_finite, errors)


def _scatter_rows(values: torch.Tensor, index: torch.Tensor, num_rows: int) -> torch.Tensor:
    """values [G, ...] placed at rows `index` of a zero tensor [num_rows, ...]."""
    out = values.new_zeros((num_rows, *values.shape[1:]))
    out[index] = values
    return out


def _inject_nan(logits: torch.Tensor, req_ids: list[str], ids: frozenset[str]) -> torch.Tensor:
    rows = [j for j, rid in enumerate(req_ids) if rid in ids]
    if not rows:
        return logits
    logits = logits.clone()
    logits[rows] = float("nan")
    return logits


def sample_random_logits(num_rows: int, vocab_size: int, device: torch.device) -> None:
    """One sampling pass over random fp32 logits [num_rows, vocab_size] with every filter on
    (temperature, top-p, top-k, min-p): the sampler's transients, for the memory plan's
    activation profile (the runner's profile_activation_peak)."""
    logits = torch.randn(num_rows, vocab_size, device=device, dtype=torch.float32)
    params = [SamplingParams(temperature=1.0, top_p=0.9, top_k=50, min_p=0.01)] * num_rows
    sample(logits, SamplingTensors.build(params, [0] * num_rows, [0] * num_rows, device))
