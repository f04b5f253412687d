"""Messages between the API server processes and the engine core process (msgspec over ZMQ).

    API process i --PUSH--> engine inbox (one, shared)  Hello | AddRequest | AbortRequests | Ping
                                                        | Shutdown
    API process i <--PUSH-- engine outbox i             Ready | StepOutputs | Pong | StartupFailed

The engine binds every socket; API process i connects to the inbox and to outbox i, and says
Hello(i) to get Ready. Each message names its client index, so the engine routes a request's
outputs back to the API process that sent it. One StepOutputs message carries every output of one
engine step for that client plus a stats snapshot, so the API side handles one message per step,
not one per token. Token ids only: text lives in the API processes.
"""

from __future__ import annotations

import msgspec

from moeserve.structured.spec import StructuredOutput
from moeserve.types import FinishReason, Logprobs, RequestOutput, SamplingParams


class WireSamplingParams(msgspec.Struct, array_like=True, omit_defaults=True):
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    logprobs: int | None = None
    structured: tuple[str, str, int | None] | None = None  # kind, spec, start_after
    reasoning_budget: tuple[int, int, int] | None = None  # end id, tokens, start id or -1
    logit_bias: list[tuple[int, float]] = []  # (token id, bias), sorted by id
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    prompt_logprobs: int | None = None
    repetition_penalty: float = 1.0
    allowed_token_ids: list[int] | None = None

    @classmethod
    def from_params(cls, p: SamplingParams) -> WireSamplingParams:
        # stop strings stay in the API process (the detokenizer finds them)
        s = p.structured
        return cls(p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p, p.seed,
                   list(p.stop_token_ids), p.ignore_eos, p.logprobs,
                   None if s is None else (s.kind, s.spec, s.start_after), p.reasoning_budget,
                   list(p.logit_bias), p.presence_penalty, p.frequency_penalty, p.min_tokens,
                   p.prompt_logprobs, p.repetition_penalty,
                   None if p.allowed_token_ids is None else list(p.allowed_token_ids))

    def to_params(self) -> SamplingParams:
        s = self.structured
        return SamplingParams(max_tokens=self.max_tokens, temperature=self.temperature,
                              top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                              seed=self.seed, stop_token_ids=tuple(self.stop_token_ids),
                              ignore_eos=self.ignore_eos, logprobs=self.logprobs,
                              structured=None if s is None else StructuredOutput(*s),
                              reasoning_budget=self.reasoning_budget,
                              logit_bias=tuple(tuple(e) for e in self.logit_bias),
                              presence_penalty=self.presence_penalty,
                              frequency_penalty=self.frequency_penalty,
                              min_tokens=self.min_tokens, prompt_logprobs=self.prompt_logprobs,
                              repetition_penalty=self.repetition_penalty,
                              allowed_token_ids=None if self.allowed_token_ids is None
                              else tuple(self.allowed_token_ids))


class Hello(msgspec.Struct, tag=True, array_like=True):
    client: int  # the API process's index; the engine answers Ready on its outbox


class AddRequest(msgspec.Struct, tag=True, array_like=True):
    request_id: str
    prompt_token_ids: list[int]
    params: WireSamplingParams
    client: int = 0


class AbortRequests(msgspec.Struct, tag=True, array_like=True):
    request_ids: list[str]
    reason: str = FinishReason.ABORT.value  # "stop" when the API side found a stop string


class Ping(msgspec.Struct, tag=True, array_like=True):
    seq: int
    client: int = 0


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    pass


ToEngine = Hello | AddRequest | AbortRequests | Ping | Shutdown


class WireLogprobs(msgspec.Struct, array_like=True):
    token_logprob: float
    top_token_ids: list[int]
    top_logprobs: list[float]


class WireOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | None = None
    logprobs: list[WireLogprobs] | None = None
    num_cached_tokens: int = 0
    error: str | None = None  # the request was refused (e.g. it failed validation)
    prompt_logprobs: list[WireLogprobs] | None = None

    @classmethod
    def from_output(cls, o: RequestOutput) -> WireOutput:
        stop = o.stop_reason if isinstance(o.stop_reason, int) else None
        return cls(o.request_id, o.new_token_ids, o.finished,
                   o.finish_reason.value if o.finish_reason else None, stop,
                   _to_wire(o.logprobs), o.num_cached_tokens, o.error,
                   _to_wire(o.prompt_logprobs))

    def to_output(self, prompt_token_ids: list[int]) -> RequestOutput:
        lps = _from_wire(self.logprobs)
        return RequestOutput(
            request_id=self.request_id, prompt_token_ids=prompt_token_ids,
            new_token_ids=self.new_token_ids, finished=self.finished,
            finish_reason=FinishReason(self.finish_reason) if self.finish_reason else None,
            stop_reason=self.stop_reason, logprobs=lps,
            num_cached_tokens=self.num_cached_tokens, error=self.error,
            prompt_logprobs=_from_wire(self.prompt_logprobs))


def _to_wire(lps: list[Logprobs] | None) -> list[WireLogprobs] | None:
    return None if lps is None else [
        WireLogprobs(lp.token_logprob, lp.top_token_ids, lp.top_logprobs) for lp in lps]


