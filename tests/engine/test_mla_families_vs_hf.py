"""End to end for the DeepSeek / Kimi / GLM families: moeserve's greedy outputs equal
transformers' generate, token for token, in fp32, on tiny random checkpoints written by
transformers' own classes with the published configs' extra fields (and, for DeepSeek-V3, MTP
tensors), through every path of the engine: batches of different lengths, staggered arrivals,
chunked prefill (the up-projected and the absorbed form), prefix hits, preemption and overlap
scheduling. Each test asserts that its path ran.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from moeserve import LLM, SamplingParams
from moeserve.config import ConfigError
from moeserve.layers.mla import ABSORBED as A
from moeserve.layers.mla import FRESH as F
from moeserve.layers.mla import FRESH_VARLEN_MIN_TOKENS, MLAttention, row_forms
from moeserve.layers.mla import MHA as M
from tests.engine.test_generate_vs_hf import (
    NEW_TOKENS,
    _prompts,
    check_prefix_hits_match_hf,
    hf_greedy,
)
from tests.models.checkpoints import write_mtp_tensors, write_tiny_checkpoint

ARCHS = ("deepseek_v2", "deepseek_v3", "kimi_k2", "glm4_moe", "glm4_moe_lite")
MLA_ARCHS = ("deepseek_v2", "deepseek_v3", "kimi_k2", "glm4_moe_lite")
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, list, list]]:
    """arch -> (folder, prompts, HF greedy outputs); deepseek_v3 is sharded and carries an
    MTP layer."""
    result = {}
    for arch in ARCHS:
        folder = str(write_tiny_checkpoint(arch, tmp_path_factory.mktemp(arch),
                                           sharded=arch == "deepseek_v3"))
        if arch == "deepseek_v3":
            write_mtp_tensors(folder, num_layers=3, hidden=64)
        prompts = _prompts(256)
        result[arch] = (folder, prompts, hf_greedy(folder, prompts))
    return result


def _llm(folder: str, device: str, **kw: object) -> LLM:
    """The fp32 engine of these tests (a small share of the GPU; grouped_mm MoE)."""
    if device == "cuda":
        kw.setdefault("mem_fraction", 0.1)
    kw.setdefault("moe_backend", "grouped_mm")
    return LLM(folder, device=device, dtype="float32", **kw)


def _mla_layers(llm: LLM) -> list[MLAttention]:
    return [layer.self_attn for layer in llm.engine.runner.model.model.layers
            if isinstance(layer.self_attn, MLAttention)]


@pytest.mark.parametrize("arch", ARCHS)
def test_batch_matches_hf(device: str, checkpoints: dict, arch: str) -> None:
    folder, prompts, expected = checkpoints[arch]
    llm = _llm(folder, device)
    results = llm.generate(prompts, GREEDY)
    assert [r.token_ids for r in results] == expected
    if arch in MLA_ARCHS:  # the default form, "auto": these short prompts attend absorbed
        layers = _mla_layers(llm)
        assert layers and all(a.tokens_absorbed and not a.tokens_up_projected for a in layers)
        assert "mla prefill=auto" in llm.report.format()
    else:
        assert "mla prefill" not in llm.report.format()
    if arch == "deepseek_v3":  # its MTP layer was recognised and left out
        assert "8 tensors left out: 1 MTP layer(s)" in llm.report.format()


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe_lite"])
def test_up_projected_prefill_matches_hf(device: str, checkpoints: dict, arch: str) -> None:
    """mla_prefill "mha": every prefill row through the up-projected form, the decode rows
    absorbed."""
    folder, prompts, expected = checkpoints[arch]
    llm = _llm(folder, device, mla_prefill="mha")
    assert "mla prefill=mha" in llm.report.format()
    results = llm.generate(prompts, GREEDY)
    assert all(a.tokens_up_projected and a.tokens_absorbed for a in _mla_layers(llm))
    assert [r.token_ids for r in results] == expected


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe_lite"])
def test_auto_prefill_splits_a_step_by_context(device: str, checkpoints: dict,
                                               arch: str) -> None:
    """"auto" with a small limit: in one step the short prompts attend absorbed with the
    decodes and the longer ones up-projected, each row by its own context."""
    folder, prompts, expected = checkpoints[arch]
    llm = _llm(folder, device)
    lens = sorted(len(p) for p in prompts)
    limit = lens[len(lens) // 2]  # some prompts at most this long, some longer
    assert lens[0] <= limit < lens[-1]
    for layer in _mla_layers(llm):
        layer.auto_max_context = limit
    results = llm.generate(prompts, GREEDY)
    longer = sum(n for n in lens if n > limit)
    for a in _mla_layers(llm):
        assert a.tokens_up_projected == longer  # each long prompt once, in one chunk
        decodes = a.tokens_absorbed - sum(n for n in lens if n <= limit)
        # each request's NEW_TOKENS - 1 decode steps (overlap scheduling may run one more)
        assert len(lens) * (NEW_TOKENS - 1) <= decodes <= len(lens) * NEW_TOKENS
    assert [r.token_ids for r in results] == expected


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe_lite"])
def test_absorbed_prefill_matches_hf(device: str, checkpoints: dict, arch: str) -> None:
    """Prefill rows through the absorbed form too (the engine's mla_prefill; with chunks:
    queries after a prefix)."""
    folder, prompts, expected = checkpoints[arch]
    llm = _llm(folder, device, max_num_batched_tokens=16, mla_prefill="absorbed")
    assert {a.prefill_form for a in _mla_layers(llm)} == {"absorbed"}
    assert "mla prefill=absorbed" in llm.report.format()
    results = llm.generate(prompts, GREEDY)
    assert llm.engine.scheduler.stats.num_prefill_chunks > 1
    assert all(a.tokens_up_projected == 0 for a in _mla_layers(llm))
    assert [r.token_ids for r in results] == expected


@pytest.mark.parametrize("chunk", [None, 16], ids=["whole", "chunked"])
@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe_lite"])
def test_fresh_varlen_prefill_matches_hf(device: str, checkpoints: dict, arch: str,
                                         chunk: int | None) -> None:
    """Fresh prompts' rows (`fresh_varlen`, with its threshold lowered to every prompt): rows
    with no cached prefix up-projected in one variable-length launch; chunked, a prompt's first
    chunk goes so and its later ones (after a prefix) by "auto"."""
    folder, prompts, expected = checkpoints[arch]
    llm = _llm(folder, device, **({"max_num_batched_tokens": chunk} if chunk else {}))
    for layer in _mla_layers(llm):
        assert layer.fresh_varlen  # the default
        layer.fresh_min_tokens = 2
        layer.fresh_min_work_beside = 0  # chunked: first chunks beside later ones, absorbed
    results = llm.generate(prompts, GREEDY)
    assert [r.token_ids for r in results] == expected
    for a in _mla_layers(llm):
        if chunk:  # first chunks fresh, later ones after a prefix (absorbed: short contexts)
            assert 0 < a.tokens_fresh_varlen < sum(len(p) for p in prompts)
        else:
            assert a.tokens_fresh_varlen == sum(len(p) for p in prompts)
        assert a.tokens_up_projected == 0 and a.tokens_absorbed > 0


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe_lite"])
def test_fresh_varlen_takes_only_prompts_of_its_threshold(device: str, checkpoints: dict,
                                                          arch: str) -> None:
    """By default a fresh prompt goes to the variable-length launch only from
    `fresh_min_tokens` (FRESH_VARLEN_MIN_TOKENS) tokens: at the longest prompt's length, that
    prompt (and any as long) goes so, the shorter ones attend absorbed; at the default, every
    prompt here is shorter; each way the output is HF's."""
    folder, prompts, expected = checkpoints[arch]
    longest = max(len(p) for p in prompts)
    assert min(len(p) for p in prompts) < longest < FRESH_VARLEN_MIN_TOKENS
    for threshold, fresh in ((FRESH_VARLEN_MIN_TOKENS, 0),
                             (longest, sum(len(p) for p in prompts if len(p) == longest))):
        llm = _llm(folder, device)
        for layer in _mla_layers(llm):
            layer.fresh_min_tokens = threshold
            layer.fresh_min_work_beside = 0  # the shorter prompts attend absorbed beside it
        assert [r.token_ids for r in llm.generate(prompts, GREEDY)] == expected
        for a in _mla_layers(llm):
            assert a.tokens_fresh_varlen == fresh and a.tokens_up_projected == 0


