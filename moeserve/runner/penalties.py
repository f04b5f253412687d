"""The penalties: OpenAI's presence and frequency penalties and HF's / vLLM's repetition
penalty, from each penalized request's output-token counts, kept on the device and updated by
every sampling, so that they are exact under overlap scheduling (step N+1 is sampled after step
N's tokens were counted, in stream order, while the host has not seen them yet) and inside
multi-step decode plans (each sub-step's tokens counted before the next sub-step samples).

    logits[t] = logits[t] / r if > 0 else logits[t] * r    where t is in the prompt or
                                                              count[t] > 0 (r: repetition)
    logits[t] -= presence_penalty * (count[t] > 0) + frequency_penalty * count[t]

in that order (vLLM's), the presence and frequency over the request's generated tokens only,
in fp32 and rounded once to the logits' dtype, as logit_bias is (runner/step_sampling.py): a
penalty of p on a token equals a logit_bias of -p there. The prompt's tokens come once, in the
first plan that schedules the request (sched/penalty_prompts.py: a decode plan carries no
prompt), kept as a [V] bool until the request finishes.

`OutputCounts` holds one [V] int32 vector per penalized request that has sampled (V x 4
bytes: 620 KB at a 155k vocabulary), created at its first sampling, dropped when a plan names
the request among its finished ones (an id reused later starts from zero). A request
preempted by recompute keeps its outputs, so it keeps its counts. The counts live outside the
memory plan (1,024 penalized requests at a 155k vocabulary hold 635 MB): an allocation that
fails is a step out of memory, which the engine recovers from by preempting (engine/oom.py).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

from moeserve.kernels.attention.metadata import to_device
from moeserve.types import SamplingParams

# rows x vocabulary of a chunk's fp32 temporaries (512 MB each), as the sampler's random path
# bounds its own (layers/sampler.py): below the sampling transients the memory plan's profile
# measures, and freed before the sampler runs
_CHUNK_ELEMENTS = 1 << 27


def penalized(p: SamplingParams) -> bool:
    return (p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
            or p.repetition_penalty != 1.0)


class OutputCounts:
    """The penalized requests' output-token counts on the device (module doc)."""

    def __init__(self) -> None:
        self.counts: dict[str, torch.Tensor] = {}  # request id -> [V] int32 on the logits' device
        self.prompts: dict[str, torch.Tensor] = {}  # request id -> [V] bool: in its prompt

    def add_prompts(self, req_ids: list[str], prompts: list[tuple[int, list[int]]],
                    vocab_size: int, device: torch.device) -> None:
        """Keep the prompts of a plan's `penalty_prompts` (row, token ids) as [V] masks."""
        for row, ids in prompts:
            mask = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            mask[to_device(np.asarray(ids, dtype=np.int64), device)] = True
            self.prompts[req_ids[row]] = mask

    def _of(self, req_id: str, like: torch.Tensor) -> torch.Tensor:
        """req_id's counts, zeros [V] of like's width and device at its first sampling."""
        c = self.counts.get(req_id)
        if c is None:
            c = self.counts[req_id] = torch.zeros(like.shape[-1], dtype=torch.int32,
                                                  device=like.device)
        return c

    def apply_(self, logits: torch.Tensor, req_ids: list[str], params: list[SamplingParams],
               candidates: list[int] | None = None) -> list[int]:
        """The penalties of the penalized rows (among `candidates`, default all) applied to
        logits [R, V], in place; returns those rows (what `record` counts after sampling)."""
        rows = [j for j in (range(len(params)) if candidates is None else candidates)
                if penalized(params[j])]
        if not rows:
            return rows
        weights = to_device(np.array([[params[j].presence_penalty, params[j].frequency_penalty,
                                       params[j].repetition_penalty] for j in rows],
                                     dtype=np.float32), logits.device)  # [P, 3]
        index = to_device(np.asarray(rows, dtype=np.int64), logits.device)  # [P]
        step = max(1, _CHUNK_ELEMENTS // logits.shape[-1])
        for start in range(0, len(rows), step):  # [rows, V] temporaries of bounded size
            chunk = rows[start:start + step]
            counts = torch.stack([self._of(req_ids[j], logits) for j in chunk]).float()
            w = weights[start:start + step]
            at = index[start:start + step]
            x = logits[at].float()
            if any(params[j].repetition_penalty != 1.0 for j in chunk):
                seen = counts > 0
                for k, j in enumerate(chunk):
                    if req_ids[j] in self.prompts:
                        seen[k] |= self.prompts[req_ids[j]]
                r = w[:, 2:]
                x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
            penalty = (counts > 0).float().mul_(w[:, :1]).add_(counts.mul_(w[:, 1:2]))
            logits[at] = (x - penalty).to(logits.dtype)
        return rows

    def record(self, req_ids: list[str], rows: list[int], token_ids: torch.Tensor) -> None:
        """Count the tokens just sampled (token_ids [R], on the device) of the penalized rows
        `apply_` returned for the same step (their counts made there)."""
        one = None
        for j in rows:
            if one is None:
                one = torch.ones(1, dtype=torch.int32, device=token_ids.device)
            self.counts[req_ids[j]].index_add_(0, token_ids[j:j + 1], one)

    def release(self, req_ids: Iterable[str]) -> None:
        """Forget finished requests' counts. A plan names a request finished only after every
        sampling of it (the engine samples a step, deferred or not, before it launches the
        next), so none counts into a released request."""
        for r in req_ids:
            self.counts.pop(r, None)
            self.prompts.pop(r, None)