def _from_wire(lps: list[WireLogprobs] | None) -> list[Logprobs] | None:
    return None if lps is None else [
        Logprobs(lp.token_logprob, lp.top_token_ids, lp.top_logprobs) for lp in lps]


class EngineStats(msgspec.Struct, omit_defaults=False):
    """A snapshot of the engine after a step (for /metrics and /v1/engine)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    num_steps: int = 0
    num_preemptions: int = 0
    num_prefix_hit_tokens: int = 0
    num_prompt_tokens: int = 0  # cumulative tokens computed for prompts (incl. recompute)
    num_generated_tokens: int = 0
    num_aborted: int = 0
    num_failed: int = 0  # requests failed by a fault of their own (FinishReason.ERROR)
    num_refused: int = 0  # add requests refused by validation
    num_oom_steps: int = 0  # forwards that ran out of device memory (engine/oom.py recovered)
    num_structured: int = 0  # requests held to a grammar now (structured outputs)
    # steps sampled after the step in flight settled, for a grammar row's mask (one rank: the
    # forward enqueued first, overlap kept; several ranks: overlap lost on those steps)
    num_grammar_waits: int = 0
    # wall seconds of the last step. NOTE: a gauge read by a stats request (Ping) is answered
    # between steps, after the step it arrived in: long steps are over-represented in its
    # samples (length-biased); means over a run belong to the *_total counters below
    step_seconds: float = 0.0
    schedule_seconds: float = 0.0  # CPU seconds of the last step's schedule()
    # the engine loop's last busy iteration: all of it (step_seconds is its core.step()), the
    # requests and messages taken in before the step, the outputs sent after it
    loop_seconds: float = 0.0
    intake_seconds: float = 0.0
    send_seconds: float = 0.0
    # the same, summed over every busy iteration since start (counters: a run's share is the
    # difference of two snapshots; bench/engine_run.py)
    busy_loop_seconds_total: float = 0.0
    busy_step_seconds_total: float = 0.0
    busy_intake_seconds_total: float = 0.0
    busy_send_seconds_total: float = 0.0
    num_busy_iterations: int = 0
    # the latest sampled step profile (runner/step_profile.py); 0 until one is complete
    gpu_step_seconds: float = 0.0  # the model forward on the device
    attention_seconds: float = 0.0
    moe_seconds: float = 0.0
    # the latest eagerly run sampled step's collectives (tensor parallelism) and its whole
    # forward: their ratio is the step's communication share (graph replays have no breakdown)
    comm_seconds: float = 0.0
    eager_step_seconds: float = 0.0
    profiled_tokens: int = 0
    # the step profile's totals (counters, count-uniform: every Nth forward, whatever its length):
    # sampled forwards, their device seconds, and the wall seconds per forward of the engine
    # steps that ran them; wall / device is how much longer a step takes than its device work
    num_profiled_forwards: int = 0
    profiled_device_seconds_total: float = 0.0
    profiled_wall_seconds_total: float = 0.0
    num_forward_steps: int = 0  # model forwards (a multi-step decode plan runs several)
    # steps settled since start, and the latest of them that took engine/step_counters.py's
    # SLOW_STEP_SECONDS or more: [step number, wall seconds, prompt tokens, decode rows, tokens
    # generated]
    num_recorded_steps: int = 0
    slow_steps: list[tuple[int, float, int, int, int]] = []
    num_graph_steps: int = 0  # forward steps replayed from a CUDA graph
    num_mixed_graph_steps: int = 0  # mixed steps run through the piecewise graphs
    cuda_graph_fallbacks: int = 0  # decode batches run eagerly on CUDA (no graph fitted)
    # {"num_steps": forward steps, "tokens_per_expert": [[E ints] per MoE layer]}, cumulative;
    # read from the device only for Pong (on demand), kept by the client between pongs
    expert_load: dict | None = None


class StepOutputs(msgspec.Struct, tag=True, array_like=True):
    outputs: list[WireOutput]
    stats: EngineStats


class Ready(msgspec.Struct, tag=True, array_like=True):
    capacity_report: dict
    max_model_len: int
    max_running_requests: int
    vocab_size: int


class Pong(msgspec.Struct, tag=True, array_like=True):
    seq: int
    stats: EngineStats


class StartupFailed(msgspec.Struct, tag=True, array_like=True):
    error: str  # the exception's message, e.g. a ConfigError naming the bad field


FromEngine = Ready | StepOutputs | Pong | StartupFailed

_to_engine = msgspec.msgpack.Encoder()
_decode_to_engine = msgspec.msgpack.Decoder(ToEngine)
_decode_from_engine = msgspec.msgpack.Decoder(FromEngine)


def encode(msg: msgspec.Struct) -> bytes:
    return _to_engine.encode(msg)


def decode_to_engine(data: bytes) -> ToEngine:
    return _decode_to_engine.decode(data)


def decode_from_engine(data: bytes) -> FromEngine:
    return _decode_from_engine.decode(data)


API_PIDS_FILE = "api_pids"  # in the IPC folder (--api-servers): the API processes' pids


def ipc_addresses(ipc_dir: str, num_clients: int) -> tuple[str, list[str]]:
    """The engine's inbox and its outbox per API process, as ZMQ ipc:// addresses."""
    return (f"ipc://{ipc_dir}/to-engine",
            [f"ipc://{ipc_dir}/from-engine-{i}" for i in range(num_clients)])
