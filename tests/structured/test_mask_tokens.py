"""The sampler's grammar mask (`mask_tokens_`) against a bit-by-bit reference, and a masked
step's tokens: always allowed ones, the unmasked rows' unchanged."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moeserve.layers import sampler as sampler_module
from moeserve.layers.sampler import mask_tokens_
from moeserve.runner.step_sampling import GrammarMask, sample_step
from moeserve.types import SamplingParams


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request: pytest.FixtureRequest) -> str:
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.fail("a gpu-marked test ran without a CUDA device")
    return request.param


def _reference(logits: torch.Tensor, rows: list[int], bitmask: np.ndarray) -> torch.Tensor:
    out = logits.clone()
    for j, r in enumerate(rows):
        for v in range(logits.shape[1]):
            if not (int(bitmask[j, v // 32]) >> (v % 32)) & 1:
                out[r, v] = float("-inf")
    return out


@pytest.mark.parametrize("vocab", [32, 45, 100])  # a whole word, a partial last word
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mask_matches_the_bit_reference(device: str, vocab: int, dtype: torch.dtype,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sampler_module, "_ROW_CHUNK_ELEMENTS", 2 * vocab)  # several chunks
    rng = np.random.default_rng(0)
    logits = torch.randn(7, vocab, dtype=dtype, device=device)
    rows = [6, 0, 3, 4]
    bitmask = rng.integers(-2**31, 2**31, size=(len(rows), (vocab + 31) // 32), dtype=np.int64)
    bitmask = bitmask.astype(np.int32)  # negative words too: bit 31 set
    expect = _reference(logits.cpu(), rows, bitmask)
    mask_tokens_(logits, torch.tensor(rows, device=device), torch.from_numpy(bitmask).to(device))
    torch.testing.assert_close(logits.cpu(), expect, rtol=0, atol=0)


def test_a_masked_step_samples_allowed_tokens_and_leaves_other_rows(device: str) -> None:
    vocab, rows = 64, 6
    logits = torch.randn(rows, vocab, device=device) * 4
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=3)] * 3
    seeds, positions, ids = [5] * rows, list(range(rows)), [str(i) for i in range(rows)]
    free = sample_step(logits.clone(), params, seeds, positions, ids, {})
    allowed = {1: [7, 40], 4: [63]}  # rows 1 and 4 under a grammar
    bitmask = np.zeros((2, 2), dtype=np.uint32)
    for j, row in enumerate(allowed):
        for v in allowed[row]:
            bitmask[j, v // 32] |= np.uint32(1 << (v % 32))
    grammar = GrammarMask(torch.tensor(list(allowed), device=device),
                          torch.from_numpy(bitmask.view(np.int32)).to(device))
    masked = sample_step(logits.clone(), params, seeds, positions, ids, {}, grammar)
    tokens, free_tokens = masked.token_ids.tolist(), free.token_ids.tolist()
    assert tokens[1] in allowed[1] and tokens[4] == 63
    assert [t for i, t in enumerate(tokens) if i not in allowed] == \
        [t for i, t in enumerate(free_tokens) if i not in allowed]
