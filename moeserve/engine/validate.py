"""Request validation shared by the engine core and the API process (no torch here).

Every check names what is wrong, so the caller can return it as-is (a ValueError, HTTP 400).
"""

from __future__ import annotations

from moeserve.types import SamplingParams


def validate_request(prompt: list[int], params: SamplingParams, vocab_size: int,
                     max_model_len: int, eos_token_ids: tuple[int, ...] = ()) -> None:
    """Raise ValueError naming the first problem of a request; return None when it is servable."""
    if not isinstance(params, SamplingParams):
        raise ValueError(f"sampling params must be SamplingParams, got {type(params).__name__}")
    if not prompt:
        raise ValueError("the prompt is empty")
    if len(prompt) >= max_model_len:  # before the scan of the ids: a long prompt costs O(1)
        raise ValueError(f"the prompt has {len(prompt)} tokens; max_model_len is {max_model_len}, "
                         f"so a prompt may have at most {max_model_len - 1}")
    bad = next((t for t in prompt if not isinstance(t, int) or not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"prompt token id {bad!r} is outside the vocabulary [0, {vocab_size})")
    bad = next((t for t in params.stop_token_ids if t >= vocab_size), None)
    if bad is not None:
        raise ValueError(f"stop token id {bad} is outside the vocabulary [0, {vocab_size})")
    bad = next((t for t in params.allowed_token_ids or () if t >= vocab_size), None)
    if bad is not None:
        raise ValueError(f"allowed_token_ids has token id {bad}, outside the vocabulary "
                         f"[0, {vocab_size})")
    allowed = params.allowed_token_ids
    if allowed and params.min_tokens:
        stops = set(params.stop_token_ids) | set(() if params.ignore_eos else eos_token_ids)
        if stops.issuperset(allowed):
            raise ValueError(f"allowed_token_ids {list(allowed)} are all tokens that stop the "
                             f"request, which min_tokens={params.min_tokens} holds off: nothing "
                             "could be sampled")
    bad = next((t for t, _ in params.logit_bias if t >= vocab_size), None)
    if bad is not None:
        raise ValueError(f"logit_bias token id {bad} is outside the vocabulary [0, {vocab_size})")
    budget = params.reasoning_budget
    bad = None if budget is None else next(
        (t for t in (budget[0], budget[2]) if t >= vocab_size), None)
    if bad is not None:
        raise ValueError(f"the reasoning budget's token id {bad} is outside the vocabulary "
                         f"[0, {vocab_size})")
