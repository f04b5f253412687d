"""On one GPU: a world of one through NCCL (distributed_at_one_rank) with overlap scheduling
and CUDA graphs, the collectives run anyway (MOESERVE_COLLECTIVES_AT_ONE_RANK; served, a world
of one skips them) and captured inside the decode graphs, gives exactly the plain path's tokens
in fp32 (TF32 off), with no decode step outside the graphs.

Not in bf16: under tensor parallelism a MoE layer's parts (its k expert rows and the shared
experts' row) are summed before the all-reduce, in the activation dtype, where one process
hands them to the next norm, which sums them in fp32; so in bf16 the two paths round apart
(measured on the H200: tiny deepseek_v3's tokens part after 27 of 32)."""

from __future__ import annotations

import pytest
import torch

from moeserve import LLM, SamplingParams
from tests.engine.test_generate_vs_hf import _prompts
from tests.models.checkpoints import write_tiny_checkpoint

pytestmark = pytest.mark.gpu
GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
ENGINE = dict(device="cuda", dtype="float32", moe_backend="triton", attention_backend="triton",
              mem_fraction=0.1, moe_tiles="default", max_model_len=128)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_one_rank_over_nccl_matches_the_plain_path(tmp_path, arch: str, no_tf32,
                                                  monkeypatch) -> None:
    monkeypatch.setenv("MOESERVE_COLLECTIVES_AT_ONE_RANK", "1")
    folder = write_tiny_checkpoint(arch, tmp_path / arch)
    prompts = _prompts(256, (41, 5, 17, 1, 9, 30), seed=5)
    plain = LLM(folder, **ENGINE)
    expected = [r.token_ids for r in plain.generate(prompts, GREEDY)]
    del plain
    torch.cuda.empty_cache()
    with LLM(folder, **ENGINE, distributed_at_one_rank=True) as llm:
        got = [r.token_ids for r in llm.generate(prompts, GREEDY)]
        runner = llm.engine.runner
        assert runner.tp is not None and runner.world_size == 1
        assert llm.report.cuda_graphs.startswith("on"), llm.report.cuda_graphs
        assert runner.num_graph_steps > 0 and runner.num_eager_decode_fallbacks == 0
    assert got == expected
