"""The roofline of one engine step: the bytes it must read and the FLOPs it must do, against the
device's ceilings, and how close a run came.

    step_cost(model, dtype_bytes, tokens, rows, batch, context)
        bytes  = expert weights touched (each MoE layer: E x (1 - (1 - k/E)^tokens) experts of
                 3 x hidden x expert width) + dense weights (attention, router, dense MLPs,
                 shared experts, lm_head, the embedding rows looked up) + the KV cache of the
                 batch (batch x context x layers x cached values a token: 2 x kv heads x head
                 dim, or MLA's latent L + R; DSA: the latents of min(context, index_topk)
                 positions, and every context position's indexer key in each full layer);
                 shared_in_moe (folded shared experts): theirs in the expert part, not the dense
        FLOPs  = 2 x active parameters per token (lm_head only for the `rows` that sample)
                 + attention over the context (2 x context x heads x (qk dims + v dims) per
                 layer: 4 x head dim for GQA; (L + R) + L for MLA's absorbed decode; DSA: over
                 min(context, index_topk) positions, plus the indexer's 2 x context x index
                 heads x index_head_dim a full layer)
        bound  = max(bytes / bandwidth, FLOPs / peak): memory- or compute-bound
        quant  (fp8 / nvfp4 / int4) the linear projections held quantized, as the engine holds
               them (quant/plan.py): experts, attention projections but MLA's kv_b, dense MLPs,
               shared experts at QUANT_BYTES a weight (scales included); routers, the LM head,
               the embedding, kv_b and the KV cache at dtype_bytes. The FLOPs are unchanged
               (W4A16 computes in bf16; FP8's tensor cores are counted at the bf16 peak: a
               conservative bound)

    analyse(run)  the run's steady window (figures.steady_window): observed seconds per step,
                  tokens per step, batch; the model shape from the capacity report
                  (engine_config.model through moeserve.config.load_model_config); the device's
                  ceilings by name. Achieved bandwidth and FLOP/s, the share of the bound.

Ceilings measured on the reference machine (shared/reference/ANCHORS.md): one NVIDIA H200,
787 TFLOP/s dense bf16, 4.27 TB/s device copy. W1 at batch 1,024 (context 128 + 64): 18.8 ms.
Also the H100 SXM's (`CEILINGS`); a device without measured ceilings gets no roofline
(benchmarks/kernels/ceilings.py measures them).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from moeserve.config import ConfigError, load_model_config
from moeserve.diagnose import figures
from moeserve.model_config import ModelConfig


@dataclass(frozen=True, slots=True)
class Ceilings:
    name: str
    flops_per_s: float
    bytes_per_s: float


# The H100's (the SXM part, HBM3, which nvidia-smi names "NVIDIA H100 80GB HBM3"; the PCIe and
# NVL parts have other memory) as measured on the device machine's H100 (its KINDS.md, by the
# method above: 8192^3 bf16 product 798 TFLOP/s, device copy about 3.0 TB/s read + written)
CEILINGS = (Ceilings("H200", 787e12, 4.27e12), Ceilings("H100 80GB HBM3", 798e12, 3.0e12))
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "fp8": 1}
# bytes a quantized weight, its scales included (quant/packed.py): e4m3 + an fp32 scale per
# 128 x 128 block; e2m1 + an e4m3 scale per 16; 4 bits + a bf16 scale per 32 (Kimi's group)
QUANT_BYTES = {"fp8": 1.0 + 4 / (128 * 128), "nvfp4": 0.5 + 1 / 16, "int4": 0.5 + 2 / 32}


def ceilings_for(device_name: str | None) -> Ceilings | None:
    """The measured ceilings of a device, matched by name ("NVIDIA H200" -> H200); None for
    a device without measured ceilings."""
    for c in CEILINGS:
        if device_name and c.name.lower() in device_name.lower():
            return c
    return None


def experts_touched(num_experts: int, top_k: int, tokens: float) -> float:
    """Expected distinct experts hit by `tokens` tokens routing top_k of num_experts each
    (uniform routing)."""
    if num_experts == 0 or tokens <= 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


@dataclass(frozen=True, slots=True)
class StepCost:
    tokens: float  # tokens through the model this step (decode rows + prefill tokens)
    rows: float  # rows that sample a token (the lm_head's batch)
    batch: float  # running requests whose KV is read
    context: float  # mean context per running request
    expert_bytes: float
    dense_bytes: float
    kv_bytes: float
    expert_flops: float  # the routed experts' GEMMs
    dense_flops: float  # every other weight's GEMMs (attention projections, dense MLPs,
    #                     shared experts, routers, the indexer, lm_head)
    attention_flops: float  # q . k and p . v over the context (the indexer's scores too)
    # the attention kernels' own activations: each token's queries read and outputs written
    # (tokens x layers x heads x (qk dims + v dims)). Not in `bytes`: ANCHORS.md's serial
    # roofline counts weights and cache; only the step profile's attention part counts them
    # (with MLA's absorbed prefill they, not the latents, bound the kernel)
    attention_io_bytes: float = 0.0

    @property
    def bytes(self) -> float:
        return self.expert_bytes + self.dense_bytes + self.kv_bytes

    @property
    def flops(self) -> float:
        return self.expert_flops + self.dense_flops + self.attention_flops

    def parts(self) -> dict[str, tuple[float, float]]:
        """(bytes, FLOPs) of the step's bounded parts, adding up to the step's (`bytes` and
        `flops`; diagnose/bounds/step_parts.py adds attention_io_bytes to the attention part)."""
        return {"moe": (self.expert_bytes, self.expert_flops),
                "attention": (self.kv_bytes, self.attention_flops),
                "dense": (self.dense_bytes, self.dense_flops)}

    def bound_seconds(self, c: Ceilings) -> float:
        return max(self.bytes / c.bytes_per_s, self.flops / c.flops_per_s)

    def bound_kind(self, c: Ceilings) -> str:
        return "memory" if self.bytes / c.bytes_per_s >= self.flops / c.flops_per_s else "compute"


def step_cost(model: ModelConfig, dtype_bytes: int, tokens: float, rows: float, batch: float,
              context: float, quant: str | None = None,
              kv_elem_bytes: int | None = None, shared_in_moe: bool = False) -> StepCost:
    """Bytes and FLOPs of one step (see the module docstring). kv_elem_bytes: the KV cache's
    element size when it is not the model's (1: kv_cache_dtype="fp8"; DSA's indexer keys stay
    in the model's dtype). shared_in_moe (the engine's fold_shared_experts, where it folded
    them): the shared experts' weights and FLOPs count in the MoE part, whose launch runs them
    (every one read: always selected), not in the dense part; the step's totals are the same."""
    h, d = model.hidden_size, model.head_dim
    attn_params = model.attention_params()
    expert_params = 3 * h * model.moe_intermediate_size
    moe_layers = sum(1 for i in range(model.num_layers) if model.is_moe_layer(i))
    dense_layers = model.num_layers - moe_layers
    shared_params = moe_layers * 3 * h * model.shared_expert_intermediate_size
    projections = (model.num_layers * attn_params + dense_layers * 3 * h * model.intermediate_size
                   + (0 if shared_in_moe else shared_params))  # + shared, unless folded
    dense_params = projections + moe_layers * model.num_experts * h  # + the routers
    weight_bytes = dtype_bytes if quant is None else QUANT_BYTES[quant]
    if quant is not None and model.mla is not None:  # kv_b stays in the engine's dtype
        m = model.mla
        projections -= model.num_layers * m.kv_lora_rank * model.num_heads * (
            m.qk_nope_head_dim + m.v_head_dim)
    dsa, index_layers = model.dsa, model.index_cache_layers
    attended = context if dsa is None else min(context, dsa.index_topk)  # positions attended
    index_flops = index_row = 0.0
    if dsa is not None:
        assert model.mla is not None and model.mla.q_lora_rank
        dense_params += index_layers * dsa.indexer_params(h, model.mla.q_lora_rank)
        index_row = context * index_layers * dsa.index_head_dim  # keys one row reads
        index_flops = 2.0 * context * dsa.index_n_heads * dsa.index_head_dim * index_layers
    # per head and context token: q . k over qk dims, p . v over v dims (MLA decode: absorbed,
    # over the latent row L + R and its first L values)
    qk_dim, v_dim = ((model.mla.latent_dim, model.mla.kv_lora_rank) if model.mla is not None
                     else (d, d))
    lm_head = model.vocab_size * h
    touched = experts_touched(model.num_experts, model.num_experts_per_tok, tokens)
    kv_per_row = (attended * model.num_layers * model.kv_bytes_per_token_per_layer_elem
                  * (kv_elem_bytes or dtype_bytes)
                  + index_row * dtype_bytes)  # DSA's indexer keys: the model's dtype
    attn_flops = (2.0 * attended * model.num_heads * (qk_dim + v_dim) * model.num_layers
                  + index_flops)
    return StepCost(
        tokens=tokens, rows=rows, batch=batch, context=context,
        expert_bytes=(moe_layers * touched * expert_params
                      + (shared_params if shared_in_moe else 0)) * weight_bytes,
        dense_bytes=((dense_params - projections + lm_head + min(tokens, model.vocab_size) * h)
                     * dtype_bytes + projections * weight_bytes),
        kv_bytes=batch * kv_per_row,
        expert_flops=2.0 * tokens * (moe_layers * model.num_experts_per_tok * expert_params
                                     + (shared_params if shared_in_moe else 0)),
        dense_flops=2.0 * tokens * dense_params + 2.0 * rows * lm_head,
        attention_flops=tokens * attn_flops,
        attention_io_bytes=(tokens * model.num_layers * model.num_heads * (qk_dim + v_dim)
                            * dtype_bytes))


