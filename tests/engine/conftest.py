from __future__ import annotations

import pytest
import torch


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
