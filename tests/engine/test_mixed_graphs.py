"""Mixed-step piecewise CUDA graphs (runner/mixed_graphs.py): buckets, and greedy tokens equal to
transformers' through mixed steps run piece by piece.

On CPU nothing is captured: `init_mixed_graphs(capture=False)` keeps the static buffers and runs
the pieces eagerly with each attention between them, so the staging, padding rows, the state
hand-off between pieces and the expert-count mask are checked everywhere. On the GPU
(`-m gpu`) the engine captures the pieces at start-up (`mixed_cuda_graphs=True`) and replays
them, with the Triton kernels, in fp32 with TF32 off.
"""

from __future__ import annotations

import pytest
import torch

from moeserve import LLM, SamplingParams
from moeserve.runner.cuda_graphs import bucket_padding
from moeserve.runner.mixed_graphs import (
    MIN_MIXED_TOKENS,
    MIXED_MAX_PADDING,
    MixedGraphs,
    _rebuild,
    _skeleton,
    _tensors,
    mixed_token_buckets,
)
from tests.engine.test_cuda_graphs import assert_only_real_tokens_routed
from tests.engine.test_generate_vs_hf import _prompts, hf_greedy
from tests.models.checkpoints import write_tiny_checkpoint

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
BUDGET = 24  # tokens a step: the longer prompts are chunked beside the others' decodes
PROMPT_LENS = (5, 31, 9, 12, 3, 40)


@pytest.mark.parametrize("budget", [2, 3, 24, 100, 8192, 32768])
def test_buckets_cover_every_step_with_bounded_padding(budget: int) -> None:
    sizes = mixed_token_buckets(budget)
    assert sizes[0] == MIN_MIXED_TOKENS and sizes[-1] == budget
    assert sizes == sorted(set(sizes))
    assert bucket_padding([1, *sizes]) < MIXED_MAX_PADDING


def test_a_budget_too_small_for_a_mixed_step_is_refused() -> None:
    with pytest.raises(ValueError, match="token budget >= 2"):
        mixed_token_buckets(1)


def test_state_structures_round_trip() -> None:
    from moeserve.layers.mla import MlaState, Projected

    t = [torch.full((3, 2), float(i)) for i in range(7)]
    state = MlaState(t[0], t[1], Projected(t[2], t[3], t[4], t[5], t[6]))
    flat = list(_tensors(state))
    assert [int(x[0, 0]) for x in flat] == list(range(7))
    skeleton = _skeleton(state)
    assert not list(_tensors(skeleton))  # holds no tensor (no memory kept alive)
    back = _rebuild(skeleton, (x[:1] for x in flat))
    assert isinstance(back, MlaState) and isinstance(back.proj, Projected)
    assert back.proj.sin.shape == (1, 2) and int(back.proj.sin[0, 0]) == 6
    assert _rebuild(_skeleton(t[0]), iter([t[1]])) is t[1]


@pytest.fixture(scope="module", params=["qwen3_moe", "glm4_moe_lite"])
def ckpt(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
         ) -> tuple[str, list[list[int]], list]:
    """A GQA family and an MLA one (its first layer dense, shared experts, sigmoid routing)."""
    folder = str(write_tiny_checkpoint(request.param, tmp_path_factory.mktemp(request.param)))
    prompts = _prompts(256, PROMPT_LENS)
    return folder, prompts, hf_greedy(folder, prompts, GREEDY.max_tokens)


def _mixed_llm(folder: str, device: str, **kw: object) -> LLM:
    kw.setdefault("max_num_batched_tokens", BUDGET)
    kw.setdefault("max_model_len", 64)
    if device == "cuda":  # captured at start-up, beside the decode graphs
        llm = LLM(folder, device="cuda", dtype="float32", attention_backend="triton",
                  moe_backend="triton", mem_fraction=0.1, moe_tune_budget_s=0,
                  mixed_cuda_graphs=True, **kw)
        assert llm.engine.runner.mixed_graphs is not None, llm.report.cuda_graphs
        assert llm.engine.runner.mixed_graphs.graphs, "no piece was captured"
        assert "mixed steps on:" in llm.report.cuda_graphs
        return llm
    llm = LLM(folder, device="cpu", dtype="float32", **kw)
    llm.engine.runner.init_mixed_graphs(BUDGET, capture=False)
    return llm


def test_mixed_steps_through_pieces_match_hf(device: str, ckpt: tuple) -> None:
    folder, prompts, expected = ckpt
    llm = _mixed_llm(folder, device)
    runner = llm.engine.runner
    staged = []
    real_run = runner.mixed_graphs.run

    def run(input_ids: torch.Tensor, meta: object, bucket: int) -> torch.Tensor:
        staged.append((input_ids.shape[0], bucket))
        return real_run(input_ids, meta, bucket)

    runner.mixed_graphs.run = run
    results = llm.generate(prompts, GREEDY)
    assert [r.token_ids for r in results] == expected
    assert runner.num_mixed_graph_steps == len(staged) > 1
    assert llm.engine.scheduler.stats.num_prefill_chunks > 0  # chunks beside decodes
    assert any(bucket > t for t, bucket in staged), staged  # padding rows ran
    assert all(t <= bucket <= BUDGET for t, bucket in staged), staged


def test_mixed_steps_with_overlap_and_a_prefix_hit(device: str, ckpt: tuple) -> None:
    """Overlap scheduling (a step's inputs include the previous launch's tokens) and a second
    round of the same prompts (prefix hits: prompt rows whose context is already cached)."""
    folder, prompts, expected = ckpt
    llm = _mixed_llm(folder, device, async_scheduling=True)
    for _ in range(2):
        results = llm.generate(prompts, GREEDY)
        assert [r.token_ids for r in results] == expected
    assert llm.engine.scheduler.stats.num_prefix_hit_tokens > 0
    assert llm.engine.runner.num_mixed_graph_steps > 0


def test_padding_rows_are_not_counted_as_expert_load(device: str, ckpt: tuple) -> None:
    folder, prompts, _ = ckpt
    assert_only_real_tokens_routed(_mixed_llm(folder, device), prompts, GREEDY)


def test_a_step_larger_than_the_buckets_is_refused(ckpt: tuple) -> None:
    folder, _, _ = ckpt
    llm = _mixed_llm(folder, "cpu")
    graphs: MixedGraphs = llm.engine.runner.mixed_graphs
    ids = torch.zeros(5, dtype=torch.int64)
    with pytest.raises(ValueError, match="do not fit bucket 4"):
        graphs.run(ids, None, 4)
    assert graphs.bucket(BUDGET + 1) is None


def test_the_memory_plan_reserves_the_mixed_graphs(ckpt: tuple) -> None:
    """With mixed graphs on, the plan leaves their pool (up to a forward's activation peak) and
    their static buffers (16 hidden widths a token of the budget) beside the decode graphs'."""
    import dataclasses

    folder, _, _ = ckpt
    core = LLM(folder, device="cpu", dtype="float32", max_num_batched_tokens=BUDGET).engine
    base = core._graph_reserve(1000)
    core.cfg = dataclasses.replace(core.cfg, mixed_cuda_graphs=True)
    width = 16 * core.model_config.hidden_size * 4  # fp32
    assert core._graph_reserve(1000) == base + 1000 + BUDGET * width
    core.cfg = dataclasses.replace(core.cfg, enforce_eager=True)
    assert core._graph_reserve(1000) == 0
