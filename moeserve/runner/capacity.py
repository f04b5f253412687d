"""The capacity report: what the engine chose at start-up, and why.

Printed once at start-up and served later at /v1/engine. It answers the seeds' questions at a
glance: how many KV tokens, how many running requests and which footprint gave that number, what
the weights and activations cost, which kernels run, and how long each start-up phase took.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from moeserve import envs
from moeserve.config import EngineConfig
from moeserve.model_config import ModelConfig
from moeserve.runner.kv_cache import GiB, MemoryPlan


@dataclass(slots=True)
class CapacityReport:
    model: str
    architecture: str
    num_params: int
    vocab_size: int
    device_name: str  # e.g. "NVIDIA H200", or the CPU
    engine_config: EngineConfig  # fully resolved
    memory: MemoryPlan
    max_running_requests: int
    max_running_requests_rule: str
    resolved: dict[str, str]  # field -> why its "auto" value was chosen
    phase_seconds: dict[str, float] = field(default_factory=dict)
    moe_tune: str = ""  # what the start-up MoE tune did (ensure_tuned), "" when none ran
    cuda_graphs: str = "off"  # "on: ..." or "off: <why>" (EngineCore._init_cuda_graphs)
    cpu_threads: str = ""  # torch's threads against the usable cores (EngineCore)
    torch_threads: int = 0  # torch's CPU threads in the engine process (0: not reported)
    usable_cores: int = 0  # the cores the engine process may run on (its CPU affinity)
    # tokens -> {"config" (tile config, "down" included when split), "tiles" (its name),
    #            "tuned", "source", "backend", "tuned_tokens"[, "format": quantized experts']}
    #            (EngineCore._moe_configs / _quant_moe_configs)
    moe_configs: dict[str, dict] = field(default_factory=dict)
    kv_layout: str = ""  # what one token costs in the cache, per layer (GQA K/V or MLA latent)
    mtp: str = ""  # the checkpoint's layers not run (MTP, an hf_overrides slice), or ""
    checkpoint_format: str = ""  # a quantized checkpoint's weights (how they load), or ""
    shared_experts: str = ""  # fold_shared_experts: folded, or why not; "" when off
    expert_layout: str = ""  # 4-bit routed experts: micro-tiled or rows, and why; "" otherwise
    weights: str = ""  # each module class's format and GiB (weights_by_class)
    dsa: str = ""  # DeepSeek Sparse Attention: how contexts attend (auto / dense), or ""
    mla_prefill: str = ""  # MLA models: how prefill rows attend (auto / mha / absorbed), or ""
    mla_decode: str = ""  # MLA models: the decode form and the kernels it runs here, or ""
    parallel: str = ""  # the ranks' split and what each holds (tensor_parallel_size > 1), or ""
    # the MOESERVE_ variables set in the engine process (envs.set_variables): kernel switches
    environment: dict[str, str] = field(default_factory=envs.set_variables)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "architecture": self.architecture,
            "num_params": self.num_params,
            "vocab_size": self.vocab_size,
            "device_name": self.device_name,
            "engine_config": dataclasses.asdict(self.engine_config),
            "memory": self.memory.to_dict(),
            "weights_gib": self.memory.weight_bytes / GiB,
            "weights_by_class": self.weights,
            "kv_blocks": self.memory.num_blocks,
            "kv_tokens": self.memory.num_kv_tokens,
            "max_running_requests": self.max_running_requests,
            "max_running_requests_rule": self.max_running_requests_rule,
            "resolved": self.resolved,
            "phase_seconds": self.phase_seconds,
            "cuda_graphs": self.cuda_graphs,
            "cpu_threads": self.cpu_threads,
            "torch_threads": self.torch_threads,
            "usable_cores": self.usable_cores,
            "moe_tune": self.moe_tune,
            "moe_configs": self.moe_configs,
            "kv_layout": self.kv_layout,
            "mtp": self.mtp,
            "shared_experts": self.shared_experts,
            "expert_layout": self.expert_layout,
            "dsa": self.dsa,
            "mla_prefill": self.mla_prefill,
            "mla_decode": self.mla_decode,
            "parallel": self.parallel,
            "environment": self.environment,
            "text": self.format(),  # as printed at start-up (the API process prints this too)
        }

    def format(self) -> str:
        """A plain-text table for the terminal and the log."""
        m, c = self.memory, self.engine_config
        rows = [
            ("model", f"{self.model} ({self.architecture}, {self.num_params / 1e9:.2f} B params)"),
            *([("hf overrides", f"{c.hf_overrides} (merged over config.json)")]
              if c.hf_overrides else []),
            ("device / dtype", f"{c.device} ({self.device_name}) / {c.dtype}"),
            *([("CPU threads", self.cpu_threads)] if self.cpu_threads else []),
            *([("parallel", self.parallel)] if self.parallel else []),
            ("weights", f"{m.weight_bytes / GiB:.2f} GiB ({c.load_format})"),
        ]
        if m.total_bytes:
            rows += [("memory budget", (f"{m.budget_bytes / GiB:.2f} GiB of "
                                       f"{m.total_bytes / GiB:.2f} GiB (mem_fraction "
                                       f"{c.cache.mem_fraction})")),
                     ("activation peak", (f"{m.activation_peak_bytes / GiB:.2f} GiB (profiled at "
                                         f"{c.scheduler.max_num_batched_tokens} tokens)")),
                     ("graph reserve", f"{m.graph_reserve_bytes / GiB:.2f} GiB")]
        rows += [
            ("KV cache", (f"{m.kv_bytes / GiB:.2f} GiB = {m.num_blocks} blocks x {m.block_size} "
                         f"tokens = {m.num_kv_tokens:,} tokens ({m.rule})")),
            *([("KV per token", self.kv_layout)] if self.kv_layout else []),
            ("max running requests", (f"{self.max_running_requests} <- "
                                     f"{self.max_running_requests_rule}")),
            ("max model len", str(c.scheduler.max_model_len)),
            ("token budget / step", str(c.scheduler.max_num_batched_tokens)),
            ("prefix caching", "on" if c.cache.enable_prefix_caching else "off"),
            ("kernels", f"attention={c.attention_backend}, moe={c.moe_backend}"
                        + (f", mla prefill={self.mla_prefill}" if self.mla_prefill else "")
                        + (f", mla decode={self.mla_decode}" if self.mla_decode else "")),
            *([("sparse attention", self.dsa)] if self.dsa else []),
            ("CUDA graphs", self.cuda_graphs),
            *([("environment", ", ".join(f"{k}={v}" for k, v in self.environment.items()))]
              if self.environment else []),
        ]
        if self.moe_configs:
            sources = sorted({c["source"] for c in self.moe_configs.values()})
            tuned = all(c["tuned"] for c in self.moe_configs.values())
            state = ("default tiles (moe_tiles=default)"
                     if self.engine_config.moe_tiles == "default" else
                     "tuned" if tuned else "NOT tuned (defaults)")
            formats = sorted({c["format"] for c in self.moe_configs.values() if "format" in c})
            if formats:  # quantized experts: the fused quantized MoE's tiles (quant/configs.py)
                state += f" ({', '.join(formats)} experts, the fused quantized MoE)"
            rows.append(("MoE tile configs", f"{state}: {', '.join(sources)}"))
            picks = ", ".join(f"{n}: {c['backend']}" for n, c in self.moe_configs.items())
            rows.append(("MoE backend by tokens", picks))
            tiles = ", ".join(f"{n}: {c['tiles']}" for n, c in self.moe_configs.items()
                              if c.get("tiles"))
            if tiles:  # the down launch's own tiles, when it has them, as +down_N.._K..
                rows.append(("MoE tiles by tokens", tiles))
        if self.moe_tune:
            rows.append(("MoE tune", self.moe_tune))
        if self.mtp:
            rows.append(("layers not run", self.mtp))
        if self.checkpoint_format:
            rows.append(("checkpoint format", self.checkpoint_format))
        if self.shared_experts:
            rows.append(("shared experts", self.shared_experts))
        if self.expert_layout:
            rows.append(("expert layout", self.expert_layout))
        if self.weights:
            rows.append(("weights by class", self.weights))
        rows += [(f"auto {k}", v) for k, v in self.resolved.items()]
        rows += [("start-up", ", ".join(f"{k} {v:.2f}s" for k, v in self.phase_seconds.items()))]
        width = max(len(k) for k, _ in rows)
        lines = ["moeserve capacity report"] + [f"  {k:<{width}}  {v}" for k, v in rows]
        return "\n".join(lines)


def _module_class(name: str) -> str | None:
    """A parameter's module class, by its path; None for the norms (small, left out)."""
    if "norm" in name:
        return None
    if name.endswith((".mlp.gate", ".mlp.correction_bias")):
        return "routers"
    for pattern, cls in ((".mlp.shared_experts.", "shared experts"),
                         (".mlp.w13", "routed experts"), (".mlp.w2", "routed experts"),
                         (".self_attn.indexer.", "DSA indexer"),
                         (".self_attn.kv_b_proj", "MLA kv_b"), (".self_attn.", "attention"),
                         (".mlp.", "dense MLP"), ("embed_tokens", "embedding"),
                         ("lm_head", "LM head")):
        if pattern in name:
            return cls
    return "other"


