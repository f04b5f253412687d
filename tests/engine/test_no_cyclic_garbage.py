"""A step leaves no reference cycles behind: a step's tensors (its metadata, DSA's selections,
activations) must be freed when the step is done, by reference counts. The engine raises the
garbage collector's threshold (gc_tuning.freeze_heap), so a cycle's tensors wait for a rare
collection: on the H200 a cycle through GLM-5's step metadata (`meta.derived` holding `meta`)
kept every step's selections alive, and W3's 32k prompts grew by gigabytes past the memory plan
until the engine died out of memory."""

from __future__ import annotations

import gc

import pytest
import torch

from moeserve import LLM, SamplingParams
from moeserve.kernels.attention.metadata import AttentionMetadata
from tests.models.checkpoints import write_tiny_checkpoint


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3", "glm_moe_dsa"])
def test_steps_leave_no_cyclic_garbage(tmp_path, arch: str, overlap: bool) -> None:
    # overlap: the GPU's default, step N+1 planned while step N's outputs are pending
    llm = LLM(write_tiny_checkpoint(arch, tmp_path), device="cpu", dtype="float32",
              moe_backend="grouped_mm", max_num_batched_tokens=96, async_scheduling=overlap)
    engine = llm.engine
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    gen = torch.Generator().manual_seed(0)
    for i in range(4):  # prompts past index_topk (8), chunked: sparse and mixed steps
        engine.add_request(f"r{i}", torch.randint(0, 200, (60 + 9 * i,), generator=gen).tolist(),
                           params)
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        steps = 0
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        garbage = list(gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        if enabled:
            gc.enable()
    assert steps > 4
    cyclic = [type(o).__name__ for o in garbage
              if torch.is_tensor(o) or isinstance(o, AttentionMetadata)]
    assert cyclic == [], f"{len(cyclic)} tensors / step metadata freed only by the collector"
