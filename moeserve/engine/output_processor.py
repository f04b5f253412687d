"""Text-side bookkeeping of requests: incremental detokenization and stop strings.

The engine core speaks token ids. This module, used by the offline LLM and by the API process
(engine/async_client.py), turns each step's new tokens into text deltas, finds stop strings,
and tells the caller which requests must be finished because a stop string appeared.
"""

from __future__ import annotations

from moeserve.detokenizer import IncrementalDetokenizer
from moeserve.tokenizer import Tokenizer
from moeserve.types import FinishReason, RequestOutput, SamplingParams


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams) -> None:
        self._detokenizers[request_id] = IncrementalDetokenizer(
            self.tokenizer, prompt_token_ids, stop=params.stop)

    def process(self, outputs: list[RequestOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Fill in each output's `text` with this step's text delta. Returns the outputs and the
        ids whose stop string was just found (the caller finishes those in the engine)."""
        stopped: list[str] = []
        for out in outputs:
            detok = self._detokenizers.get(out.request_id)
            if detok is None:
                continue
            out.text = detok.add(out.new_token_ids)
            if detok.stop_hit is not None:
                if not out.finished:
                    stopped.append(out.request_id)
                out.finished, out.finish_reason = True, FinishReason.STOP
                out.stop_reason = detok.stop_hit
            if out.finished:
                out.text += detok.flush()
                del self._detokenizers[out.request_id]
        return outputs, stopped

    def abort(self, request_id: str) -> None:
        self._detokenizers.pop(request_id, None)