def test_row_forms_keep_fresh_prompts_beside_absorbed_rows_only_for_enough_work() -> None:
    """`row_forms`: decodes and contexts up to the limit absorbed, longer ones up-projected;
    prompts with no cached prefix of FRESH_VARLEN_MIN_TOKENS fresh when alone in their step,
    and beside absorbed rows only when heads x their squared lengths reach the work floor (a
    fresh row past the limit keeps its launch either way)."""
    n = FRESH_VARLEN_MIN_TOKENS
    q = np.array([1, 1, n, 16, 2 * n])
    seq = np.array([300, 9000, n, 116, 2 * n])
    assert row_forms(q, seq, 8192, 20, None, 0).tolist() == [A, A, A, A, A]
    alone = np.array([n, 2 * n])
    assert row_forms(alone, alone, 8192, 20, n, 1 << 40).tolist() == [F, F]
    work = 20 * (n * n + 4 * n * n)
    assert row_forms(q, seq, 8192, 20, n, work).tolist() == [A, A, F, A, F]
    assert row_forms(q, seq, 8192, 20, n, work + 1).tolist() == [A, A, A, A, A]
    # past the limit: up-projected, in chunks after a prefix; fresh, in the fresh launch
    long_q, long_seq = np.array([1, 600, 9000]), np.array([20, 9600, 9000])
    assert row_forms(long_q, long_seq, 8192, 20, n, 1 << 40).tolist() == [A, M, F]
    assert row_forms(long_q, long_seq, 8192, 20, None, 0).tolist() == [A, M, M]


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe"])
def test_staggered_arrivals_match_hf(device: str, checkpoints: dict, arch: str) -> None:
    folder, prompts, expected = checkpoints[arch]
    llm = _llm(folder, device)
    ids = []
    for p in prompts:  # a new request joins every three steps, beside running decodes
        ids.append(llm.add_request(p, GREEDY))
        for _ in range(3):
            llm.step()
    while llm.has_unfinished_requests():
        llm.step()
    assert llm.engine.scheduler.stats.num_scheduled_steps > NEW_TOKENS
    assert [llm.result(i).token_ids for i in ids] == expected