@dataclass(frozen=True, slots=True)
class RooflineResult:
    cost: StepCost
    ceilings: Ceilings
    observed_step_s: float
    generated_per_step: float

    @property
    def bound_s(self) -> float:
        return self.cost.bound_seconds(self.ceilings)

    @property
    def kind(self) -> str:
        return self.cost.bound_kind(self.ceilings)

    @property
    def fraction(self) -> float:
        """The bound's share of the observed step time (1.0 = at the roofline)."""
        return self.bound_s / self.observed_step_s

    def evidence(self) -> dict[str, Any]:
        c, obs = self.cost, self.observed_step_s
        return {
            "device": self.ceilings.name, "bound": self.kind,
            "batch": round(c.batch, 1), "tokens_per_step": round(c.tokens, 1),
            "context": round(c.context, 1),
            "step_ms_observed": round(obs * 1e3, 3), "step_ms_bound": round(self.bound_s * 1e3, 3),
            "percent_of_roofline": round(100 * self.fraction, 1),
            "gb_per_step": round(c.bytes / 1e9, 3), "gflop_per_step": round(c.flops / 1e9, 1),
            "achieved_tb_per_s": round(c.bytes / obs / 1e12, 3),
            "ceiling_tb_per_s": self.ceilings.bytes_per_s / 1e12,
            "achieved_tflop_per_s": round(c.flops / obs / 1e12, 2),
            "ceiling_tflop_per_s": self.ceilings.flops_per_s / 1e12,
            "engine_tok_per_s_observed": round(self.generated_per_step / obs, 1),
            "engine_tok_per_s_bound": round(self.generated_per_step / self.bound_s, 1),
        }


