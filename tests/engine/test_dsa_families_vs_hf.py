"""End to end for the DeepSeek Sparse Attention families (GLM-5's GlmMoeDsa, DeepSeek-V3.2):
moeserve's greedy outputs equal transformers' generate, token for token, in fp32, on tiny random
checkpoints written by transformers' own classes (8 or 16 indexer heads, index_topk 8, so every
prompt of 16 to 128 tokens really selects). The GLM-5 one has a "shared" indexer layer, the
V3.2 one is sharded and carries an MTP layer. Paths: a batch of different lengths, chunked
prefill, prefix hits, preemption, overlap, the CUDA-graph decode buffers, the Triton DSA
kernels (attention_backend "triton", the interpreter on CPU); each test asserts its path ran,
and that no selection had a tie at its k-th place (transformers' torch.topk orders ties in an
implementation-defined way; moeserve breaks them to the lowest position: without a tie both
select the same positions). Then the dense paths: a context of at most index_topk runs
dense MLA (and equals transformers), and dsa="dense" drops the indexer (and differs from
transformers on long prompts: the selection really drops tokens).
"""

from __future__ import annotations

import pytest
import torch

from moeserve import LLM, SamplingParams
from moeserve.kernels.registry import DSA_BACKENDS
from moeserve.layers.dsa import DsaAttention, DsaLayerCache
from tests.engine.test_generate_vs_hf import (
    NEW_TOKENS,
    _prompts,
    check_prefix_hits_match_hf,
    hf_greedy,
)
from tests.engine.test_mla_families_vs_hf import _llm as mla_llm
from tests.models.checkpoints import write_mtp_tensors, write_tiny_checkpoint

ARCHS = ("glm_moe_dsa", "deepseek_v32")
PROMPT_LENS = (16, 57, 128, 33)  # every one beyond index_topk 8
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, list, list]]:
    """arch -> (folder, prompts, HF greedy outputs)."""
    result = {}
    for arch in ARCHS:
        folder = str(write_tiny_checkpoint(arch, tmp_path_factory.mktemp(arch),
                                           sharded=arch == "deepseek_v32"))
        if arch == "deepseek_v32":
            write_mtp_tensors(folder, num_layers=3, hidden=64)
        prompts = _prompts(256, PROMPT_LENS)
        result[arch] = (folder, prompts, hf_greedy(folder, prompts))
    return result


def _llm(folder: str, device: str, **kw: object) -> LLM:
    llm = mla_llm(folder, device, **kw)
    for attn in _dsa_layers(llm):
        if attn.indexer is not None:
            attn.indexer.count_ties = True
    return llm


def _dsa_layers(llm: LLM) -> list[DsaAttention]:
    return llm.engine.runner.model.dsa_layers()


def _assert_sparse_ran_without_ties(llm: LLM) -> None:
    layers = _dsa_layers(llm)
    assert layers and all(a.tokens_sparse > 0 for a in layers)
    assert all(a.indexer.boundary_ties == 0 for a in layers if a.indexer is not None)


@pytest.mark.parametrize("arch", ARCHS)
def test_batch_matches_hf(device: str, checkpoints: dict, arch: str) -> None:
    folder, prompts, expected = checkpoints[arch]
    llm = _llm(folder, device)
    results = llm.generate(prompts, GREEDY)
    assert [r.token_ids for r in results] == expected
    _assert_sparse_ran_without_ties(llm)
    computed = sum(PROMPT_LENS) + len(prompts) * (NEW_TOKENS - 1)
    for attn in _dsa_layers(llm):  # every context beyond index_topk: nothing ran dense
        assert attn.tokens_sparse == computed
        assert attn.tokens_absorbed == attn.tokens_up_projected == 0
    report = llm.report.format()
    assert "DSA indexer key 128 B (32) x" in report and "index_topk 8" in report
    triton = llm.engine.cfg.attention_backend == "triton"  # which DSA kernels ran
    assert ("Triton kernels" if triton else "the torch references (attention_backend") in report
    if arch == "glm_moe_dsa":  # layer 1 "shared": no indexer, no indexer cache
        shared = _dsa_layers(llm)[1]
        assert shared.indexer is None and shared.index_cache is None
        assert shared.source_layer == 0
        assert "2 full layers, 1 sharing the selection" in report
    else:  # its MTP layer was recognised and left out
        assert "8 tensors left out: 1 MTP layer(s)" in report


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_matches_hf(device: str, checkpoints: dict, arch: str) -> None:
    folder, prompts, expected = checkpoints[arch]
    llm = _llm(folder, device, max_num_batched_tokens=16)
    results = llm.generate(prompts, GREEDY)
    assert llm.engine.scheduler.stats.num_prefill_chunks > 1
    assert [r.token_ids for r in results] == expected
    _assert_sparse_ran_without_ties(llm)


