"""Decode CUDA graphs: the bucket spacing, and the static-buffer decode path against eager.

On CPU the graphs are not captured; `init_decode_graphs(capture=False)` keeps the static buffers
and runs them eagerly, so padding rows, staging, multi-step `advance` and the expert-count mask
are checked everywhere. On the GPU (`-m gpu`) the same tests capture and replay real graphs.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moeserve import LLM, SamplingParams
from moeserve.runner.cuda_graphs import (
    DecodeGraphs,
    bucket_padding,
    context_bounds,
    graph_batch_sizes,
)
from tests.engine.test_generate_vs_hf import _prompts, hf_greedy
from tests.models.checkpoints import write_tiny_checkpoint

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("cap", [1, 7, 64, 100, 256, 1000, 2048, 4096])
def test_buckets_cover_every_batch_with_padding_under_10_percent(cap: int) -> None:
    sizes = graph_batch_sizes(cap)
    assert sizes[0] == 1 and sizes[-1] == cap
    assert sizes == sorted(set(sizes))
    for b in range(1, cap + 1):  # the bucket each batch pads to
        bucket = next(s for s in sizes if s >= b)
        assert (bucket - b) / bucket < 0.1, (b, bucket)
    assert bucket_padding(sizes) < 0.1
    if cap >= 2048:
        assert len(sizes) < 80  # capture time stays bounded


def test_bad_bucket_bound_is_refused() -> None:
    with pytest.raises(ValueError, match="max_batch"):
        graph_batch_sizes(0)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[list[int]], list]:
    folder = str(write_tiny_checkpoint("qwen3_moe", tmp_path_factory.mktemp("graphs")))
    prompts = _prompts(256, (5, 17, 9, 12, 3))
    return folder, prompts, hf_greedy(folder, prompts, GREEDY.max_tokens)


def _graph_llm(folder: str, device: str, max_batch: int, **kw: object) -> LLM:
    if device == "cuda":
        kw.setdefault("mem_fraction", 0.1)
        kw.setdefault("moe_tune_budget_s", 0)  # no start-up tune of the tiny MoE shape
    kw.setdefault("max_model_len", 64)  # the decode graphs' partitions span max_model_len
    # the graph path's metadata is what the Triton attention reads; the MoE backend only needs
    # to be capturable (fp32 grouped_mm syncs on CUDA; Triton's interpreter is slow on CPU)
    llm = LLM(folder, device=device, dtype="float32", attention_backend="triton",
              moe_backend="triton" if device == "cuda" else "grouped_mm", **kw)
    runner = llm.engine.runner
    if runner.graphs is None or runner.graphs.max_batch != max_batch:  # CPU: static buffers
        runner.init_decode_graphs(max_batch, llm.engine.cfg.scheduler.max_model_len,
                                  capture=device == "cuda")
    return llm


@pytest.mark.parametrize("max_batch", [8, 3])  # 5 requests: padded to 8; or some run eager
def test_graph_decode_matches_hf(device: str, ckpt: tuple, max_batch: int) -> None:
    folder, prompts, expected = ckpt
    llm = _graph_llm(folder, device, max_batch, cuda_graph_max_batch_size=max_batch)
    results = llm.generate(prompts, GREEDY)
    assert [r.token_ids for r in results] == expected
    runner = llm.engine.runner
    fits = max_batch >= len(prompts)  # else the five-row decode steps have no graph
    assert (runner.num_graph_steps > 0) == fits
    if device == "cuda":
        assert bool(runner.graphs.graphs)
        assert (runner.num_eager_decode_fallbacks > 0) == (not fits)  # counted on CUDA only
    else:
        assert runner.num_eager_decode_fallbacks == 0


def test_graph_decode_with_overlap_and_multi_step(device: str, ckpt: tuple) -> None:
    folder, prompts, expected = ckpt
    for kw in ({"async_scheduling": True}, {"num_continuous_decode_steps": 4}):
        llm = _graph_llm(folder, device, 8, cuda_graph_max_batch_size=8, **kw)
        results = llm.generate(prompts, GREEDY)
        assert [r.token_ids for r in results] == expected, kw
        assert llm.engine.runner.num_graph_steps > 0


def test_padding_rows_are_not_counted_as_expert_load(device: str, ckpt: tuple) -> None:
    folder, prompts, _ = ckpt
    llm = _graph_llm(folder, device, 8, cuda_graph_max_batch_size=8)
    assert_only_real_tokens_routed(llm, prompts, GREEDY)


def assert_only_real_tokens_routed(llm: LLM, prompts: list[list[int]],
                                   params: SamplingParams) -> None:
    """Generate, then check the expert-load counters: every real token routed once per MoE
    layer, no padding row counted."""
    llm.generate(prompts, params)
    load = llm.engine.runner.expert_load()
    top_k = llm.engine.model_config.num_experts_per_tok
    computed = sum(len(p) for p in prompts) + len(prompts) * (params.max_tokens - 1)
    for layer in load["tokens_per_expert"]:
        assert sum(layer) == computed * top_k


def test_capacity_report_says_why_graphs_are_off_on_cpu(ckpt: tuple) -> None:
    folder, _, _ = ckpt
    report = LLM(folder, device="cpu", dtype="float32").report
    assert report.cuda_graphs.startswith("off: CPU")
    assert "cuda_graphs" in report.phase_seconds


def test_mla_graph_decode_matches_hf(device: str, tmp_path_factory: pytest.TempPathFactory
                                     ) -> None:
    """MLA decode (GLM-4.7-Flash) through the graphs' static buffers (captured on CUDA): the
    absorbed Triton kernel over the latent cache, 5 requests padded to a bucket of 8, with and
    without overlap."""
    folder = str(write_tiny_checkpoint("glm4_moe_lite", tmp_path_factory.mktemp("mla")))
    prompts = _prompts(256, (5, 17, 9, 12, 3))
    expected = hf_greedy(folder, prompts, GREEDY.max_tokens)
    for kw in ({}, {"async_scheduling": True}):
        llm = _graph_llm(folder, device, 8, cuda_graph_max_batch_size=8, **kw)
        results = llm.generate(prompts, GREEDY)
        assert [r.token_ids for r in results] == expected, kw
        assert llm.engine.runner.num_graph_steps > 0
        if device == "cuda":
            assert llm.engine.runner.num_eager_decode_fallbacks == 0


class _ShortModel(torch.nn.Module):
    """A stand-in model whose dense_context_limit is 8 (as a DSA model's index_topk)."""

    def dense_context_limit(self) -> int:
        return 8


class _KernelBoundModel(torch.nn.Module):
    """A stand-in model whose decode changes kernel past 16 keys (as an MLA model's past
    decode_gluon.WS_SHORT_CONTEXT), and past 4,096 (beyond max_model_len: no graph)."""

    def decode_kernel_bounds(self) -> dict[int, str]:
        return {16: "a longer-context kernel past it", 4096: "never reached"}


def test_context_bounds() -> None:
    """index_topk, then 8x bounds below max_model_len, then max_model_len; one bound without
    a dense limit below max_model_len; kernel bounds below max_model_len merged in."""
    assert context_bounds(2048, 202752) == (2048, 16384, 131072, 202752)
    assert context_bounds(2048, 33280) == (2048, 16384, 33280)
    assert context_bounds(2048, 16384) == (2048, 16384)
    assert context_bounds(8, 64) == (8, 64) and context_bounds(8, 65) == (8, 64, 65)
    assert context_bounds(None, 4096) == (4096,) and context_bounds(4096, 4096) == (4096,)
    assert context_bounds(None, 4096, kernel_bounds=(1024,)) == (1024, 4096)
    assert context_bounds(None, 1024, kernel_bounds=(1024, 2048)) == (1024,)
    assert context_bounds(2048, 202752, kernel_bounds=(1024, 16384)) == (
        1024, 2048, 16384, 131072, 202752)


def test_a_kernel_bound_gets_its_graphs_and_short_steps_replay_them() -> None:
    """A model's decode kernel bound: a graph per bucket at it and at max_model_len; a step of
    rows within it stages the bound (its metadata's max_seq_len: what decode_gluon routes
    by), one reaching past it max_model_len; the report says what changes there."""
    graphs = DecodeGraphs(_KernelBoundModel(), [1, 2], 64, 4, torch.device("cpu"))
    assert graphs.bounds == (16, 64) and graphs.dense_context is None
    ids = np.array([5, 6], dtype=np.int64)
    tables = [list(range(1, 17)), list(range(17, 33))]
    for positions, steps, bound in (([3, 14], 1, 16), ([3, 15], 1, 16), ([3, 15], 2, 64),
                                    ([16, 0], 1, 64)):
        graphs.stage(ids, np.array(positions, dtype=np.int64), tables, 2, steps)
        assert graphs.bound == bound, (positions, steps)
    assert "2 context bounds 16, 64 (16: a longer-context kernel past it)" in graphs.report(0.0)


def test_stage_picks_the_smallest_context_bound_every_context_stays_within() -> None:
    """DecodeGraphs of a model with a dense limit: `stage` picks the smallest bound that every
    row's context stays within after all of the round's steps, and its metadata carries it as
    max_seq_len (what layers/dsa.py and the indexer read); a model without the limit keeps
    one graph a bucket at max_model_len."""
    cpu = torch.device("cpu")
    graphs = DecodeGraphs(_ShortModel(), [1, 2, 4], 128, 4, cpu)
    assert graphs.bounds == (8, 64, 128) and graphs.dense_context == 8
    ids = np.array([5, 6], dtype=np.int64)
    tables = [list(range(1, 33)), list(range(33, 65))]
    for positions, steps, bound in (([3, 6], 1, 8), ([3, 7], 1, 8), ([3, 7], 2, 64),
                                    ([8, 0], 1, 64), ([2, 4], 4, 8), ([2, 4], 5, 64),
                                    ([63, 1], 1, 64), ([63, 1], 2, 128), ([127, 0], 1, 128)):
        graphs.stage(ids, np.array(positions, dtype=np.int64), tables, 2, steps)
        assert graphs.bound == bound, (positions, steps)
        assert graphs.metadata(2, graphs.bound).max_seq_len == bound
    assert graphs.metadata(2).max_seq_len == 128
    assert "3 context bounds 8, 64, 128" in graphs.report(0.0)
    plain = DecodeGraphs(torch.nn.Module(), [1, 2], 64, 4, cpu)
    assert plain.bounds == (64,) and plain.dense_context is None
    plain.stage(ids, np.array([1, 2], dtype=np.int64), [[1], [2]], 2)
    assert plain.bound == 64 and "context bounds" not in plain.report(0.0)


class _DerivedModel(torch.nn.Module):
    """A stand-in model that, as the attention layers do, computes a tensor once a step into
    meta.derived (from the step's device inputs) and reuses it."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        if "twice" not in meta.derived:
            meta.derived["twice"] = meta.seq_lens.float() * 2
        return meta.derived["twice"][:, None].repeat(1, 4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_captured_graph_recomputes_what_the_step_derives() -> None:
    """What a layer derives into meta.derived is captured (recomputed from each replay's
    staged inputs), not the warm-up's tensor baked into the graph: the warm-up ran on the same
    buckets, and its tensor was freed after the capture (a served MLA decode with its rows
    longest first read freed memory this way: an illegal address)."""
    graphs = DecodeGraphs(_DerivedModel(), [2, 4], 64, 4, torch.device("cuda"))
    graphs.capture()
    ids = np.array([5, 6, 7], dtype=np.int64)
    graphs.stage(ids, np.array([4, 8, 30], dtype=np.int64), [[1, 2], [3, 4, 5], [6] * 8], 4)
    torch.cuda.empty_cache()
    out = graphs.replay(4)
    assert out[:, 0].tolist() == [10.0, 18.0, 62.0, 2.0]  # 2 x (position + 1); padding 2 x 1