def model_of(run: dict[str, Any]) -> ModelConfig | None:
    """The served model's shape: engine_config.model as a preset or a readable folder, with
    the run's hf_overrides applied."""
    engine_config = figures.engine_config(run)
    name = engine_config.get("model")
    if not isinstance(name, str):
        return None
    try:
        return load_model_config(name, engine_config.get("hf_overrides"))[0]
    except (ConfigError, ValueError, OSError):
        return None


def dtype_bytes_of(run: dict[str, Any]) -> int:
    dtype = str(figures.engine_config(run).get("dtype") or "auto")
    if dtype in DTYPE_BYTES:
        return DTYPE_BYTES[dtype]
    return 2 if figures.device_kind(run) == "cuda" else 4


def kv_elem_bytes_of(run: dict[str, Any]) -> int | None:
    """The KV cache's element size when the run's engine keeps it in another type than the
    model's (kv_cache_dtype "fp8": 1), else None."""
    kv = figures.engine_section(run, "cache").get("kv_cache_dtype", "auto")
    return 1 if isinstance(kv, str) and kv.startswith("fp8") else None


def quant_of(run: dict[str, Any], model: ModelConfig) -> str | None:
    """The run's quantized weight format: --quantization, else the checkpoint's."""
    return weights_format(figures.engine_config(run).get("quantization"), model)


