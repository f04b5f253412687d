"""The engine core: start-up (config -> weights -> memory plan -> scheduler) and the step loop.

    out = scheduler.schedule()          # pure Python: who runs, how many tokens, which blocks
    result = runner.execute(out)        # tensors, forward, sampling
    outputs = scheduler.update(out, result)   # append tokens, apply stops, free blocks

With `async_scheduling` the runner only launches step N+1 and the update is step N's: the CPU's
planning overlaps the device's work (DESIGN.md, overlap scheduling).

It deals in token ids only; text (tokenize, detokenize, stop strings) belongs to the caller: the
offline LLM or the API server. Every request is validated in `add_request`, so a bad request is
refused with a ValueError naming the problem and never reaches the step loop.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import platform
import random
import time

import torch

from moeserve.config import (
    ConfigError,
    EngineConfig,
    SchedulerConfig,
    load_model_config,
    resolve_max_running_requests,
    resolve_static,
)
from moeserve.engine.moe_setup import (
    ensure_quant_moe_tuned,
    moe_configs,
    moe_token_counts,
    quant_moe_configs,
)
from moeserve.engine.oom import OomRecovery
from moeserve.engine.step_counters import StepCounters
from moeserve.engine.structured_steps import StructuredSteps
from moeserve.engine.validate import validate_request
from moeserve.gc_tuning import freeze_heap
from moeserve.kernels.moe.tile_configs import tile_device_name
from moeserve.kernels.registry import TILED_MOE_BACKENDS
from moeserve.parallel.comm import TensorParallel
from moeserve.parallel.env import under_torchrun
from moeserve.parallel.executor import RankedRunner, start_ranks
from moeserve.parallel.layout import (
    RankLayout,
    check_devices,
    check_layout,
    quantized_split_breaks,
)
from moeserve.quant.packed import QuantWeight
from moeserve.runner.capacity import (
    CapacityReport,
    dsa_line,
    mla_decode_line,
    timed,
    weights_by_class,
)
from moeserve.runner.model_runner import ModelRunner
from moeserve.runner.pending_output import PendingOutput
from moeserve.sched import Request, Scheduler
from moeserve.types import FinishReason, RequestOutput, SamplingParams, SchedulerOutput

# backends whose decode path has no host sync and no host-dependent shapes
CAPTURABLE_ATTENTION = ("triton",)
CAPTURABLE_MOE = ("triton", "grouped_mm", "measured")  # grouped_mm: bf16 only
# the decode graphs' shared pool: the largest bucket's activations (~0.3 GiB at 2,048 rows of
# qwen3-30b-a3b), with room to spare
GRAPH_RESERVE_BYTES = 1 << 30


class EngineCore:
    """Owns the runner and the scheduler; `step()` advances every running request by one step."""

    def __init__(self, cfg: EngineConfig):
        phases: dict[str, float] = {}
        with timed(phases, "config"):
            self.model_config, preset = load_model_config(cfg.model, cfg.hf_overrides)
            self.cfg, resolved = resolve_static(cfg, self.model_config, preset,
                                                torch.cuda.is_available())
            cpu_threads, torch_threads, cores = self._init_torch_threads(resolved)
        device = torch.device(self.cfg.device)
        with timed(phases, "weights", device):
            self.runner = self._start_runner(preset)
        with timed(phases, "moe_tune", device):
            moe_tune = self._ensure_moe_tuned(device)
        with timed(phases, "profile", device):
            sched_cfg = self.cfg.scheduler
            budget = sched_cfg.max_num_batched_tokens
            cap = sched_cfg.max_running_requests
            rows = min(budget, cap if isinstance(cap, int) else sched_cfg.request_pool)
            peak = self._profile(min(budget, sched_cfg.max_model_len), rows,
                                 sched_cfg.max_model_len)
        with timed(phases, "kv_cache", device):
            plan = self.runner.plan_memory(self.cfg.cache, peak, self._graph_reserve(peak))
            self.runner.allocate_kv_caches(plan)
        sched_cfg = self._fit_max_model_len(sched_cfg, plan.num_kv_tokens, resolved)
        self.cfg = dataclasses.replace(self.cfg, scheduler=sched_cfg)
        self.max_running_requests, rule = resolve_max_running_requests(sched_cfg,
                                                                       plan.num_kv_tokens)
        self.scheduler = Scheduler(sched_cfg, plan.num_blocks, plan.block_size,
                                   self.max_running_requests,
                                   self.cfg.cache.enable_prefix_caching)
        with timed(phases, "warmup", device):
            self.runner.warmup(moe_token_counts(self.cfg, self.model_config),
                               sched_cfg.max_model_len)
        with timed(phases, "cuda_graphs", device):
            graphs_state = self._init_cuda_graphs(device, resolved)
        self.runner.reset_counters()  # warm-up and capture are not served load
        self.report = CapacityReport(
            model=self.cfg.model, architecture=self.model_config.architecture,
            num_params=self.model_config.num_params(),
            vocab_size=self.model_config.vocab_size, device_name=_device_name(device),
            engine_config=self.cfg, memory=plan,
            max_running_requests=self.max_running_requests, max_running_requests_rule=rule,
            resolved=resolved, phase_seconds=phases, cuda_graphs=graphs_state,
            moe_tune=moe_tune, cpu_threads=cpu_threads, torch_threads=torch_threads,
            usable_cores=cores,
            moe_configs=self._report_moe_configs(device),
            parallel=self._parallel_line(plan),
            kv_layout=self.runner.kv_layout(),
            mtp=self.runner.mtp_note, dsa=dsa_line(self.cfg, self.model_config),
            mla_prefill=self.cfg.mla_prefill if self.model_config.mla is not None else "",
            mla_decode=(mla_decode_line(self.cfg, device, self.runner.dtype)
                        if self.model_config.mla is not None else ""),
            checkpoint_format=self.runner.format_note, shared_experts=self.runner.shared_note,
            expert_layout=self.runner.layout_note,
            weights=weights_by_class(self.runner.model))
        self.counters = StepCounters()
        self._in_flight: tuple[SchedulerOutput, PendingOutput] | None = None  # async_scheduling
        # the last settled step, its profiled forwards and outputs (for _record_wall)
        self._settled: tuple[SchedulerOutput, tuple[int, ...], list[RequestOutput]] | None = None
        self.oom = OomRecovery(self.scheduler)
        self.structured = StructuredSteps(self.cfg, self.model_config)
        self._arrivals = itertools.count()
        self._seed_rng = random.Random(self.cfg.seed)
        freeze_heap()  # the model, the pool, the graphs: kept out of the step loop's GC passes

    def _start_runner(self, preset: bool) -> ModelRunner | RankedRunner:
        """This process's runner; with tensor_parallel_size > 1, rank 0's, every call mirrored
        on the other ranks (parallel/executor.py), which it starts."""
        folder = None if preset else self.cfg.model

        def build(tp: TensorParallel | None = None) -> ModelRunner:
            return ModelRunner(self.cfg, self.model_config, folder, tp)

        pc = self.cfg.parallel
        if pc.tensor_parallel_size == 1 and not pc.distributed_at_one_rank:
            return build()
        check_layout(self.model_config, RankLayout(pc.tensor_parallel_size, 0, pc.ep_size))
        if not under_torchrun():  # torchrun placed its processes itself
            device = torch.device(self.cfg.device)
            check_devices(pc.ranks_per_node, device.type,
                          torch.cuda.device_count() if device.type == "cuda" else 0)
        return start_ranks(self.cfg, build)

    def _moe_shape(self) -> tuple[int, int, int] | None:
        """This rank's experts as its w13 holds them, (experts, hidden, width): what its
        tiles are for (shared experts folded in count, fold_shared_experts)."""
        blocks = self.runner.model.moe_blocks()
        if not blocks or isinstance(blocks[0].w13, QuantWeight):  # not the bf16 kernel's tiles
            return None
        return (blocks[0].w13.shape[0], self.model_config.hidden_size,  # folded shared incl.
                blocks[0].w2.shape[-1])

    def _report_moe_configs(self, device: torch.device) -> dict[str, dict]:
        """The capacity report's MoE tiles: the bf16 kernel's (`moe_configs`), or for quantized
        experts on CUDA those of the fused quantized MoE (`quant_moe_configs`)."""
        blocks = self.runner.model.moe_blocks()
        if blocks and isinstance(blocks[0].w13, QuantWeight):
            if device.type != "cuda" or not self.model_config.num_experts:
                return {}  # the torch reference runs them: no tiles
            return quant_moe_configs(self.cfg, self.model_config, blocks[0], self.runner.dtype,
                                      tile_device_name(device))
        return moe_configs(self.cfg, self.model_config, self.runner.dtype,
                            tile_device_name(device), self._moe_shape(),
                            blocks[0].num_local_experts if blocks else 0,
                            self.model_config.num_experts_per_tok
                            + (blocks[0].folded_shared if blocks else 0))

    def _parallel_line(self, plan) -> str:
        """The capacity report's layout line: the split, and what each rank holds."""
        layout, mc = self.runner.layout, self.model_config
        if layout.world_size == 1:
            return ""
        local = self.runner.local_config
        cache = ("the latent cache whole on every rank" if mc.mla is not None else
                 f"{local.num_kv_heads} of {mc.num_kv_heads} KV heads a rank")
        line = (f"{layout.describe()}; each rank: weights {plan.weight_bytes / (1 << 30):.2f} "
                f"GiB, {plan.num_kv_tokens:,} KV tokens ({cache})")
        breaks = quantized_split_breaks(mc, layout)
        if breaks:  # held dequantized: each rank copies its slice of the dequantized weight
            q = mc.quantization
            group = 128 if q.format == "fp8" else q.group_size
            line += ("; splits that cut the checkpoint's scale groups (those weights held in "
                     f"{self.cfg.dtype}, dequantized at load): "
                     + "; ".join(b.line(q.format, group) for b in breaks))
        return line

    def close(self) -> None:
        """Stop the other ranks (a no-op on one rank) and the masks thread; the engine takes no
        steps after it."""
        self.structured.close()
        if isinstance(self.runner, RankedRunner):
            self.runner.shutdown()

    def _init_torch_threads(self, resolved: dict[str, str]) -> tuple[str, int, int]:
        """Set torch's CPU threads (torch_threads) and say them against the usable cores: on
        CPU that ratio, not the MoE's tokens per expert, is what moves throughput. The capacity
        report's line, the threads and the usable cores."""
        if self.cfg.torch_threads != "auto":
            torch.set_num_threads(int(self.cfg.torch_threads))
        threads = torch.get_num_threads()
        if self.cfg.torch_threads == "auto":
            resolved["torch_threads"] = "torch's default"
            self.cfg = dataclasses.replace(self.cfg, torch_threads=threads)
        cores = usable_cores()
        line = (f"{threads} torch threads, {cores} usable cores (of {os.cpu_count()} on the "
                "machine)")
        if threads > cores:
            line += ": more threads than cores, they contend (lower torch_threads)"
        return line, threads, cores

    def _ensure_moe_tuned(self, device: torch.device) -> str:
        """Tiles and backend picks for this MoE shape: committed, cached, or tuned now (once per
        device, shape and Triton version; resumable); none with moe_tiles=default. The
        capacity report's line."""
        mc = self.model_config
        if self.cfg.moe_backend not in TILED_MOE_BACKENDS or not mc.num_experts:
            return ""
        blocks = self.runner.model.moe_blocks()
        if blocks and isinstance(blocks[0].w13, QuantWeight):
            return ensure_quant_moe_tuned(self.cfg, mc, blocks[0], self.runner.dtype, device)
        if self.cfg.moe_tiles == "default":
            return ("not tuned: moe_tiles=default (the in-code default tiles at every batch "
                    "size, no tuned file read)")
        if device.type != "cuda":
            return ""
        from moeserve.kernels.moe.tile_configs import find_tuned
        from moeserve.kernels.moe.tune import ensure_tuned

        shape = self._moe_shape()
        if self.cfg.moe_tune_budget_s == 0:
            found = find_tuned(*shape, self.runner.dtype, tile_device_name(device))
            return ("not tuned at start-up (moe_tune_budget_s=0): "
                    + (f"using {found[0]}" if found else "default tiles"))
        block = self.runner.model.moe_blocks()[0]
        outcome = ensure_tuned(*shape, mc.num_experts_per_tok + block.folded_shared,
                               self.runner.dtype,
                               self.cfg.scheduler.max_num_batched_tokens,
                               time_budget_s=self.cfg.moe_tune_budget_s,
                               weights=(block.w13, block.w2),
                               device_name=tile_device_name(device))
        torch.cuda.empty_cache()
        return f"{outcome.detail} ({outcome.source}, {outcome.seconds:.1f}s)"

    def _init_cuda_graphs(self, device: torch.device, resolved: dict[str, str]) -> str:
        """Capture the decode graphs, buckets up to the largest decode batch; the capacity
        report's line (why they are off, when they are)."""
        cfg = self.cfg
        if device.type != "cuda":
            return "off: CPU (CUDA graphs need a GPU)"
        if cfg.enforce_eager:
            return "off: enforce_eager"
        if (self.model_config.dsa is not None and cfg.dsa != "dense"
                and cfg.attention_backend != "triton"):
            return (f"off: DeepSeek Sparse Attention on attention backend "
                    f"{cfg.attention_backend!r} runs its torch references, which sync with the "
                    "host; the triton backend's DSA kernels (or dsa='dense') can be captured")
        if cfg.attention_backend not in CAPTURABLE_ATTENTION:
            return (f"off: attention backend {cfg.attention_backend!r} cannot be captured "
                    f"(use {', '.join(CAPTURABLE_ATTENTION)})")
        if self.model_config.num_experts and (
                cfg.moe_backend not in CAPTURABLE_MOE
                or (cfg.moe_backend == "grouped_mm" and cfg.dtype != "bfloat16")):
            return (f"off: MoE backend {cfg.moe_backend!r} in {cfg.dtype} cannot be captured "
                    "(triton can; grouped_mm only in bf16: other dtypes sync with the host)")
        decode_bound = min(self.max_running_requests, cfg.scheduler.max_num_batched_tokens)
        max_batch = cfg.cuda_graph_max_batch_size
        if max_batch == "auto":
            max_batch = decode_bound
            resolved["cuda_graph_max_batch_size"] = (
                f"min(max_running_requests {self.max_running_requests}, token budget "
                f"{cfg.scheduler.max_num_batched_tokens}): every decode batch has a graph")
        max_batch = min(int(max_batch), decode_bound)
        state = self.runner.init_decode_graphs(max_batch, cfg.scheduler.max_model_len)
        if cfg.mixed_cuda_graphs:
            state += "; mixed steps " + self.runner.init_mixed_graphs(
                cfg.scheduler.max_num_batched_tokens)
        return state

    def _profile(self, num_tokens: int, num_sample_rows: int, context_len: int) -> int:
        """The activation peak (runner.profile_activation_peak); a profile that runs out of
        device memory is a configuration no request at max_model_len could be served under:
        a ConfigError naming the step and the two settings that shrink it."""
        try:
            return self.runner.profile_activation_peak(num_tokens, num_sample_rows, context_len)
        except torch.OutOfMemoryError as e:
            raise ConfigError(
                f"the memory plan's profile step ({num_tokens} tokens at the end of a "
                f"{context_len}-token context) ran out of device memory beside the weights: "
                f"lower max_model_len ({context_len}) or max_num_batched_tokens ({num_tokens}) "
                f"({str(e).splitlines()[0]})") from e

    def _graph_reserve(self, activation_peak: int) -> int:
        """Bytes the memory plan leaves to CUDA graphs: the decode graphs' pool; with mixed
        graphs, also their pool (one piece's intermediates, at most a forward's activation
        peak) and static buffers (estimated at 16 hidden widths a token of the budget; the
        capacity report states what the capture took)."""
        if self.cfg.enforce_eager:
            return 0
        reserve = GRAPH_RESERVE_BYTES
        if self.cfg.mixed_cuda_graphs:
            width = 16 * self.model_config.hidden_size * self.runner.dtype.itemsize
            reserve += activation_peak + self.cfg.scheduler.max_num_batched_tokens * width
        return reserve

    def _fit_max_model_len(self, sched_cfg: SchedulerConfig, num_kv_tokens: int,
                           resolved: dict[str, str]) -> SchedulerConfig:
        """One request must fit in the whole KV cache, or preemption could never make room."""
        if sched_cfg.max_model_len <= num_kv_tokens:
            return sched_cfg
        if "max_model_len" not in resolved:
            raise ConfigError(f"max_model_len {sched_cfg.max_model_len} exceeds the KV cache's "
                              f"{num_kv_tokens} tokens: lower max_model_len or give the KV cache "
                              "more memory (mem_fraction, cpu_kv_cache_bytes, num_blocks)")
        resolved["max_model_len"] = f"capped by the KV cache's {num_kv_tokens} tokens"
        return dataclasses.replace(sched_cfg, max_model_len=num_kv_tokens)

    # ---- requests ------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams) -> None:
        """Queue a request; raise ValueError naming what is wrong (nothing is queued then)."""
        self._validate(request_id, prompt_token_ids, params)
        self.structured.add(request_id, params)  # a grammar that does not compile: refused
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(62)
        self.scheduler.add_request(Request(
            request_id=request_id, prompt_token_ids=list(prompt_token_ids),
            sampling_params=params, eos_token_ids=self.model_config.eos_token_ids, seed=seed,
            arrival_seq=next(self._arrivals)))

    def _validate(self, request_id: str, prompt: list[int], params: SamplingParams) -> None:
        if self.scheduler.has_request(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        validate_request(prompt, params, self.model_config.vocab_size,
                         self.cfg.scheduler.max_model_len, self.model_config.eos_token_ids)

    def abort(self, request_ids: list[str], reason: FinishReason = FinishReason.ABORT) -> None:
        """Finish requests now (abort, or a stop string found by the caller); frees their KV."""
        self.scheduler.finish_requests(request_ids, reason)
        self.structured.drop(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self._in_flight is not None

    # ---- the loop ------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One step: schedule, execute, update. With async_scheduling, the update is that of the
        previous launch, so the CPU plans and launches step N+1 while the device runs step N.
        A grammar row of N+1 needs its token of N for its mask: N+1's forward is launched, N
        settles while it runs, N+1's masks are built on the masks thread while the loop goes
        on, and N+1 is sampled at the next step, before N+2 launches on its tokens
        (engine/structured_steps.py; on several ranks, which sample as they launch, N settles
        before N+1 is launched)."""
        start = time.perf_counter()
        out = self.scheduler.schedule()
        self.counters.schedule_seconds = time.perf_counter() - start
        if out.num_reqs == 0 and not self.cfg.async_scheduling:
            return []
        settled: list[RequestOutput] = []
        if self.structured.deferred:  # the step in flight is sampled first: `out` reads it
            deferred, settled = self.structured.finish(self.scheduler)
            assert self._in_flight is not None and self._in_flight[0] is deferred
            try:
                self.runner.sample_deferred(self._in_flight[1], deferred)
            except torch.OutOfMemoryError as e:  # `out` was planned on its tokens
                self._in_flight = None
                return settled + self._out_of_memory(e, [deferred, out], False)
        ranked_wall = False  # the settled step's wall is recorded after this launch
        late = self._in_flight is not None and self.structured.needs_tokens(out)
        if late and isinstance(self.runner, RankedRunner):
            late, (previous, self._in_flight) = False, (self._in_flight, None)
            self.structured.num_overlap_waits += 1
            try:
                settled += self._update(*previous, start, timed=False)
            except torch.OutOfMemoryError as e:  # the step in flight failed; `out` ran on it
                return settled + self._out_of_memory(e, [previous[0], out], False)
            ranked_wall = True
        if not late:
            settled += self.structured.prepare(out, self.scheduler)
        stage = "launch"
        try:  # an out-of-memory forward: its requests preempted (engine/oom.py)
            pending = (None if not out.num_reqs else self.runner.launch(out, defer_sampling=True)
                       if late else self.runner.launch(out))
            if late:
                previous, self._in_flight = self._in_flight, None
                self.structured.num_overlap_waits += 1
                stage = "previous"
                settled += self._update(*previous, start)
                self.structured.begin(out)  # sampled at the next step, under these masks
        except torch.OutOfMemoryError as e:
            if stage == "previous":  # the step before failed: this one ran on its tokens
                return settled + self._out_of_memory(e, [previous[0], out], False)
            return settled + self._out_of_memory(e, [out], True)  # an older step stands
        if ranked_wall:
            self._record_wall(start)
        launched = None if pending is None else (out, pending)
        previous = launched
        if self.cfg.async_scheduling:
            previous, self._in_flight = self._in_flight, launched
        if previous is None:
            return settled
        try:
            return settled + self._update(*previous, start)
        except torch.OutOfMemoryError as e:  # a step in flight ran on this one's tokens
            return settled + self._out_of_memory(e, [previous[0]], False)

    def _update(self, out: SchedulerOutput, pending: PendingOutput, start: float,
                timed: bool = True) -> list[RequestOutput]:
        """A launched step's tokens into the scheduler, then through the grammars. `timed`:
        its wall (from `start`: the loop iteration that settles it) is recorded now; else the
        caller records it (`_record_wall`) once the iteration's work is done, a deferred
        sampling's masks included, so the wall is the loop's period either way."""
        result = pending.result()
        outputs = self.structured.settle(self.scheduler.update(out, result), self.scheduler)
        self._settled = (out, result.profiled_forwards, outputs)
        if timed:
            self._record_wall(start)
        return outputs

    def _record_wall(self, start: float) -> None:
        assert self._settled is not None
        out, profiled_forwards, outputs = self._settled
        seconds = time.perf_counter() - start
        self.counters.record(out, outputs, seconds)
        if profiled_forwards:  # the step profile's timed forwards: this step's wall
            self.runner.profiler.add_step_wall(profiled_forwards, seconds / out.num_steps)

    def _out_of_memory(self, error: torch.OutOfMemoryError, failed: list[SchedulerOutput],
                       in_flight_is_older: bool) -> list[RequestOutput]:
        """OomRecovery over the failed steps and the one in flight; ranks in lockstep cannot
        recover one rank's failure: the error stands there."""
        if isinstance(self.runner, RankedRunner):
            raise error
        in_flight, self._in_flight = self._in_flight, None
        return self.structured.settle(self.oom.recover(error, failed, in_flight,
                                                       in_flight_is_older), self.scheduler)


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity), else the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine()

