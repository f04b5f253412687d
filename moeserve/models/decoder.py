"""The decoder module tree of every family served: Qwen3-MoE, Qwen3 (dense), Mixtral,
DeepSeek-V2/V3 (Kimi K2, Moonlight), GLM-4.5 (Glm4Moe), GLM-4.7-Flash (Glm4MoeLite), GLM-5
(GlmMoeDsa) and DeepSeek-V3.2.

    input_ids [T] -> embed_tokens -> DecoderLayer x L -> norm -> hidden [T, hidden]
    DecoderLayer (pre-norm):
        h = h + self_attn(positions, input_layernorm(h), meta)   self_attn: DsaAttention when
                                                                  config.dsa, MLAttention when
                                                                  config.mla, else Attention
        h = h + mlp(post_attention_layernorm(h))     mlp: SparseMoeBlock if
                                                      config.is_moe_layer(i), else dense MLP
    computed as (hidden, residual) pairs: each residual add is fused into the norm after it
    (norm(x, residual) -> (norm(residual + x), residual + x)), and into the final norm. A sparse
    layer hands on its experts' k weighted rows [T, k, hidden] unsummed (and its shared experts'
    row): the norm after it adds them with the residual (rms_norm_triton's parts), so they take
    no pass of their own.
    compute_logits(hidden [N, hidden]) -> [N, V] in the model dtype (lm_head, or embed_tokens when
    tied), as HF's logits; the sampler reads them as they are (greedy: argmax, exact in any
    dtype) and upcasts only where it computes (random sampling, logprobs)

The families differ only in config, which picks the layers: attention (GQA with optional q/k
norm, qkv bias and partial rotary; or MLA with optional q compression, interleaved RoPE and
YaRN; or that MLA with DeepSeek Sparse Attention: GLM-5, DeepSeek-V3.2), the router (softmax;
DeepSeek-V2's grouped softmax; the sigmoid router with correction bias and groups), shared
experts, and which layers are dense (`mlp_only_layers`: Qwen3-MoE's list, DeepSeek's
first_k_dense_replace, GLM-4.7-Flash's and the DSA models' mlp_layer_types). One tree with the
choices in layers/ rather than a file per family, so a fix lands once; each family's config
parsing is in moeserve/hf_config/<family>.py and its HF weight names in
runner/weights/names.py.

Tensor parallelism (`tp`, a parallel.comm.TensorParallel; None at one rank, and held as None
over a world of one, whose collectives are the identity): the layers are
built from the rank's local config (parallel/layout.py: heads and widths divided), each
DecoderLayer all-reduces its attention output and its MLP / MoE output (reduced over the parts
first), the embedding holds a slice of the vocabulary (a token outside it looks up zeros; the
all-reduce fills it in) and so does the LM head (its logits all-gathered, the padding cut).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moeserve.kernels.attention.metadata import AttentionMetadata
from moeserve.layers.attention import Attention, AttentionBackend
from moeserve.layers.dsa import DSA_MODES, DsaAttention, DsaLayerCache
from moeserve.layers.linear import WeightFactory
from moeserve.layers.mla import PREFILL_FORMS, MlaBackend, MLAttention
from moeserve.layers.mlp import MLP
from moeserve.layers.moe import MoeBackend, SparseMoeBlock
from moeserve.layers.norm import RMSNorm
from moeserve.model_config import ModelConfig
from moeserve.parallel.comm import TensorParallel
from moeserve.parallel.layout import local_experts, local_model_config, local_vocab
from moeserve.quant.plan import QuantPlan

Device = torch.device | str | None


class DecoderLayer(nn.Module):
    def __init__(self, layer_idx: int, config: ModelConfig, moe_backend: MoeBackend,
                 attention_backend: AttentionBackend, mla_backend: MlaBackend,
                 dtype: torch.dtype, device: Device, tp: TensorParallel | None = None,
                 num_experts: int = 0, weights: WeightFactory | None = None) -> None:
        """config: the rank's local config (the whole model's at one rank); num_experts: the
        model's routed experts (the router's width), of which this rank holds its share;
        weights: the quantization plan seen from this layer (its prefix model.layers.{i}.)."""
        super().__init__()
        weights = weights or WeightFactory(prefix=f"model.layers.{layer_idx}.")
        attn_weights = weights.child("self_attn")
        self.tp = tp if tp is not None and tp.sums else None  # None: nothing to sum over
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps, dtype, device)
        self.self_attn: Attention | MLAttention
        if config.dsa is not None:
            self.self_attn = DsaAttention(layer_idx, config, mla_backend, dtype, device,
                                         attn_weights)
        elif config.mla is not None:
            self.self_attn = MLAttention(layer_idx, config, mla_backend, dtype, device,
                                        weights=attn_weights)
        else:
            self.self_attn = Attention(layer_idx, config, attention_backend, dtype, device,
                                      attn_weights)
        self.post_attention_layernorm = RMSNorm(h, eps, dtype, device)
        self.mlp: MLP | SparseMoeBlock
        if config.is_moe_layer(layer_idx):
            experts = local_experts(num_experts, tp.layout) if tp is not None else None
            self.mlp = SparseMoeBlock(config, moe_backend, dtype, device, experts,
                                      weights.child("mlp"))
        else:
            self.mlp = MLP(h, config.intermediate_size, dtype, device, weights.child("mlp"))

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden, residual) -> (mlp output, residual before it), [T, hidden] each (a sparse
        mlp's output as [T, S, hidden] parts, which the next norm sums). The
        residual adds are fused into the norms that follow them (vLLM's pattern): the stream HF
        keeps is residual + hidden, with the same ops in the same dtype. residual None: layer 0."""
        hidden, residual = self._input_norm(hidden, residual)
        return self._mlp(self.self_attn(positions, hidden, meta), residual)

    # forward in the parts piecewise CUDA graphs (runner/mixed_graphs.py) run: begin and
    # finish captured, attention_core eager between them

    def begin(self, positions: torch.Tensor, hidden: torch.Tensor,
              residual: torch.Tensor | None, slot_mapping: torch.Tensor) -> tuple:
        """The input norm and the attention's inputs -> (its pre-attention state, residual)."""
        hidden, residual = self._input_norm(hidden, residual)
        return self.self_attn.pre_attention(positions, hidden, slot_mapping), residual

    def attention_core(self, state: object, meta: AttentionMetadata) -> torch.Tensor:
        return self.self_attn.attention_core(state, meta)

    def finish(self, attn_out: torch.Tensor, residual: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """The attention's output projection, the post-attention norm and the MLP; as forward's
        return."""
        return self._mlp(self.self_attn.post_attention(attn_out), residual)

    def _input_norm(self, hidden: torch.Tensor, residual: torch.Tensor | None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self.input_layernorm(hidden), hidden
        return self.input_layernorm(hidden, residual)

    def _mlp(self, hidden: torch.Tensor, residual: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """The attention's output [T, hidden] (this rank's partial sum under TP) -> as forward."""
        if self.tp is not None:
            hidden = self.tp.all_reduce(hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        if self.tp is not None:  # the partials summed here, the ranks' by the all-reduce
            return self.tp.all_reduce(self.mlp(hidden)), residual
        if isinstance(self.mlp, SparseMoeBlock):
            return self.mlp(hidden, reduce=False), residual  # [T, S, hidden], [T, hidden]
        return self.mlp(hidden), residual  # [T, hidden] each


class Model(nn.Module):
    def __init__(self, config: ModelConfig, moe_backend: MoeBackend,
                 attention_backend: AttentionBackend, mla_backend: MlaBackend,
                 dtype: torch.dtype, device: Device, tp: TensorParallel | None = None,
                 quant: QuantPlan | None = None) -> None:
        super().__init__()
        self.tp = tp if tp is not None and tp.sums else None
        self.vocab_start, rows = (local_vocab(config.vocab_size, tp.layout) if tp is not None
                                  else (0, config.vocab_size))
        self.embed_tokens = nn.Parameter(
            torch.empty(rows, config.hidden_size, dtype=dtype, device=device),
            requires_grad=False)  # [V, hidden] (this rank's rows under TP)
        local = local_model_config(config, tp.layout) if tp is not None else config
        self.layers = nn.ModuleList(
            DecoderLayer(i, local, moe_backend, attention_backend, mla_backend, dtype, device,
                         tp, config.num_experts, WeightFactory(quant, f"model.layers.{i}."))
            for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        hidden, residual = self.embed(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, meta)
        return self.final_norm(hidden, residual)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return F.embedding(input_ids, self.embed_tokens)  # [T, hidden]
        local = input_ids - self.vocab_start
        held = (local >= 0) & (local < self.embed_tokens.shape[0])  # [T]
        rows = F.embedding(torch.where(held, local, torch.zeros_like(local)), self.embed_tokens)
        return self.tp.all_reduce(rows * held[:, None].to(rows.dtype))

    def final_norm(self, hidden: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """The last layer's (hidden, residual) -> the final hidden states [T, hidden]."""
        if residual is None:  # no layers
            return self.norm(hidden)
        return self.norm(hidden, residual)[0]


class CausalLM(nn.Module):
    """The served model: forward to the final hidden states, then logits for chosen rows."""

    def __init__(self, config: ModelConfig, moe_backend: MoeBackend,
                 attention_backend: AttentionBackend, mla_backend: MlaBackend,
                 dtype: torch.dtype, device: Device = None,
                 tp: TensorParallel | None = None, quant: QuantPlan | None = None) -> None:
        """quant: which weights are held quantized (quant/plan.py); None: none."""
        super().__init__()
        self.config = config
        self.quant = quant  # the whole model's (each layer holds its rank's local shapes)
        self.tp = tp if tp is not None and tp.sums else None
        self.model = Model(config, moe_backend, attention_backend, mla_backend, dtype, device,
                           tp, quant)
        self.lm_head: nn.Parameter | None = None
        if not config.tie_word_embeddings:
            self.lm_head = nn.Parameter(
                torch.empty(self.model.embed_tokens.shape, dtype=dtype, device=device),
                requires_grad=False)  # [V, hidden] (this rank's rows under TP)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """input_ids [T], positions [T] int64 -> final hidden states [T, hidden]."""
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, V] in the model dtype (as HF). No fp32 copy here:
        at 1,024 rows and V 152k that copy cost 0.45 ms of a 30 ms decode step on the H200."""
        weight = self.model.embed_tokens if self.lm_head is None else self.lm_head
        logits = F.linear(hidden, weight)
        if self.tp is None:
            return logits
        return self.tp.all_gather_last(logits)[:, :self.config.vocab_size]

    def moe_blocks(self) -> list[SparseMoeBlock]:
        """The sparse MoE blocks, in layer order."""
        return [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, SparseMoeBlock)]

    def bind_expert_counters(self, counts: torch.Tensor | None) -> None:
        """Give MoE block j the row counts[j] ([E] int64) to add its routed tokens to; None
        stops counting."""
        for j, block in enumerate(self.moe_blocks()):
            block.expert_counts = None if counts is None else counts[j]

    def set_expert_count_mask(self, mask: torch.Tensor | None) -> None:
        """Count only the tokens whose mask ([T] int64) is 1 (CUDA-graph padding is 0); None
        counts every token."""
        for block in self.moe_blocks():
            block.count_mask = mask

    def bind_kv_caches(self, kv_caches: list[torch.Tensor | DsaLayerCache]) -> None:
        """Give each layer its cache: a tensor ([2, num_blocks, block_size, KVH, D] for GQA,
        MLA's latent [num_blocks, block_size, L + R], a shared DSA layer's latent) or, for a
        full DSA layer, a DsaLayerCache (the latent and the indexer keys); [] unbinds all.

        NOTE: layers keep these exact tensor objects; CUDA graphs captured later read them.
        """
        layers = self.model.layers
        if kv_caches and len(kv_caches) != len(layers):
            raise ValueError(f"got {len(kv_caches)} KV caches for {len(layers)} layers")
        for i, layer in enumerate(layers):
            cache = kv_caches[i] if kv_caches else None
            if isinstance(layer.self_attn, DsaAttention):
                layer.self_attn.bind_cache(cache)
            elif isinstance(cache, DsaLayerCache):
                raise ValueError(f"layer {i} is not a DSA layer: it takes one cache tensor")
            else:
                layer.self_attn.kv_cache = cache

    def dsa_layers(self) -> list[DsaAttention]:
        """The DSA attention layers, in order ([] for other models)."""
        return [layer.self_attn for layer in self.model.layers
                if isinstance(layer.self_attn, DsaAttention)]

    def set_mla_prefill(self, form: str) -> None:
        """"auto", "mha" or "absorbed" (PREFILL_FORMS) for every MLA layer (DSA's
        included)."""
        if form not in PREFILL_FORMS:
            raise ValueError(f"mla prefill form must be one of {', '.join(PREFILL_FORMS)}; "
                             f"got {form!r}")
        for layer in self.model.layers:
            if isinstance(layer.self_attn, MLAttention):
                layer.self_attn.prefill_form = form

    def set_mla_decode(self, form: str) -> None:
        """"auto", "split" or "flat" for every MLA layer's Triton decode (DSA's included)."""
        for layer in self.model.layers:
            if isinstance(layer.self_attn, MLAttention):
                layer.self_attn.set_decode_form(form)

    def decode_kernel_bounds(self) -> dict[int, str]:
        """Contexts past which a decode step's attention runs another kernel, each with what
        changes (the MLA layers' `decode_kernel_bounds`): the CUDA-graph decode captures a
        graph per bucket at each (runner/cuda_graphs.py's `context_bounds`)."""
        bounds: dict[int, str] = {}
        for layer in self.model.layers:
            attn_bounds = getattr(layer.self_attn, "decode_kernel_bounds", None)
            if attn_bounds is not None:
                bounds.update(attn_bounds())
        return bounds

    def dense_context_limit(self) -> int | None:
        """The context length up to which every DSA layer runs dense MLA whatever the host
        knows (its index_topk; layers/dsa.py's `_split_rows` reads meta.max_seq_len as the
        rows' bound): the CUDA-graph decode captures a graph per bucket at this bound and at
        larger ones (runner/cuda_graphs.py's `context_bounds`). None without DSA layers or
        when one is not "auto"."""
        layers = self.dsa_layers()
        if not layers or any(a.dsa_mode != "auto" for a in layers):
            return None
        return min(a.topk for a in layers)

    def set_dsa_mode(self, mode: str) -> None:
        """"auto" (sparse rows beyond index_topk), "dense" or "sparse" for every DSA layer."""
        if mode not in DSA_MODES:
            raise ValueError(f"dsa mode must be one of {', '.join(DSA_MODES)}; got {mode!r}")
        for attn in self.dsa_layers():
            attn.dsa_mode = mode
