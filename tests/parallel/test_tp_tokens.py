"""One model over several processes (gloo, one torch thread each) gives the single process's
greedy tokens: tensor parallelism, expert parallelism and their mix, for every attention kind.

Each case starts real worker processes through the engine (parallel/executor.py) and serves a
batch of prompts of different lengths for 32 new tokens, with a token budget that chunks the
long prompts' prefill and a KV pool small enough that requests are preempted and recomputed.
The reference is the same engine on one process; the tiny fp32 checkpoints have peaked logits
(tests/models/checkpoints.py), so a misplaced shard changes the tokens.

    layouts: W = 2 as TP 2; W = 2 as attention TP 2 with MoE EP 2; W = 4 as attention TP 4
    with MoE TP 2 x EP 2 (qwen3_moe's 2 KV heads then replicated over pairs of ranks)
"""

from __future__ import annotations

import re

import pytest

from moeserve import LLM, SamplingParams
from tests.engine.test_generate_vs_hf import _prompts
from tests.models.checkpoints import write_tiny_checkpoint

NEW_TOKENS = 32
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
PROMPT_LENS = (41, 5, 17, 1)
# the budget chunks the 41-token prompt; 4 requests need up to (41 + 32) / 4 = 19 blocks
# each, and 40 blocks cannot hold them all at once: preemption
ENGINE = dict(device="cpu", dtype="float32", moe_backend="grouped_mm", torch_threads=1,
              block_size=4, num_blocks=40, max_model_len=96, max_num_batched_tokens=24,
              max_running_requests=4)
LAYOUTS = {"tp2": dict(tensor_parallel_size=2),
           "tp2-ep2": dict(tensor_parallel_size=2, enable_expert_parallel=True),
           "tp4-moe-tp2xep2": dict(tensor_parallel_size=4, expert_parallel_size=2)}
ARCHS = ("qwen3_moe", "mixtral", "deepseek_v3", "glm_moe_dsa")


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple]:
    """arch -> (checkpoint, prompts, the single process's tokens), built on first use."""
    cache: dict[str, tuple] = {}

    def get(arch: str) -> tuple:
        if arch not in cache:
            folder = write_tiny_checkpoint(arch, tmp_path_factory.mktemp(arch))
            prompts = _prompts(256, PROMPT_LENS, seed=3)
            llm = LLM(folder, **ENGINE)
            tokens = [r.token_ids for r in llm.generate(prompts, GREEDY)]
            assert llm.engine.scheduler.stats.num_preemptions > 0
            assert llm.engine.scheduler.stats.num_prefill_chunks > 1
            cache[arch] = (folder, prompts, tokens)
        return cache[arch]
    return get


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("arch", ARCHS)
def test_sharded_engine_gives_the_single_process_tokens(references, arch: str,
                                                        layout: str) -> None:
    folder, prompts, expected = references(arch)
    with LLM(folder, **ENGINE, **LAYOUTS[layout]) as llm:
        results = llm.generate(prompts, GREEDY)
        assert llm.engine.scheduler.stats.num_preemptions > 0
        assert llm.engine.runner.world_size == LAYOUTS[layout]["tensor_parallel_size"]
    assert [r.token_ids for r in results] == expected


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_a_quantized_checkpoint_at_two_ranks(tmp_path, fmt: str) -> None:
    """FP8 block-scaled and NVFP4 checkpoints, held quantized, each rank its slice of the packed
    tensors, give the single process's tokens at TP 2 + EP 2; NVFP4 also at TP 2. The FP8
    model's head_dim of 64 and dense width of 256 put the TP-2 cuts of o_proj and the dense
    down_proj (128 columns each) on its 128-groups. At TP 2 its
    experts' down_proj cut (96 of 192 columns) does not: those weights are held dequantized,
    which changes FP8's W8A8 arithmetic there (no activation quantization), so only the report
    and a full generation are checked."""
    from moeserve.quant.packed import QuantWeight
    from tests.quant.test_quantized_checkpoints import write_quantized_pair

    extra = {"head_dim": 64, "intermediate_size": 256} if fmt == "fp8" else {}
    folder, _, _ = write_quantized_pair("qwen3_moe", str(tmp_path), fmt, **extra)
    prompts = _prompts(256, (5, 17, 9), seed=4)
    kw = dict(device="cpu", dtype="float32", torch_threads=1, max_model_len=96)
    expected = [r.token_ids for r in LLM(folder, **kw).generate(prompts, GREEDY)]
    for layout in ("tp2-ep2", "tp2"):
        with LLM(folder, **kw, **LAYOUTS[layout]) as llm:
            got = [r.token_ids for r in llm.generate(prompts, GREEDY)]
            report = llm.report.format()
            if fmt == "fp8" and layout == "tp2":
                assert "each expert's down_proj: 96 columns a rank cut the fp8 groups" in report
                blocks = llm.engine.runner.model.moe_blocks()
                assert not isinstance(blocks[0].w2, QuantWeight)
                assert not isinstance(blocks[0].w13, QuantWeight)  # with w2, in one op
                assert [len(g) for g in got] == [GREEDY.max_tokens] * len(prompts)
                continue
            assert "cut the" not in report
            if fmt == "fp8":  # the ranks' partial sums add in another order, and W8A8's
                # rounding of activations to e4m3 can turn an ulp into a step late in a
                # sequence (measured: one prompt parts at token 25 of 32)
                got, want = [g[:16] for g in got], [e[:16] for e in expected]
            else:
                want = expected
            assert got == want, layout