def weights_by_class(model: Any) -> str:
    """Each module class's storage format and size, largest first: "routed experts nvfp4
    12.30 GiB, attention nvfp4 0.41 GiB, embedding bfloat16 ..." (a class holding several
    formats lists each; the norms left out: small)."""
    from moeserve.quant.packed import QuantWeight

    owner = {}  # parameter id -> the QuantWeight's format
    for m in model.modules():
        if isinstance(m, QuantWeight):
            owner.update({id(p): m.format for p in m.parameters()})
    sizes: dict[tuple[str, str], int] = {}
    for name, p in model.named_parameters():
        cls = _module_class(name)
        if cls is None:
            continue
        key = (cls, owner.get(id(p), str(p.dtype).removeprefix("torch.")))
        sizes[key] = sizes.get(key, 0) + p.numel() * p.element_size()
    ranked = sorted(sizes.items(), key=lambda kv: -kv[1])
    return ", ".join(f"{c} {f} {_size(b)}" for (c, f), b in ranked)


def _size(n: int) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB // 100 else f"{n / (1 << 20):.2f} MiB"


def dsa_line(cfg: EngineConfig, mc: ModelConfig) -> str:
    """The capacity report's line on DeepSeek Sparse Attention ("" for other models)."""
    d = mc.dsa
    if d is None:
        return ""
    shared = mc.num_layers - mc.index_cache_layers
    layers = (f"{mc.index_cache_layers} full layers" + (f", {shared} sharing the selection "
                                                        "of the full layer before them"
                                                        if shared else ""))
    if cfg.dsa == "dense":
        return f"dsa=dense: dense MLA for every request, no indexer ({layers})"
    kernels = ("Triton kernels" if cfg.attention_backend == "triton"
               else f"the torch references (attention_backend {cfg.attention_backend})")
    return (f"auto: a context beyond index_topk {d.index_topk} attends to the indexer's top "
            f"{d.index_topk} positions ({d.index_n_heads} heads x {d.index_head_dim}, "
            f"{layers}); shorter contexts run dense MLA; {kernels}")


