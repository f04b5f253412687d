"""Text-side bookkeeping of requests: incremental detokenization and stop strings.

The engine core speaks token ids. This module, used by the offline LLM and by the API process
(engine/process/async_client.py), turns each step's new tokens into text deltas, finds stop strings,
and tells the caller which requests must be finished because a stop string appeared, or because
their detokenization failed: such a fault fails that request alone (FinishReason.ERROR).
"""

from __future__ import annotations

from moeserve import envs
from moeserve.detokenizer import IncrementalDetokenizer
from moeserve.tokenizer import Tokenizer
from moeserve.types import FinishReason, RequestOutput, SamplingParams


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._faults = envs.fault_injection().get("detokenize", frozenset())  # tests only

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams) -> None:
        self._detokenizers[request_id] = IncrementalDetokenizer(
            self.tokenizer, prompt_token_ids, params.skip_special_tokens, params.stop,
            params.min_tokens, params.include_stop_str_in_output)

    def process(self, outputs: list[RequestOutput]
                ) -> tuple[list[RequestOutput], list[str], list[str]]:
        """Fill in each output's `text` with this step's text delta. Returns the outputs, the
        ids whose stop string was just found and the ids whose detokenization just failed (the
        caller finishes both in the engine: stop and error)."""
        stopped: list[str] = []
        failed: list[str] = []
        for out in outputs:
            detok = self._detokenizers.get(out.request_id)
            if detok is None:
                continue
            try:
                if out.request_id in self._faults:
                    raise envs.InjectedFault("injected detokenizer fault")
                out.text = detok.add(_text_tokens(out, detok))
            except Exception as e:  # this request's fault: it fails, the others go on
                if not out.finished:
                    failed.append(out.request_id)
                out.text, out.finished, out.finish_reason = "", True, FinishReason.ERROR
                out.error = f"detokenization failed: {type(e).__name__}: {e}"
                del self._detokenizers[out.request_id]
                continue
            if detok.stop_hit is not None:
                if not out.finished:
                    stopped.append(out.request_id)
                out.finished, out.finish_reason = True, FinishReason.STOP
                out.stop_reason = detok.stop_hit
            if out.finished:
                out.text += detok.flush()
                del self._detokenizers[out.request_id]
        return outputs, stopped, failed

    def abort(self, request_id: str) -> None:
        self._detokenizers.pop(request_id, None)


def _text_tokens(out: RequestOutput, detok: IncrementalDetokenizer) -> list[int]:
    """The new tokens that become text: all of them, less the EOS or stop token that ended the
    request when special tokens are kept (its text is never part of the output)."""
    ids = out.new_token_ids
    if (not detok.skip_special_tokens and out.finished and ids
            and out.finish_reason is FinishReason.STOP and not isinstance(out.stop_reason, str)):
        return ids[:-1]
    return ids
