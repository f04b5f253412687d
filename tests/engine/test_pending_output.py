"""runner/pending_output.PendingOutput: a launched step's tokens, read on the host by result().

On CUDA the copy to the host is enqueued when the step is launched, so result() waits for that
step alone: in overlap scheduling it is called after the next step was launched on the same
stream, and must not wait for that one too (the GPU would idle while the host plans the step
after). On CPU there is nothing to copy.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moeserve.layers.sampler import SampleLogprobs
from moeserve.runner.pending_output import PendingOutput
from moeserve.types import SamplingParams


def pending(device: str) -> PendingOutput:
    p = PendingOutput(num_reqs=4, rows=np.array([0, 2, 3]))
    p.token_ids = torch.tensor([11, 12, 13], device=device)
    p.extra_token_ids = torch.tensor([[1, 2], [3, 4], [5, 6]], device=device)
    p.params = [SamplingParams(logprobs=1), SamplingParams(), SamplingParams(logprobs=2)]
    p.logprobs = SampleLogprobs(torch.tensor([-0.5, -1.0, -1.5], device=device),
                                torch.tensor([[11, 7], [12, 8], [13, 9]], device=device),
                                torch.tensor([[-0.5, -2.0], [-1.0, -3.0], [-1.5, -4.0]],
                                             device=device))
    return p


def check(out) -> None:
    assert out.sampled_token_ids == [11, -1, 12, 13]
    assert out.extra_token_ids == [[1, 2], [3, 4], [5, 6]]
    assert out.logprobs[1] is None and out.logprobs[2] is None  # row 2 asked for none
    assert out.logprobs[0].token_logprob == -0.5 and out.logprobs[0].top_token_ids == [11]
    assert out.logprobs[3].top_token_ids == [13, 9] and out.logprobs[3].top_logprobs == [-1.5, -4.0]


def test_cpu_result_without_copy() -> None:
    p = pending("cpu")
    p.start_copy()  # nothing to do on CPU
    check(p.result())


def test_nothing_sampled() -> None:
    p = PendingOutput(num_reqs=2, rows=np.array([], dtype=np.int64))
    p.start_copy()
    assert p.result().sampled_token_ids == [-1, -1]


@pytest.mark.gpu
def test_gpu_result_waits_for_its_step_only() -> None:
    p = pending("cuda")
    p.start_copy()
    torch.cuda._sleep(2_000_000_000)  # the next step: about a second of GPU work, enqueued after
    out = p.result()
    still_running = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    check(out)
    assert still_running, "result() waited for work enqueued after its step"
    assert p.token_ids.is_cuda  # the device tensor stays for the next step's placeholders


def _with_prompt_logprobs(p: PendingOutput, device: str) -> PendingOutput:
    """Two spans of the plan's prompt logprobs: row 1's entries 1-2 (top 1), row 3's entry 4
    (top 0)."""
    from moeserve.types import SchedulerOutput

    plan = SchedulerOutput(req_ids=["a", "b", "c", "d"], prompt_logprob_spans=[(1, 1, 2),
                                                                           (3, 4, 1)],
                           sampling_params=[SamplingParams(), SamplingParams(prompt_logprobs=1),
                                            SamplingParams(), SamplingParams(prompt_logprobs=0)])
    p.prompt_logprobs = (SampleLogprobs(torch.tensor([-0.1, -0.2, -0.3], device=device),
                                        torch.tensor([[5, 6], [7, 8], [9, 10]], device=device),
                                        torch.tensor([[-0.1, -2.0], [-0.2, -3.0], [-0.3, -4.0]],
                                                     device=device)), plan)
    return p


def _check_prompt(out) -> None:
    first, second = out.prompt_logprobs
    assert [e.top_token_ids for e in first] == [[5], [7]] and second[0].top_token_ids == []
    assert [e.token_logprob for e in first + second] == pytest.approx([-0.1, -0.2, -0.3])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_prompt_logprobs_come_back_with_and_without_sampled_rows(device: str) -> None:
    """A prefill chunk that samples nothing still returns its prompt logprobs (copied to the
    host at launch on CUDA, read after that step alone), as does a step that samples."""
    p = _with_prompt_logprobs(PendingOutput(num_reqs=4, rows=np.array([], dtype=np.int64)),
                              device)
    p.start_copy()
    out = p.result()
    assert out.sampled_token_ids == [-1] * 4
    _check_prompt(out)
    p = _with_prompt_logprobs(pending(device), device)
    p.start_copy()
    if device == "cuda":
        torch.cuda._sleep(1_000_000_000)  # a later step's work: result() must not wait for it
    out = p.result()
    check(out)
    _check_prompt(out)
