"""One benchmark request as the client saw it: the record that metrics are computed from.

The client (client.py) fills a `RequestRecord` while the response streams; the metrics
(metrics.py) read only records, so every figure can be recomputed from a JSON results file.

Times are seconds. `start` is measured from the start of the timed run; `ttft`, `latency` and
`chunk_times` from the request's own start (taken right before the HTTP request is sent, after
the concurrency semaphore was acquired):

    run start ---- start ---- chunk_times[0] == ttft ---- chunk_times[1] ---- ... ---- latency
                   (send)     (first chunk with content)                       (last SSE line)

Only chunks with content are in `chunk_times`; `chunk_tokens[i]` is how many tokens chunk i
carried, counted from the stream itself (moeserve sends `token_ids` per chunk; other servers
count as one token per chunk).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class RequestRecord:
    """Per-request results; mutable while the request streams, read-only afterwards."""

    index: int  # position in the workload
    prompt_len: int  # the workload's prompt length (an estimate for text without a tokenizer)
    max_tokens: int  # the output length asked for
    success: bool = False
    error: str = ""
    status: int | None = None  # HTTP status, None when no response arrived
    start: float = 0.0  # send time, seconds since the timed run started
    ttft: float = 0.0  # to the first chunk with content, seconds since `start`
    latency: float = 0.0  # E2E: to the last SSE line, seconds since `start`
    chunk_times: list[float] = field(default_factory=list)  # content chunks, since `start`
    chunk_tokens: list[int] = field(default_factory=list)  # tokens in each content chunk
    usage_prompt_tokens: int | None = None  # the server's usage.prompt_tokens
    usage_completion_tokens: int | None = None  # the server's usage.completion_tokens
    worker: int = 0  # which client process sent it

    @property
    def streamed_tokens(self) -> int:
        """Output tokens counted from the stream by the client."""
        return sum(self.chunk_tokens)

    @property
    def output_len(self) -> int:
        """bench_serving's output length: the server's usage when given, else the stream's."""
        if self.usage_completion_tokens is not None:
            return self.usage_completion_tokens
        return self.streamed_tokens

    @property
    def prompt_tokens(self) -> int:
        """Input length: the server's usage.prompt_tokens when given, else the workload's."""
        if self.usage_prompt_tokens is not None:
            return self.usage_prompt_tokens
        return self.prompt_len

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready; times rounded to the microsecond."""
        return {
            "index": self.index, "prompt_len": self.prompt_len, "max_tokens": self.max_tokens,
            "success": self.success, "error": self.error, "status": self.status,
            "start": round(self.start, 6), "ttft": round(self.ttft, 6),
            "latency": round(self.latency, 6),
            "output_len": self.output_len, "streamed_tokens": self.streamed_tokens,
            "usage_prompt_tokens": self.usage_prompt_tokens,
            "usage_completion_tokens": self.usage_completion_tokens,
            "chunk_times": [round(t, 6) for t in self.chunk_times],
            "chunk_tokens": list(self.chunk_tokens), "worker": self.worker,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RequestRecord:
        """Inverse of `to_dict` (derived fields are recomputed, not read)."""
        names = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in d.items() if k in names})