@pytest.mark.parametrize("arch", ARCHS)
def test_prefix_cache_hits_match_hf(device: str, checkpoints: dict, arch: str) -> None:
    folder, _, _ = checkpoints[arch]
    made: list[LLM] = []

    def make_llm(**kw: object) -> LLM:
        made.append(_llm(folder, device, **kw))
        return made[-1]

    check_prefix_hits_match_hf(folder, make_llm)  # asserts the hits and HF's outputs
    _assert_sparse_ran_without_ties(made[0])


@pytest.mark.parametrize("arch", ARCHS)
def test_preemption_matches_hf(device: str, checkpoints: dict, arch: str) -> None:
    folder, prompts, expected = checkpoints[arch]
    # the four requests need 362 tokens = 91 blocks of 4; 69 cannot hold them at once
    llm = _llm(folder, device, block_size=4, num_blocks=70, max_model_len=192,
               max_running_requests=4)
    results = llm.generate(prompts, GREEDY)
    assert llm.engine.scheduler.stats.num_preemptions > 0
    assert [r.token_ids for r in results] == expected
    _assert_sparse_ran_without_ties(llm)


def test_async_scheduling_matches_hf(device: str, checkpoints: dict) -> None:
    folder, prompts, expected = checkpoints["glm_moe_dsa"]
    llm = _llm(folder, device, async_scheduling=True, max_num_batched_tokens=16)
    results = llm.generate(prompts, GREEDY)
    assert llm.engine.scheduler.stats.num_prefill_chunks > 1
    assert [r.token_ids for r in results] == expected
    _assert_sparse_ran_without_ties(llm)


@pytest.mark.parametrize("arch", ARCHS)
def test_triton_graph_decode_matches_hf(device: str, checkpoints: dict, arch: str) -> None:
    """The Triton DSA kernels in the decode graphs: captured at start-up on CUDA (the engine
    allows DSA graphs on the triton backend), static buffers replayed eagerly on CPU (the
    interpreter); every row sparse, transformers' tokens."""
    folder, _, _ = checkpoints[arch]
    prompts = _prompts(256, (5, 16))
    expected = hf_greedy(folder, prompts, 6)
    kw = {"moe_backend": "triton", "moe_tune_budget_s": 0} if device == "cuda" else {}
    llm = _llm(folder, device, attention_backend="triton", max_model_len=64,
               cuda_graph_max_batch_size=4, **kw)
    runner = llm.engine.runner
    if device == "cuda":
        assert runner.graphs is not None and runner.graphs.graphs, llm.report.cuda_graphs
    else:
        runner.init_decode_graphs(4, 64, capture=False)
    results = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0,
                                                   ignore_eos=True))
    assert runner.num_graph_steps > 0
    assert [r.token_ids for r in results] == expected
    assert all(a.dsa_ops is DSA_BACKENDS["triton"] for a in _dsa_layers(llm))
    if device == "cuda":
        assert runner.num_eager_decode_fallbacks == 0


@pytest.mark.parametrize("arch", ARCHS)
def test_graph_buffer_decode_matches_hf(device: str, checkpoints: dict, arch: str) -> None:
    """Decode through the CUDA-graph static buffers (eager replays on CPU): their host lengths
    are placeholders, so every row takes the sparse path, deciding on device tensors alone;
    short contexts (a 5-token prompt crossing index_topk) select everything there."""
    folder, _, _ = checkpoints[arch]
    prompts = _prompts(256, (5, 16, 40))
    expected = hf_greedy(folder, prompts, 12)
    llm = _llm(folder, device, max_model_len=64)
    runner = llm.engine.runner
    runner.init_decode_graphs(4, 64, capture=False)
    results = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0,
                                                   ignore_eos=True))
    assert runner.num_graph_steps > 0
    assert [r.token_ids for r in results] == expected
    _assert_sparse_ran_without_ties(llm)