@pytest.mark.parametrize("arch", ["deepseek_v2", "glm4_moe_lite"])
def test_chunked_prefill_matches_hf(device: str, checkpoints: dict, arch: str) -> None:
    folder, prompts, expected = checkpoints[arch]
    llm = _llm(folder, device, max_num_batched_tokens=16)
    results = llm.generate(prompts, GREEDY)
    assert llm.engine.scheduler.stats.num_prefill_chunks > 1
    assert [r.token_ids for r in results] == expected


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe"])
def test_prefix_cache_hits_match_hf(device: str, checkpoints: dict, arch: str) -> None:
    folder, _, _ = checkpoints[arch]
    check_prefix_hits_match_hf(folder, functools.partial(_llm, folder, device))


@pytest.mark.parametrize("arch", ["kimi_k2", "glm4_moe_lite"])
def test_preemption_matches_hf(device: str, checkpoints: dict, arch: str) -> None:
    folder, prompts, expected = checkpoints[arch]
    llm = _llm(folder, device, block_size=4, num_blocks=25, max_model_len=96,
               max_running_requests=4)
    results = llm.generate(prompts, GREEDY)
    assert llm.engine.scheduler.stats.num_preemptions > 0
    assert [r.token_ids for r in results] == expected


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe"])
def test_async_scheduling_matches_hf(device: str, checkpoints: dict, arch: str) -> None:
    folder, prompts, expected = checkpoints[arch]
    llm = _llm(folder, device, async_scheduling=True, max_num_batched_tokens=16)
    results = llm.generate(prompts, GREEDY)
    assert llm.engine.scheduler.stats.num_prefill_chunks > 1
    assert [r.token_ids for r in results] == expected


@pytest.mark.parametrize("arch", ARCHS)  # deepseek_v2: 2 shared experts' width, folded as two
def test_folded_shared_experts_match_hf(device: str, checkpoints: dict, arch: str) -> None:
    folder, prompts, expected = checkpoints[arch]
    llm = _llm(folder, device, fold_shared_experts=True)
    assert [r.token_ids for r in llm.generate(prompts, GREEDY)] == expected
    blocks = llm.engine.runner.model.moe_blocks()
    assert blocks and all(b.shared_experts is None and b.folded_shared >= 1 for b in blocks)
    assert "folded into the routed experts' launch" in llm.report.format()


def test_latent_cache_is_sized_by_its_bytes() -> None:
    """The memory plan and the report count MLA's latent row (L + R values a token a layer),
    not per-head K/V."""
    import json

    from moeserve.config import CacheConfig
    from moeserve.hf_config import parse
    from moeserve.runner.kv_cache import bytes_per_block, kv_layout
    from tests.models.checkpoints import tiny_hf_config

    hf = json.loads(tiny_hf_config("deepseek_v3").to_json_string(use_diff=True))
    hf["architectures"] = ["DeepseekV3ForCausalLM"]
    mc = parse(hf)
    assert bytes_per_block(mc, CacheConfig(block_size=16), torch.float32) == 3 * 16 * 48 * 4
    assert "MLA latent 32 + rope 16" in kv_layout(mc, torch.float32)


TRITON_PATHS = {
    "batch": {},
    "chunked": {"max_num_batched_tokens": 16},
    "preemption": {"block_size": 4, "num_blocks": 25, "max_model_len": 96,
                   "max_running_requests": 4},
    "overlap": {"async_scheduling": True, "max_num_batched_tokens": 16},
}


