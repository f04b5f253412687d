"""Model registry: HF architecture name -> module class, and `build_model`.

The MoE and attention backends are chosen once here, at construction (by registry name or as
the function itself), and stored in the layers; nothing is looked up per step.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from moeserve.kernels.registry import get_attention_backend, get_mla_backend, get_moe_backend
from moeserve.model_config import SUPPORTED_ARCHITECTURES, ModelConfig
from moeserve.models.decoder import CausalLM
from moeserve.parallel.comm import TensorParallel
from moeserve.quant.plan import QuantPlan

MODEL_CLASSES: dict[str, type[CausalLM]] = dict.fromkeys(SUPPORTED_ARCHITECTURES, CausalLM)



def build_model(model_config: ModelConfig, dtype: torch.dtype | str,
                device: torch.device | str, moe_backend: str | Callable,
                attention_backend: str | Callable,
                mla_backend: str | Callable | None = None, dsa_mode: str = "auto",
                tp: TensorParallel | None = None, quant: QuantPlan | None = None,
                mla_prefill: str = "auto", mla_decode: str = "auto") -> CausalLM:
    """Build the model with uninitialised weights (load_weights or init_dummy_weights fill them).

    Args:
        dtype: torch dtype or its name ("bfloat16").
        moe_backend: a name from kernels.registry ("torch", "grouped_mm") or the backend function.
        attention_backend: a name from kernels.registry ("torch") or the backend function.
        mla_backend: MLA's absorbed attention, by name or function; None: the one registered
            under attention_backend's name (the torch reference when that is a function).
        dsa_mode: DeepSeek Sparse Attention models: "auto" (the indexer's top-k for contexts
            beyond index_topk, dense MLA below), "dense" or "sparse" (layers/dsa.py).
        tp: this rank's shard and its collectives under tensor / expert parallelism; None
            builds the whole model.
        quant: the weights held quantized and their format (quant/plan.py); None: every
            weight in `dtype`.
        mla_prefill: MLA models: "auto", "mha" or "absorbed", how rows with several queries
            attend (layers/mla.py's prefill_form).
        mla_decode: MLA models: "auto", "split" or "flat", the Triton decode form
            (layers/mla.py's set_decode_form).
    """
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    moe_fn = get_moe_backend(moe_backend) if isinstance(moe_backend, str) else moe_backend
    attn_fn = (get_attention_backend(attention_backend) if isinstance(attention_backend, str)
               else attention_backend)
    if mla_backend is None:
        mla_backend = attention_backend if isinstance(attention_backend, str) else "torch"
    mla_fn = get_mla_backend(mla_backend) if isinstance(mla_backend, str) else mla_backend
    cls = MODEL_CLASSES[model_config.architecture]
    model = cls(model_config, moe_fn, attn_fn, mla_fn, dtype, torch.device(device), tp,
                quant).eval()
    model.set_dsa_mode(dsa_mode)
    model.set_mla_prefill(mla_prefill)
    model.set_mla_decode(mla_decode)
    return model
