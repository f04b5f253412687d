"""The model runner: the only place that turns the scheduler's ints into tensors.

Per step: SchedulerOutput (lists) -> input ids, positions, slot mapping, block tables (numpy,
vectorised, one host-to-device copy each) -> model forward -> logits of the rows that sample ->
sampler -> ModelOutput (lists). It also owns the weights (loaded or dummy), the KV cache tensors and
the activation profile that the memory plan needs. Decode steps (every row one token) replay a
CUDA graph of runner/cuda_graphs.py when one fits the batch; mixed steps, when enabled, replay the
piecewise graphs of runner/mixed_graphs.py (attention eager between captured pieces); everything
else runs eagerly, and a decode batch run eagerly on CUDA is counted
(`num_eager_decode_fallbacks`).
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable

import numpy as np
import torch

from moeserve import envs
from moeserve.config import CacheConfig, EngineConfig
from moeserve.kernels.attention.metadata import build_attention_metadata, to_device
from moeserve.kernels.attention.mla.up_projected import memory_probe
from moeserve.kernels.registry import get_attention_backend, get_mla_backend, get_moe_backend
from moeserve.layers.moe import fold_shared_experts, tile_experts
from moeserve.model_config import ModelConfig, read_json_config
from moeserve.models import build_model
from moeserve.parallel.comm import TensorParallel
from moeserve.parallel.layout import RankLayout, local_model_config
from moeserve.quant.packed import QuantWeight, compact_fp8_scales
from moeserve.quant.plan import DUMMY_INT4_GROUP, QuantPlan
from moeserve.quant.spec import flag_format
from moeserve.runner.cuda_graphs import DecodeGraphs, graph_batch_sizes
from moeserve.runner.kv_cache import (
    LayerCache,
    MemoryPlan,
    allocate_kv_caches,
    cache_dtype,
    kv_layout,
    plan_memory,
    profile_step,
)
from moeserve.runner.mixed_graphs import MixedGraphs, mixed_token_buckets
from moeserve.runner.penalties import OutputCounts
from moeserve.runner.pending_output import PendingOutput
from moeserve.runner.prompt_logprobs import prompt_logprobs_of
from moeserve.runner.step_profile import StepProfiler
from moeserve.runner.step_sampling import GrammarMask, sample_random_logits, sample_step
from moeserve.runner.warmup import warm_up
from moeserve.runner.weights.loader import (
    checkpoint_plan,
    init_dummy_weights,
    load_weights,
    model_weight_bytes,
)
from moeserve.types import ModelOutput, SchedulerOutput


class ModelRunner:
    """Builds the model, holds the KV cache, runs one step at a time."""

    def __init__(self, cfg: EngineConfig, model_config: ModelConfig, weights_folder: str | None,
                 tp: TensorParallel | None = None):
        """tp: this rank's shard and collectives under tensor / expert parallelism (None: the
        whole model on this process)."""
        self.cfg = cfg
        self.model_config = model_config
        self.tp = tp
        self.layout = tp.layout if tp is not None else RankLayout()
        self.local_config = local_model_config(model_config, self.layout)  # the rank's shapes
        self.device = torch.device(cfg.device)
        self.output_counts = OutputCounts()  # the penalized requests' (runner/penalties.py)
        self.dtype = getattr(torch, cfg.dtype)
        self.kv_dtype = cache_dtype(cfg.cache, self.dtype)  # DSA's indexer keys: self.dtype
        self.block_size = cfg.cache.block_size
        self.kv_caches: list[LayerCache] = []
        # DSA models: the indexer key cache exists unless dsa="dense" (no indexer runs then)
        self.indexer_cache = cfg.dsa != "dense"
        self._last: tuple[PendingOutput, dict[str, int]] | None = None  # the latest launch
        self._defer_sampling = False  # the current launch's (launch's argument)
        self.graphs: DecodeGraphs | None = None
        self.num_eager_decode_fallbacks = 0  # decode batches run without a graph (CUDA only)
        self._load_copy: tuple[torch.Tensor, torch.cuda.Event, int] | None = None
        self._load_snapshot: dict | None = None
        self.num_graph_steps = 0
        self.mixed_graphs: MixedGraphs | None = None
        self.num_mixed_graph_steps = 0  # mixed steps run through the piecewise graphs
        self.faults = envs.fault_injection()  # {} unless a test injects faults
        self.oom_fired: set[str] = set()  # the oom_once faults raised
        self.step_delay_s = max((float(ms) / 1e3 for ms in self.faults.get("slow_step", ())),
                                default=0.0)
        self._init_model(weights_folder)

    def _init_model(self, weights_folder: str | None) -> None:
        mc = self.model_config
        plan = self._quant_plan(weights_folder)
        if plan is not None and self.cfg.dequantize_linears:  # the routed experts alone
            plan = dataclasses.replace(plan, experts_only=True)
        self.model = build_model(mc, self.dtype, self.device,
                                 get_moe_backend(self.cfg.moe_backend, self.cfg.moe_tiles),
                                 get_attention_backend(self.cfg.attention_backend),
                                 get_mla_backend(self.cfg.attention_backend),
                                 dsa_mode=self.cfg.dsa, tp=self.tp, quant=plan,
                                 mla_prefill=self.cfg.mla_prefill,
                                 mla_decode=self.cfg.mla_decode)
        self.mtp_note = ""  # the capacity report's line on the checkpoint's layers not run
        self.format_note = ""  # ... and on a quantized checkpoint's weights
        if self.cfg.load_format == "dummy":
            init_dummy_weights(self.model, self.cfg.seed)
            if plan is not None:
                self.format_note = f"dummy weights in {plan.describe()}"
        else:
            left_out, dequantized, kept = load_weights(
                self.model, mc, weights_folder, checkpoint_layers=self._checkpoint_layers,
                layout=self.layout)
            if plan is not None and mc.quantization is None:
                self.format_note = (f"{plan.describe()}: the checkpoint's {mc.checkpoint_dtype} "
                                    "projections quantized as they loaded (--quantization)")
            elif plan is not None and (kept or dequantized):
                self.format_note = f"{plan.describe()}: {kept} checkpoint weights kept quantized"
                if dequantized:  # MLA's kv_b_proj; a fused weight with an unquantized part
                    self.format_note += (f", {dequantized} held dequantized in "
                                         f"{self.cfg.dtype} (see weights by class)")
            elif mc.quantization is not None:
                self.format_note = (f"config.json declares {mc.quantization.format} but the "
                                    "checkpoint holds no quantized tensors: loaded as stored")
            layers = self._checkpoint_layers
            if left_out:
                parts = [f"{mc.mtp_layers} MTP layer(s): kept for speculative decoding later"
                         ] if mc.mtp_layers else []
                if layers > mc.num_layers:
                    parts.append(f"layers {mc.num_layers}..{layers - 1} cut by hf_overrides")
                self.mtp_note = f"{left_out} tensors left out: {'; '.join(parts)}"
        for m in self.model.modules():  # FP8 scales in the checkpoint's row blocks, where
            if isinstance(m, QuantWeight):  # each 128 rows share them
                compact_fp8_scales(m)
        self.shared_note = (fold_shared_experts(self.model.moe_blocks())
                            if self.cfg.fold_shared_experts else "")  # the report's line
        self.layout_note = tile_experts(self.model.moe_blocks(), self.cfg.moe_weight_layout,
                                        self.device)  # 4-bit experts micro-tiled: the line
        self.model.eval()
        self.weight_bytes = model_weight_bytes(self.model)
        self.num_forward_steps = 0
        self.profiler = (StepProfiler(self.model, self.device, self.cfg.step_profile_every)
                         if self.cfg.step_profile_every > 0 else None)
        self.expert_counts: torch.Tensor | None = None  # [moe layers, E] int64 on the device
        if self.cfg.collect_expert_load and self.model.moe_blocks():
            self.expert_counts = torch.zeros(len(self.model.moe_blocks()),
                                             self.model_config.num_experts, dtype=torch.int64,
                                             device=self.device)

    def _quant_plan(self, weights_folder: str | None) -> QuantPlan | None:
        """Which weights are held quantized: from the checkpoint's tensors, or, for dummy
        weights, every quantizable one in the format `--quantization` (or the config) names."""
        mc, cfg = self.model_config, self.cfg
        self._checkpoint_layers = mc.num_layers
        if cfg.load_format == "dummy":
            fmt = flag_format(cfg.quantization) if cfg.quantization is not None else None
            spec = mc.quantization
            if fmt is None:
                return QuantPlan.from_spec(spec) if spec is not None else None
            if spec is not None and spec.format == fmt:
                return QuantPlan.from_spec(spec)
            return QuantPlan(fmt, DUMMY_INT4_GROUP if fmt == "int4" else None)
        assert weights_folder is not None, "safetensors load_format needs a checkpoint folder"
        self._checkpoint_layers = read_json_config(
            os.path.join(weights_folder, "config.json")).get("num_hidden_layers", mc.num_layers)
        if mc.quantization is None and cfg.quantization is not None:  # quantized as it loads
            fmt = flag_format(cfg.quantization)
            return QuantPlan(fmt, DUMMY_INT4_GROUP if fmt == "int4" else None)
        return checkpoint_plan(mc, weights_folder, self._checkpoint_layers, self.layout)

    def expert_load(self) -> dict | None:
        """Tokens routed to each expert of each MoE layer since start-up, and over how many
        forward steps (one host sync: call it on demand, not per step)."""
        if self.expert_counts is None:
            return None
        return {"num_steps": self.num_forward_steps,
                "tokens_per_expert": self.expert_counts.tolist()}

    def expert_load_async(self) -> dict | None:
        """`expert_load` without a host sync (for a busy engine): starts a copy of the counters
        to pinned host memory and returns the latest copy that has completed, one call stale;
        None until the first completes. On CPU it is `expert_load`."""
        if self.expert_counts is None or self.device.type != "cuda":
            return self.expert_load()
        if self._load_copy is not None:
            host, event, steps = self._load_copy
            if not event.query():
                return self._load_snapshot  # the copy is still queued behind running steps
            self._load_snapshot = {"num_steps": steps, "tokens_per_expert": host.tolist()}
        host = torch.empty(self.expert_counts.shape, dtype=torch.int64, pin_memory=True)
        host.copy_(self.expert_counts, non_blocking=True)  # after every step launched so far
        event = torch.cuda.Event()
        event.record()
        self._load_copy = (host, event, self.num_forward_steps)
        return self._load_snapshot

    # ---- memory --------------------------------------------------------------------------

    @torch.inference_mode()
    def profile_activation_peak(self, num_tokens: int, num_sample_rows: int,
                                context_len: int) -> int:
        """Peak bytes above the weights of one forward over `num_tokens` prompt tokens at the end
        of a `context_len`-token context (kv_cache.profile_step) and one sampling pass over
        `num_sample_rows` rows. Only meaningful on CUDA; returns 0 on CPU, whose KV cache has
        its own byte budget."""
        if self.device.type != "cuda":
            return 0
        out, num_blocks = profile_step(num_tokens, context_len, self.block_size)
        plan = MemoryPlan(str(self.device), 0, 0, 0, 0, 0, 0, 0, num_blocks, self.block_size, "")
        self.allocate_kv_caches(plan)
        self.model.bind_expert_counters(None)  # the profile is not served load
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        with memory_probe():  # MLA's long rows: their first two chunks, the same peak
            self.execute(out)
        sample_random_logits(num_sample_rows, self.model_config.vocab_size, self.device)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - base
        self.bind_kv_caches([])
        torch.cuda.empty_cache()
        return int(peak)

    def plan_memory(self, cache: CacheConfig, activation_peak: int,
                    graph_reserve: int) -> MemoryPlan:
        """This rank's memory plan: the KV blocks that fit beside its weights (its local
        shapes: a rank's share of the KV heads)."""
        return plan_memory(self.local_config, cache, self.kv_dtype, self.device,
                           self.weight_bytes, activation_peak, graph_reserve, self.indexer_cache,
                           self.dtype)

    def allocate_kv_caches(self, plan: MemoryPlan) -> None:
        """Allocate plan.num_blocks blocks of every layer's cache (the rank's shapes), bound."""
        self.bind_kv_caches(allocate_kv_caches(self.local_config, plan, self.kv_dtype,
                                               self.device, self.indexer_cache, self.dtype))

    def kv_layout(self) -> str:
        return kv_layout(self.local_config, self.kv_dtype, self.indexer_cache, self.dtype)

    def bind_kv_caches(self, kv_caches: list[LayerCache]) -> None:
        """Bind the KV tensors; serving starts here, so expert counting starts here too (the
        activation profile runs before and is not counted)."""
        self.kv_caches = kv_caches
        self.model.bind_kv_caches(kv_caches)
        self.model.bind_expert_counters(self.expert_counts if kv_caches else None)

    def warmup(self, moe_token_counts: list[int], max_model_len: int) -> None:
        """Compile the kernel variants serving will hit (runner/warmup.py)."""
        warm_up(self, moe_token_counts, max_model_len)

    def reset_counters(self) -> None:
        """Zero the expert-load counters, the forward count, the attention layers' path counts
        and the step profile's totals (serving starts now)."""
        if self.expert_counts is not None:
            self.expert_counts.zero_()
        self.num_forward_steps = 0
        for module in self.model.modules():  # the attention forms' token counts
            reset = getattr(module, "reset_path_counters", None)
            if reset is not None:
                reset()
        self._load_copy = self._load_snapshot = None
        self._last = None
        if self.profiler is not None:
            self.profiler.reset_counters()

    def init_decode_graphs(self, max_batch: int, max_model_len: int,
                           capture: bool = True) -> str:
        """Build the decode buckets up to `max_batch` and capture them (CUDA only; `capture`
        False keeps the static buffers with eager replays: tests on CPU). Returns the capacity
        report's one-line state."""
        if not self.kv_caches:
            raise RuntimeError("bind the KV caches before capturing CUDA graphs")
        sizes = graph_batch_sizes(max_batch)
        self.graphs = DecodeGraphs(self.model, sizes, max_model_len, self.block_size,
                                   self.device)
        return self.graphs.report(self.graphs.capture() if capture else 0.0)

    def init_mixed_graphs(self, max_tokens: int, capture: bool = True) -> str:
        """Build the mixed-step token buckets up to `max_tokens` (the step's token budget) and
        capture their pieces (CUDA only; `capture` False: static buffers, eager pieces).
        Returns the capacity report's one-line state."""
        if not self.kv_caches:
            raise RuntimeError("bind the KV caches before capturing CUDA graphs")
        sizes = mixed_token_buckets(max_tokens)
        self.mixed_graphs = MixedGraphs(self.model, sizes, self.device)
        seconds = self.mixed_graphs.capture() if capture else 0.0
        kind = ("captured" if self.mixed_graphs.graphs
                else "static buffers, eager (no CUDA)")
        gib = (self.mixed_graphs.capture_bytes or self.mixed_graphs.buffer_bytes()) / 2**30
        return (f"on: {len(sizes)} token buckets {sizes[0]}..{max_tokens} x "
                f"{self.mixed_graphs.num_pieces} pieces ({kind} in {seconds:.1f}s, "
                f"{gib:.2f} GiB)")

    # ---- one step ------------------------------------------------------------------------

    def execute(self, out: SchedulerOutput) -> ModelOutput:
        """Run one step of the scheduler's plan and wait for its sampled tokens."""
        return self.launch(out).result()

    @torch.inference_mode()
    def launch(self, out: SchedulerOutput, defer_sampling: bool = False) -> PendingOutput:
        """Enqueue one step on the device and return without waiting for it.

        Overlap scheduling: a token id of -1 in the plan is the token the previous launch is
        sampling for the same request; it is taken from that launch's device tensor, so step
        N+1 can be enqueued before step N's tokens reach the host. The sampled tokens' copy to
        the host is enqueued here, right behind the step (`PendingOutput.start_copy`): step N's
        `result()`, called after step N+1 was launched, then waits for step N alone.
        `defer_sampling`: the forward only; `sample_deferred` samples it later, when the plan
        holds its grammar masks (which need step N's tokens), and enqueues the copy."""
        self._defer_sampling = defer_sampling
        pending = self._launch(out)
        if self.profiler is not None:
            pending.profiled_forwards = self.profiler.take_sampled()
        if not defer_sampling:
            pending.start_copy()
        return pending

    @torch.inference_mode()
    def sample_deferred(self, pending: PendingOutput, out: SchedulerOutput) -> None:
        """Sample a launch made with `defer_sampling` (`out` now holds its grammar masks), then
        enqueue its tokens' copy."""
        if pending.deferred is not None:
            self._sample_picked(pending, out)
        pending.start_copy()

    def _launch(self, out: SchedulerOutput) -> PendingOutput:
        if self.faults:
            self._inject_step_faults(out)
        self.output_counts.release(out.finished_req_ids)
        if out.penalty_prompts:  # repetition penalties' prompts (sched/penalty_prompts.py)
            self.output_counts.add_prompts(out.req_ids, out.penalty_prompts,
                                           self.model_config.vocab_size, self.device)
        is_decode = out.num_reqs > 0 and all(n == 1 for n in out.num_scheduled_tokens)
        bucket = self.graphs.bucket(out.num_reqs) if self.graphs and is_decode else None
        if bucket is None and is_decode and self.device.type == "cuda":
            self.num_eager_decode_fallbacks += 1
        if out.num_steps > 1:
            return self._launch_decode_steps(out, bucket)
        if bucket is not None:
            return self._launch_graph_step(out, bucket)
        meta = build_attention_metadata(out.num_computed_tokens, out.num_scheduled_tokens,
                                        out.block_tables, self.block_size, self.device)
        token_ids = np.asarray(out.token_ids, dtype=np.int64)  # [T]
        input_ids = self._to_device(token_ids)
        missing = np.flatnonzero(token_ids < 0)
        if missing.size:
            input_ids[self._to_device(missing)] = self._previous_tokens(
                out, meta.token_to_req_np[missing])
        mixed = (self.mixed_graphs.bucket(len(token_ids))
                 if self.mixed_graphs is not None and not is_decode else None)
        if mixed is not None:  # piecewise graphs: the attention hooks never fire
            hidden = self._forward(self.mixed_graphs.run, (input_ids, meta, mixed),
                                   len(token_ids), breakdown=False)
            self.num_mixed_graph_steps += 1
        else:
            hidden = self._forward(self.model, (input_ids, meta.positions, meta),
                                   len(token_ids), breakdown=True)  # [T, hidden]
        last_token = np.cumsum(meta.query_lens_np) - 1  # [B] each row's last token
        return self._sample_rows(out, hidden, last_token, meta.seq_lens_np)

    def _inject_step_faults(self, out: SchedulerOutput) -> None:
        """Tests only (envs.fault_injection): a held or slow step, or a forward that raises."""
        for path in self.faults.get("hold_steps", ()):
            while not os.path.exists(path):
                time.sleep(0.01)
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        if self.faults.get("step") and not self.faults["step"].isdisjoint(out.req_ids):
            raise envs.InjectedFault("injected step fault: the forward failed")
        once = self.faults.get("oom_once", frozenset()) - self.oom_fired
        if hit := (self.faults.get("oom", frozenset()) | once) & set(out.req_ids):
            self.oom_fired |= hit
            raise torch.OutOfMemoryError(f"injected: CUDA out of memory with {sorted(hit)}")

    def _launch_graph_step(self, out: SchedulerOutput, bucket: int) -> PendingOutput:
        """A decode step through the bucket's CUDA graph (rows past the batch are padding)."""
        graphs = self.graphs
        token_ids = np.asarray(out.token_ids, dtype=np.int64)  # [B]
        positions = np.asarray(out.num_computed_tokens, dtype=np.int64)  # [B]
        graphs.stage(token_ids, positions, out.block_tables, bucket)
        missing = np.flatnonzero(token_ids < 0)
        if missing.size:
            graphs.input_ids[self._to_device(missing)] = self._previous_tokens(out, missing)
        hidden = self._forward(graphs.replay, (bucket,), out.num_reqs,
                               breakdown=not graphs.graphs)  # [bucket, hidden]
        self.num_graph_steps += 1
        return self._sample_rows(out, hidden, np.arange(out.num_reqs), positions + 1)

    def _forward(self, fn: Callable[..., torch.Tensor], args: tuple, num_tokens: int,
                 breakdown: bool) -> torch.Tensor:
        """One model forward, `fn(*args)` (eager or a graph replay), timed when the profiler
        samples it; `breakdown` False when per-layer hooks cannot fire (a replay)."""
        if self.profiler is not None:
            self.profiler.begin()
        hidden = fn(*args)
        if self.profiler is not None:
            self.profiler.end(num_tokens, breakdown)
        self.num_forward_steps += 1
        return hidden

    def _sample_rows(self, out: SchedulerOutput, hidden: torch.Tensor, last_token: np.ndarray,
                     seq_lens: np.ndarray) -> PendingOutput:
        """Sample the rows that sample (now, or at sample_deferred); last_token [B] is each
        row's hidden row, seq_lens [B] each row's length after the step (the position of its
        random stream)."""
        rows = np.flatnonzero(np.asarray(out.sample, dtype=bool))  # [R]
        pending = PendingOutput(out.num_reqs, rows)
        self._last = (pending, {out.req_ids[i]: j for j, i in enumerate(rows.tolist())})
        pending.prompt_logprobs = prompt_logprobs_of(out, hidden, last_token, self.model
                                                     .compute_logits, self.model_config.vocab_size)
        if rows.size == 0:
            return pending
        if np.array_equal(last_token[rows], np.arange(rows.size)):
            picked = hidden[:rows.size]  # decode: the rows in order, no gather
        else:
            picked = hidden[self._to_device(last_token[rows])]
        pending.deferred = (picked, seq_lens[rows].tolist())
        if not self._defer_sampling:
            self._sample_picked(pending, out)
        return pending

    def _sample_picked(self, pending: PendingOutput, out: SchedulerOutput) -> None:
        """The logits of a step's picked hidden rows [R, hidden], sampled into `pending`.
        NOTE: a graph replay's rows are views of its static output, which the next replay
        overwrites: that replay is enqueued after this (the next step), on the same stream."""
        (picked, positions), pending.deferred = pending.deferred, None
        rows, eos = pending.rows, self.model_config.eos_token_ids
        logits = self.model.compute_logits(picked)  # [R, V] model dtype
        pending.params = [out.sampling_params[i] for i in rows]
        pending.take(sample_step(logits, pending.params, [out.sample_seeds[i] for i in rows],
                                 positions, [out.req_ids[i] for i in rows], self.faults,
                                 GrammarMask.of(out, rows, self.device), self.output_counts,
                                 lambda j: out.num_output_tokens[rows[j]], eos))

    def _launch_decode_steps(self, out: SchedulerOutput, bucket: int | None) -> PendingOutput:
        """A decode-only plan run for `out.num_steps` tokens back to back: each step's sampled
        tokens are the next step's inputs, on the device, with no host sync in between. With a
        graph bucket, positions and slots advance on the device; else the metadata is rebuilt."""
        pending = PendingOutput(out.num_reqs, np.arange(out.num_reqs))
        pending.params, eos = out.sampling_params, self.model_config.eos_token_ids
        token_ids = np.asarray(out.token_ids, dtype=np.int64)  # [B]
        computed = np.asarray(out.num_computed_tokens, dtype=np.int64)  # [B]
        graphs = self.graphs if bucket is not None else None
        if graphs is not None:
            graphs.stage(token_ids, computed, out.block_tables, bucket, out.num_steps)
        input_ids = self._to_device(token_ids)
        tokens = []
        for step in range(out.num_steps):
            if graphs is not None:
                if step:
                    graphs.advance(input_ids)
                hidden = self._forward(graphs.replay, (bucket,), out.num_reqs,
                                       breakdown=not graphs.graphs)[:out.num_reqs]
                self.num_graph_steps += 1
            else:
                meta = build_attention_metadata((computed + step).tolist(),
                                                out.num_scheduled_tokens, out.block_tables,
                                                self.block_size, self.device)
                hidden = self._forward(self.model, (input_ids, meta.positions, meta),
                                       out.num_reqs, breakdown=True)  # [B, hidden]
            logits = self.model.compute_logits(hidden)  # [B, V] model dtype
            step_sample = sample_step(
                logits, out.sampling_params, out.sample_seeds, (computed + step + 1).tolist(),
                out.req_ids, self.faults, counts=self.output_counts, eos_token_ids=eos,
                num_outputs=lambda j, step=step: out.num_output_tokens[j] + step)
            input_ids = step_sample.token_ids  # [B]: this step's tokens, next step's input
            tokens.append(input_ids)
            pending.take(step_sample, first=step == 0)
        pending.token_ids = tokens[0]
        pending.extra_token_ids = torch.stack(tokens[1:], dim=1)  # [B, num_steps - 1]
        self._last = (pending, {rid: i for i, rid in enumerate(out.req_ids)})
        return pending

    def _previous_tokens(self, out: SchedulerOutput, rows: np.ndarray) -> torch.Tensor:
        """Device tensor of the tokens the previous launch sampled for `rows` [M] of this step."""
        if self._last is None:
            raise RuntimeError("a -1 token (overlap placeholder) in the first launch")
        prev, prev_rows = self._last
        try:
            src = np.fromiter((prev_rows[out.req_ids[r]] for r in rows), np.int64, len(rows))
        except KeyError as e:
            raise RuntimeError(f"request {e.args[0]!r} has a -1 token but the previous launch "
                               "sampled nothing for it") from None
        return prev.token_ids[self._to_device(src)]

    def _to_device(self, a: np.ndarray) -> torch.Tensor:
        return to_device(a, self.device)
