"""The offline API: `LLM(model_or_preset, **engine_args).generate(prompts, SamplingParams(...))`.

Runs the engine core in-process. Prompts are text (tokenized here) or token-id lists; `chat`
renders conversations through the chat template first. Besides `generate`, `add_request` /
`step` expose the loop so callers can interleave arrivals with steps; a bad request raises
ValueError from `add_request` and the others carry on.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from moeserve.engine.args import engine_config_from_kwargs
from moeserve.engine.core import EngineCore
from moeserve.engine.output_processor import OutputProcessor
from moeserve.hf_config.generation import sampling_defaults
from moeserve.tokenizer import Tokenizer, load_model_tokenizer
from moeserve.types import FinishReason, Logprobs, RequestOutput, SamplingParams

Prompt = str | list[int]


@dataclass(slots=True)
class CompletionOutput:
    """One request's whole result, as `generate` returns it."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    logprobs: list[Logprobs] = field(default_factory=list)
    num_cached_tokens: int = 0
    error: str | None = None  # what failed, when finish_reason is ERROR (a fault of its own)
    prompt_logprobs: list[Logprobs | None] | None = None
    """With SamplingParams.prompt_logprobs: one per prompt token, None for the first (vLLM's)."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class LLM:
    def __init__(self, model: str = "tiny-moe", **engine_args: object):
        cfg = engine_config_from_kwargs(model=model, **engine_args)
        # the model's generation_config.json: the params of a call that gives none (read
        # before the engine starts, so a bad file or folder fails with nothing to stop)
        self.sampling_defaults = sampling_defaults(cfg.model, cfg.generation_config)
        self.engine = EngineCore(cfg)
        cfg, mc = self.engine.cfg, self.engine.model_config
        self.tokenizer: Tokenizer = load_model_tokenizer(cfg.model, cfg.tokenizer, mc)
        self._outputs = OutputProcessor(self.tokenizer)
        self._results: dict[str, CompletionOutput] = {}
        self._ids = itertools.count()

    def close(self) -> None:
        """Stop the engine's other ranks (tensor_parallel_size > 1); nothing to do on one."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def report(self):  # the capacity report
        return self.engine.report

    def default_params(self) -> SamplingParams:
        """SamplingParams of the model's defaults (generation_config.json's, unless
        generation_config is "none"; moeserve's own for the rest), as vLLM's LLM takes them."""
        return SamplingParams(**self.sampling_defaults)

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue one request; ValueError names what is wrong, and nothing is queued then."""
        params = params or self.default_params()
        if isinstance(prompt, str):
            prompt_ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)):
            prompt_ids = list(prompt)
        else:
            raise ValueError(f"a prompt must be text or a list of token ids, "
                             f"got {type(prompt).__name__}")
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        self.engine.add_request(request_id, prompt_ids, params)
        self._outputs.add_request(request_id, prompt_ids, params)
        self._results[request_id] = CompletionOutput(request_id, prompt_ids)
        return request_id

    def abort(self, request_id: str) -> None:
        self.engine.abort([request_id])
        self._outputs.abort(request_id)
        result = self._results.get(request_id)
        if result is not None and not result.finished:
            result.finish_reason = FinishReason.ABORT

    def step(self) -> list[RequestOutput]:
        """One engine step; returns this step's per-request deltas (text filled in)."""
        outputs, stopped, failed = self._outputs.process(self.engine.step())
        if stopped:
            self.engine.abort(stopped, FinishReason.STOP)
        if failed:
            self.engine.abort(failed, FinishReason.ERROR)
        for out in outputs:
            result = self._results[out.request_id]
            result.token_ids += out.new_token_ids
            result.text += out.text
            result.logprobs += out.logprobs or []
            if out.prompt_logprobs is not None:
                result.prompt_logprobs = (result.prompt_logprobs or [None]) + out.prompt_logprobs
            result.num_cached_tokens = out.num_cached_tokens
            if out.finished:
                result.finish_reason, result.stop_reason = out.finish_reason, out.stop_reason
                result.error = out.error
        return outputs

    def result(self, request_id: str) -> CompletionOutput:
        return self._results[request_id]

    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished_requests()

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 ) -> list[CompletionOutput]:
        """Run the prompts to completion; results in the prompts' order.

        A bad prompt raises ValueError naming its index and the problem; the prompts queued
        before it are withdrawn, so nothing of the call stays in the engine."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts
                                        and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or self.default_params()
        params_list = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params_list)} sampling params")
        ids = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params_list)):
                try:
                    ids.append(self.add_request(prompt, p))
                except ValueError as e:
                    raise ValueError(f"prompt {i}: {e}") from e
        except ValueError:
            for rid in ids:
                self.abort(rid)
                self._results.pop(rid)
            raise
        while any(not self._results[rid].finished for rid in ids):
            self.step()
        return [self._results.pop(rid) for rid in ids]

    def chat(self, conversations: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
             tools: list[dict[str, Any]] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[CompletionOutput]:
        """Each conversation (one, or a list of them) rendered by the tokenizer's chat template
        with the assistant's turn opened, then `generate`. Messages, `tools` and the template
        variables are given as transformers takes them (a call's arguments as a mapping). The
        replies are the model's raw text: the server parses tool calls and reasoning out of
        them (server/agent/). A template that refuses a conversation raises ValueError naming
        it."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]  # type: ignore[list-item]
        prompts: list[Prompt] = []
        for i, messages in enumerate(conversations):
            try:
                text = self.tokenizer.apply_chat_template(
                    list(messages), True, tools, **(chat_template_kwargs or {}))
            except ValueError as e:
                raise ValueError(f"conversation {i}: {e}") from e
            prompts.append(self.tokenizer.encode(text, add_special_tokens=False))
        return self.generate(prompts, sampling_params)