def weights_format(flag: Any, model: ModelConfig) -> str | None:
    """The quantized weight format an engine holds: its quantization flag (vLLM's names
    accepted), else the checkpoint's; None for unquantized weights."""
    from moeserve.quant.spec import ALIASES

    if isinstance(flag, str) and flag in ALIASES:
        return ALIASES[flag]
    return model.quantization.format if model.quantization is not None else None


def analyse(run: dict[str, Any]) -> tuple[RooflineResult | None, str]:
    """The run's steady window against the roofline; (None, why) when a figure is missing."""
    c = ceilings_for(figures.capacity_report(run).get("device_name"))
    if c is None:
        return None, (f"no measured ceilings for device "
                      f"{figures.capacity_report(run).get('device_name')!r}")
    model = model_of(run)
    if model is None:
        return None, "the model's shape is unknown (engine_config.model is not readable here)"
    w = figures.steady_window(run)
    context = figures.mean_decode_context(run)
    if w is None or w.step_seconds is None or w.tokens_per_step is None or context is None:
        return None, "no steady window with engine steps in the timeline"
    rows = w.generated_tokens / w.steps
    cost = step_cost(model, dtype_bytes_of(run), w.tokens_per_step, rows, w.mean_running, context,
                     quant_of(run, model), kv_elem_bytes_of(run))
    return RooflineResult(cost, c, w.step_seconds, rows), ""


def serial_bound(model: ModelConfig, dtype_bytes: int, ceilings: Ceilings, concurrency: int,
                 input_len: int, output_len: int, quant: str | None = None,
                 kv_elem_bytes: int | None = None) -> dict[str, float]:
    """ANCHORS.md's serial bound of a fixed-length workload at `concurrency`: every prompt's
    prefill (one step of concurrency x input_len tokens, attending over a causal mean of
    input_len / 2; it yields each request's first token), then output_len - 1 decode steps of
    the whole batch at contexts input_len + 1 .. input_len + output_len - 1, each step at its
    own bound; no overlap between the phases. A DSA model attends over at most index_topk
    positions a token; `dataclasses.replace(model, dsa=None)` gives the dense MLA's bound.

    quant: the projections' quantized format, kv_elem_bytes the cache's element size where it
    is not the model's (step_cost). Returns prefill_s, decode_s and
    output_tok_s (the bound on output tokens per second)."""
    prefill = step_cost(model, dtype_bytes, tokens=concurrency * input_len, rows=concurrency,
                        batch=concurrency, context=input_len / 2, quant=quant,
                        kv_elem_bytes=kv_elem_bytes)
    decode_s = sum(step_cost(model, dtype_bytes, tokens=concurrency, rows=concurrency,
                             batch=concurrency, context=input_len + j, quant=quant,
                             kv_elem_bytes=kv_elem_bytes).bound_seconds(ceilings)
                   for j in range(1, output_len))
    prefill_s = prefill.bound_seconds(ceilings)
    return {"prefill_s": prefill_s, "decode_s": decode_s,
            "output_tok_s": concurrency * output_len / (prefill_s + decode_s)}


def run_serial_bound(run: dict[str, Any], concurrency: int, input_len: int,
                     output_len: int) -> dict[str, Any] | None:
    """A fixed-length run's serial bound (`serial_bound`, the model and device from its
    capacity report; dense MLA when the engine ran dsa="dense") and the share of it the run's
    output throughput reached. None without measured ceilings for the device or a readable
    model shape."""
    ceilings = ceilings_for(figures.capacity_report(run).get("device_name"))
    model = model_of(run)
    if ceilings is None or model is None:
        return None
    if figures.engine_config(run).get("dsa") == "dense":
        model = dataclasses.replace(model, dsa=None)
    quant = quant_of(run, model)
    bound = serial_bound(model, dtype_bytes_of(run), ceilings, concurrency, input_len,
                         output_len, quant, kv_elem_bytes_of(run))
    out: dict[str, Any] = {"method": "serial (ANCHORS.md)", "device": ceilings.name,
                           "weights": quant or "unquantized",
                           "concurrency": concurrency, "input_len": input_len,
                           "output_len": output_len,
                           "output_tok_s": round(bound["output_tok_s"], 1),
                           "prefill_s": round(bound["prefill_s"], 4),
                           "decode_s": round(bound["decode_s"], 4)}
    achieved = run.get("output_throughput")
    if isinstance(achieved, int | float) and bound["output_tok_s"] > 0:
        out["percent"] = round(100 * achieved / bound["output_tok_s"], 1)
    return out