def test_overlap_scheduling_over_ranks(references) -> None:
    """async_scheduling: rank 0 launches step N + 1 before it reads step N (the workers do the
    same); the tokens are the single process's."""
    folder, prompts, expected = references("qwen3_moe")
    with LLM(folder, **ENGINE, **LAYOUTS["tp2-ep2"], async_scheduling=True) as llm:
        results = llm.generate(prompts, GREEDY)
    assert [r.token_ids for r in results] == expected


@pytest.mark.parametrize("collectives", ["skipped", "run"])
def test_one_rank_through_the_distributed_path(references, monkeypatch, collectives) -> None:
    """distributed_at_one_rank: a world of one through the executor and the sharded layers
    (what the H200 measures against the plain path), its identity collectives skipped or run,
    gives the plain path's tokens."""
    if collectives == "run":
        monkeypatch.setenv("MOESERVE_COLLECTIVES_AT_ONE_RANK", "1")
    folder, prompts, expected = references("deepseek_v3")
    with LLM(folder, **ENGINE, distributed_at_one_rank=True) as llm:
        results = llm.generate(prompts, GREEDY)
        assert llm.engine.runner.world_size == 1 and llm.engine.runner.tp is not None
    assert [r.token_ids for r in results] == expected


def test_structured_outputs_over_two_ranks(references) -> None:
    """A grammar's bitmask crosses with the plan: both ranks mask and sample alike, so the
    sharded engine gives the single process's tokens, and the output holds to the grammar
    (the checkpoint's HF byte tokenizer as llguidance's vocabulary)."""
    from moeserve import StructuredOutput

    folder, prompts, _ = references("qwen3_moe")
    params = [SamplingParams(max_tokens=NEW_TOKENS, temperature=1.0, seed=s,
                             structured=StructuredOutput("regex", "[a-f]{3,20}"))
              for s in range(len(prompts))]
    expected = LLM(folder, **ENGINE).generate(prompts, params)
    with LLM(folder, **ENGINE, **LAYOUTS["tp2"]) as llm:
        results = llm.generate(prompts, params)
    assert [r.token_ids for r in results] == [r.token_ids for r in expected]
    assert all(re.fullmatch("[a-f]{3,20}", r.text) for r in results), [r.text for r in results]