@pytest.mark.parametrize("path", list(TRITON_PATHS))
def test_triton_mla_paths_match_hf(device: str, checkpoints: dict, path: str) -> None:
    """GLM-4.7-Flash's MLA through the Triton kernel (on CPU in Triton's interpreter), on each
    engine path; prefix hits below."""
    folder, prompts, expected = checkpoints["glm4_moe_lite"]
    llm = _llm(folder, device, attention_backend="triton", **TRITON_PATHS[path])
    results = llm.generate(prompts, GREEDY)
    stats = llm.engine.scheduler.stats
    assert {"chunked": stats.num_prefill_chunks > 1, "preemption": stats.num_preemptions > 0,
            "overlap": stats.num_prefill_chunks > 1}.get(path, True)
    assert [r.token_ids for r in results] == expected


@pytest.mark.parametrize("form", ["split", "flat"])
def test_triton_mla_decode_forms_match_hf(device: str, checkpoints: dict, form: str) -> None:
    """The engine's mla_decode: each Triton decode form, with chunks (mixed steps: the decode
    rows a subset of the step's)."""
    folder, prompts, expected = checkpoints["glm4_moe_lite"]
    llm = _llm(folder, device, attention_backend="triton", mla_decode=form,
               max_num_batched_tokens=16)
    assert all(layer.decode_kwargs == {"decode_form": form} for layer in _mla_layers(llm))
    assert f"mla decode={form}" in llm.report.format()
    assert [r.token_ids for r in llm.generate(prompts, GREEDY)] == expected


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe", "kimi_k2"])
def test_triton_grouped_router_matches_hf(device: str, checkpoints: dict, arch: str,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The sigmoid, group-limited router as one Triton launch (layers/moe.py's
    grouped_router_triton; on CPU in Triton's interpreter): DeepSeek-V3's 4 groups of 2 with
    2 kept, GLM-4.5's 2 of 4 with 1 kept, Kimi's one group, token for token."""
    from moeserve.layers import moe

    calls: list[int] = []
    fused = moe.select_experts_grouped_triton

    def counted(*args: object, **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append(1)
        return fused(*args, **kwargs)
    monkeypatch.setattr(moe, "grouped_router_triton", True)
    monkeypatch.setattr(moe, "grouped_router_interpret", True)
    monkeypatch.setattr(moe, "select_experts_grouped_triton", counted)
    folder, prompts, expected = checkpoints[arch]
    llm = _llm(folder, device)
    assert [r.token_ids for r in llm.generate(prompts, GREEDY)] == expected
    assert calls  # the fused router ran


def test_mla_decode_bad_values_are_named(checkpoints: dict) -> None:
    folder, _, _ = checkpoints["deepseek_v3"]
    with pytest.raises(ConfigError, match="mla_decode must be one of auto, split, flat, gluon"):
        _llm(folder, "cpu", mla_decode="wide")
    with pytest.raises(ConfigError, match="mla_decode='gluon' is the MLA decode in Gluon"):
        _llm(folder, "cpu", attention_backend="triton", mla_decode="gluon")
    with pytest.raises(ConfigError, match="mla_decode='flat' is a form of the Triton MLA"):
        _llm(folder, "cpu", mla_decode="flat")  # auto resolves to the torch reference on CPU


def test_triton_mla_prefix_hits_match_hf(device: str, checkpoints: dict) -> None:
    folder, _, _ = checkpoints["glm4_moe_lite"]

    def make_llm(**kw: object) -> LLM:
        llm = _llm(folder, device, attention_backend="triton", **kw)
        for layer in _mla_layers(llm):  # the prefix hit's queries through the Triton kernel
            layer.prefill_form = "absorbed"
        return llm

    check_prefix_hits_match_hf(folder, make_llm)


def test_mla_prefill_bad_value_is_named(checkpoints: dict) -> None:
    folder, _, _ = checkpoints["deepseek_v3"]
    with pytest.raises(ConfigError, match="mla_prefill"):
        _llm(folder, "cpu", mla_prefill="up-projected")


def test_a_sliced_checkpoint_leaves_its_cut_layers_out(checkpoints: dict) -> None:
    """hf_overrides num_hidden_layers 2 over the 3-layer DeepSeek-V3 checkpoint (and its MTP
    layer): layers 2 and 3 are left out and reported, layers 0 and 1 load and serve; the
    strict name check still holds for everything else."""
    folder, prompts, _ = checkpoints["deepseek_v3"]
    llm = LLM(folder, device="cpu", dtype="float32", hf_overrides={"num_hidden_layers": 2})
    assert llm.engine.model_config.num_layers == 2
    report = llm.report.format()
    assert "1 MTP layer(s)" in report and "layers 2..2 cut by hf_overrides" in report
    assert len(llm.generate(prompts[:1], GREEDY)[0].token_ids) == NEW_TOKENS