@pytest.mark.parametrize("arch", ARCHS)
def test_graph_decode_picks_its_context_bound(device: str, checkpoints: dict,
                                             arch: str) -> None:
    """Decode through the graph buffers (max_model_len 128: bounds index_topk 8, 64, 128).
    Contexts all within 8: `stage` picks the 8 graph, which runs dense MLA with no indexer
    query and no sparse row; transformers' tokens. Contexts past 8 but within 64 (a
    multi-step round counted to its end): the 64 graph, every row sparse over an indexer that
    spans 64 positions, not 128; transformers' tokens."""
    folder, _, _ = checkpoints[arch]
    prompts = _prompts(256, (3, 5), seed=5)
    params = [SamplingParams(max_tokens=9 - len(p), temperature=0.0, ignore_eos=True)
              for p in prompts]
    expected = [hf_greedy(folder, [p], s.max_tokens)[0] for p, s in zip(prompts, params,
                                                                       strict=True)]
    llm = _llm(folder, device, max_model_len=128)
    runner = llm.engine.runner
    runner.init_decode_graphs(4, 128, capture=False)
    assert runner.graphs.bounds == (8, 64, 128)
    assert [r.token_ids for r in llm.generate(prompts, params)] == expected
    assert runner.num_graph_steps > 0 and runner.graphs.bound == 8
    assert all(a.tokens_sparse == 0 for a in _dsa_layers(llm))

    prompt = _prompts(256, (6, 30), seed=6)
    crossing = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    multi = _llm(folder, device, max_model_len=128, num_continuous_decode_steps=4)
    multi.engine.runner.init_decode_graphs(4, 128, capture=False)
    assert [r.token_ids for r in multi.generate(prompt, crossing)] == hf_greedy(
        folder, prompt, crossing.max_tokens)
    assert multi.engine.runner.num_graph_steps > 0 and multi.engine.runner.graphs.bound == 64
    assert any(a.tokens_sparse > 0 for a in _dsa_layers(multi))


def test_a_context_within_index_topk_runs_dense_mla(device: str, checkpoints: dict) -> None:
    """Prompts whose context stays within index_topk 8 (prompt + new tokens - 1 <= 8): no
    indexer query, no sparse attention, the MLA's dense paths; still transformers' output."""
    for arch in ARCHS:
        folder, _, _ = checkpoints[arch]
        prompts = _prompts(256, (3, 6, 8, 1), seed=3)
        short = [SamplingParams(max_tokens=9 - len(p), temperature=0.0, ignore_eos=True)
                 for p in prompts]
        expected = [hf_greedy(folder, [p], s.max_tokens)[0] for p, s in zip(prompts, short,
                                                                            strict=True)]
        llm = _llm(folder, device, mla_prefill="mha")  # both dense forms: prefill, decode
        results = llm.generate(prompts, short)
        assert [r.token_ids for r in results] == expected, arch
        for attn in _dsa_layers(llm):
            assert attn.tokens_sparse == 0
            assert attn.tokens_up_projected > 0 and attn.tokens_absorbed > 0


