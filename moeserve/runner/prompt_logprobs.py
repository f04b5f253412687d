"""A step's prompt logprobs on the device (the plan's spans: sched/prompt_logprobs.py).

Entry k of a span's row is read from the hidden row of its position k - 1 in the step's flat
hidden states: logits of those rows, in row chunks whose fp32 temporaries stay within the
sampler's bound (as runner/penalties.py), then logprob = logit - logsumexp of the target
prompt[k] and of the top n (layers/sampler.token_logprobs: the raw model's, as the sampled
tokens' logprobs are). Enqueued right after the forward, before the next launch can overwrite a
graph's static output; `PendingOutput` copies them to the host with the sampled tokens.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from moeserve.kernels.attention.metadata import to_device
from moeserve.layers.sampler import SampleLogprobs, token_logprobs
from moeserve.types import Logprobs, SchedulerOutput

_CHUNK_ELEMENTS = 1 << 26  # rows x vocabulary of a chunk's fp32 logits (256 MB)


def prompt_logprobs_of(out: SchedulerOutput, hidden: torch.Tensor, last_token: np.ndarray,
                       compute_logits: Callable[[torch.Tensor], torch.Tensor],
                       vocab_size: int) -> tuple[SampleLogprobs, SchedulerOutput] | None:
    """The plan's prompt entries, [N] flat in span order, and the plan (None without spans).
    `hidden` holds the step's rows in plan order, row i's last token at `last_token[i]`."""
    spans = out.prompt_logprob_spans
    if not spans:
        return None
    index = np.concatenate([
        np.arange(first - 1, first - 1 + count) + (int(last_token[row]) + 1
                                                   - out.num_computed_tokens[row]
                                                   - out.num_scheduled_tokens[row])
        for row, first, count in spans])  # hidden row of position p: row start + p - start
    num = max(out.sampling_params[row].prompt_logprobs or 0 for row, _, _ in spans)
    index_d = to_device(index, hidden.device)
    targets = to_device(np.asarray(out.prompt_logprob_targets, dtype=np.int64), hidden.device)
    step = max(1, _CHUNK_ELEMENTS // vocab_size)
    parts = [token_logprobs(compute_logits(hidden[index_d[s:s + step]]), targets[s:s + step], num)
             for s in range(0, len(index), step)]
    return SampleLogprobs(*(torch.cat([getattr(p, f) for p in parts])
                            for f in ("token_logprob", "top_ids", "top_logprobs"))), out


def split_entries(out: SchedulerOutput, lps: SampleLogprobs) -> list[list[Logprobs]]:
    """Host tensors [N] -> each span's entries, each with its row's top n."""
    token_lp, top_ids, top_lps = (lps.token_logprob.tolist(), lps.top_ids.tolist(),
                                  lps.top_logprobs.tolist())
    result, at = [], 0
    for row, _first, count in out.prompt_logprob_spans:
        n = out.sampling_params[row].prompt_logprobs or 0
        result.append([Logprobs(token_lp[j], top_ids[j][:n], top_lps[j][:n])
                       for j in range(at, at + count)])
        at += count
    return result