def mla_decode_line(cfg: EngineConfig, device: torch.device, dtype: torch.dtype) -> str:
    """The capacity report's MLA decode form, with the kernels it runs here: "auto" on an sm90
    GPU with a cache in the model's 16-bit dtype runs the Gluon ones (kernels/attention/mla/
    decode_gluon.py: the decode, prefill rows unless MOESERVE_MLA_PREFILL_GLUON=0, DSA's
    sparse attention; the A/B switches named when set), elsewhere the Triton ones."""
    form = cfg.mla_decode
    if cfg.attention_backend != "triton" or form not in ("auto", "gluon"):
        return form
    from moeserve.kernels.attention.mla import decode_gluon, decode_gluon_ws

    if (device.type == "cuda" and decode_gluon._is_sm90(device.index)
            and dtype in (torch.bfloat16, torch.float16) and cfg.cache.kv_cache_dtype == "auto"):
        prefill = "" if envs.mla_prefill_gluon() else "; prefill rows in Triton"
        unswapped = "" if decode_gluon.swapped else "; decodes of <= 32 heads not swapped"
        least = decode_gluon_ws.min_heads(device)
        ws = (f"; decodes of {least}+ heads warp-specialized past "
              f"{decode_gluon.WS_SHORT_CONTEXT:,} keys" if decode_gluon.ws else "")
        sparse = "; DSA's sparse MLA warp-specialized" if decode_gluon.ws_sparse else ""
        return f"{form} (Gluon on sm90's wgmma{prefill}{unswapped}{ws}{sparse})"
    return f"{form} (Triton: no sm90 GPU with a 16-bit cache here)"


@contextmanager
def timed(phases: dict[str, float], name: str,
          device: torch.device | None = None) -> Iterator[None]:
    """Record the wall seconds of a start-up phase (synchronising the GPU at the end)."""
    start = time.perf_counter()
    yield
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
    phases[name] = round(time.perf_counter() - start, 3)