def test_only_full_layers_let_the_sparse_mla_read_its_queries_early(
        device: str, checkpoints: dict) -> None:
    """A full DSA layer makes its absorbed queries before its indexer's launches, so its sparse
    attention runs inside triton_common.queries_made_earlier (PDL's early query copies); a
    shared layer's queries come from the launch just before its attention: outside it."""
    from moeserve.kernels import triton_common

    folder, prompts, _ = checkpoints["glm_moe_dsa"]  # layer 1 shares layer 0's selection
    llm = _llm(folder, device)
    seen: dict[bool, set[bool]] = {}
    for attn in _dsa_layers(llm):
        def spy(*args: object, _real=attn.dsa_ops.attention, _full=attn.indexer is not None,
                **kwargs: object) -> torch.Tensor:
            seen.setdefault(_full, set()).add(triton_common.queries_early())
            return _real(*args, **kwargs)
        attn.dsa_ops = attn.dsa_ops._replace(attention=spy)
    llm.generate(prompts[:2], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    assert seen == {True: {True}, False: {False}}
    assert not triton_common.queries_early()  # the context ends with each call


@pytest.mark.parametrize("arch", ARCHS)
def test_dsa_dense_flag_drops_the_indexer(device: str, checkpoints: dict, arch: str) -> None:
    """dsa="dense": no indexer key cache in the plan or the layers, no sparse row; on the long
    prompts the outputs then differ from transformers' (the selection really drops tokens),
    while the indexer's keys alone cost what the report says."""
    folder, prompts, expected = checkpoints[arch]
    sparse_llm = _llm(folder, device)
    dense_llm = _llm(folder, device, dsa="dense")
    assert dense_llm.engine.cfg.dsa == "dense"
    plan_sparse = sparse_llm.engine.report.memory
    plan_dense = dense_llm.engine.report.memory
    mc = dense_llm.engine.model_config
    full = mc.index_cache_layers
    assert plan_sparse.bytes_per_block - plan_dense.bytes_per_block == full * 16 * 32 * 4
    caches = dense_llm.engine.runner.kv_caches
    assert not any(isinstance(c, DsaLayerCache) for c in caches)
    assert sum(isinstance(c, DsaLayerCache) for c in sparse_llm.engine.runner.kv_caches) == full
    assert "dsa=dense" in dense_llm.report.format()
    results = dense_llm.generate(prompts, GREEDY)
    assert all(a.tokens_sparse == 0 for a in _dsa_layers(dense_llm))
    assert [r.token_ids for r in results] != expected


def test_dsa_flag_is_validated() -> None:
    from moeserve.config import ConfigError, EngineConfig

    with pytest.raises(ConfigError, match="dsa must be one of auto, dense"):
        EngineConfig(dsa="sparse")


@pytest.mark.parametrize("arch", ARCHS)
def test_cache_bytes_count_the_indexer_keys(checkpoints: dict, arch: str) -> None:
    """bytes_per_block: the latent of every layer and the indexer key of each full layer."""
    from moeserve.config import CacheConfig
    from moeserve.model_config import ModelConfig
    from moeserve.runner.kv_cache import bytes_per_block, kv_layout

    folder, _, _ = checkpoints[arch]
    mc = ModelConfig.from_file(f"{folder}/config.json")
    full = 2 if arch == "glm_moe_dsa" else 3
    assert mc.index_cache_layers == full
    per_block = bytes_per_block(mc, CacheConfig(block_size=16), torch.float32)
    assert per_block == 16 * (3 * 48 + full * 32) * 4
    assert bytes_per_block(mc, CacheConfig(block_size=16), torch.float32,
                           indexer_cache=False) == 16 * 3 * 48 * 4
    line = kv_layout(mc, torch.bfloat16)
    assert line == (f"96 B a layer (MLA latent 32 + rope 16) x 3 layers + DSA indexer key 64 B "
                    f"(32) x {full} full layers = {(3 * 48 + full * 32) * 2:,} B")



@pytest.mark.parametrize("arch", ARCHS)
def test_triton_backend_matches_hf(device: str, checkpoints: dict, arch: str) -> None:
    """attention_backend="triton": the indexer's top-k and the sparse MLA are the Triton kernels
    (the interpreter on CPU: small, it is slow), the dense rows mla_triton; two prompts beyond
    index_topk prefilled in chunks beside decodes (mixed steps), still transformers' tokens."""
    folder, _, _ = checkpoints[arch]
    prompts = _prompts(256, (12, 30), seed=5)
    expected = hf_greedy(folder, prompts, 6)
    llm = _llm(folder, device, attention_backend="triton", max_num_batched_tokens=16)
    results = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0,
                                                   ignore_eos=True))
    assert llm.engine.scheduler.stats.num_prefill_chunks > 1
    assert [r.token_ids for r in results] == expected
    assert all(a.dsa_ops is DSA_BACKENDS["triton"] for a in _dsa_layers(llm))
    _assert_sparse_ran_without_ties(llm)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ARCHS)
def test_gpu_fused_indexer_launches_match_hf(checkpoints: dict, arch: str,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA with the indexer's fused key write and query RoPE on (layers/dsa.py's
    FUSED_ON_CUDA, the default, set here whatever the environment), fp32 with TF32 off: the
    greedy tokens of transformers, with CUDA-graph decodes, every row sparse and no boundary
    tie."""
    from moeserve.layers import dsa as dsa_layer

    if not torch.cuda.is_available():
        pytest.fail("a gpu-marked test ran without a CUDA device")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    monkeypatch.setattr(dsa_layer, "FUSED_ON_CUDA", True)
    calls: list[int] = []
    real = dsa_layer.indexer_keys_triton
    monkeypatch.setattr(dsa_layer, "indexer_keys_triton",
                        lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    folder, prompts, expected = checkpoints[arch]
    llm = _llm(folder, "cuda")
    assert [r.token_ids for r in llm.generate(prompts, GREEDY)] == expected
    assert calls
    _assert_sparse_ran_without_ties(llm)
