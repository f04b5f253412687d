from __future__ import annotations

import pytest
import torch

from moeserve import LLM


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request: pytest.FixtureRequest) -> str:
    """Each engine test runs on CPU in CI and again on the GPU machine (`pytest -m gpu`), in fp32
    with TF32 off so greedy tokens must equal transformers' on CPU."""
    if request.param == "cuda":
        if not torch.cuda.is_available():
            pytest.fail("a gpu-marked test ran without a CUDA device")
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    return request.param


def tiny_llm(device: str, **kw: object) -> LLM:
    """tiny-moe in fp32 on `device`; on CUDA with a small share of the GPU's memory (so the
    admission cap, and the decode graphs captured up to it, stay small) and no start-up MoE
    tune of its shape: a test's engine starts in seconds."""
    if device == "cuda":
        kw.setdefault("mem_fraction", 0.05)
        kw.setdefault("moe_tune_budget_s", 0)
    kw.setdefault("max_model_len", 256)
    return LLM("tiny-moe", device=device, **{"dtype": "float32", **kw})
