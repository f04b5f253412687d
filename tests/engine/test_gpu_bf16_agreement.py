"""The fast path's outputs match the reference path's: bf16 logits and top-1, over all positions.

Fast path: Triton paged attention, the fused Triton MoE, the Triton RMSNorm and RoPE that layers
pick on CUDA (and, through the engine, CUDA-graph decode). Reference path: the torch attention
reference over the paged KV cache, the per-expert loop MoE, the torch RMSNorm and RoPE. The GPU
model is the qwen3-30b-a3b preset cut to 4 layers, so every kernel sees the real per-layer shapes
(128 experts top-8, GQA 32/4 heads of 128, vocabulary 151936), with the engine's dummy weights;
one model whose layers' `.backend` is switched between the two paths.

Positions: every prompt position (each prompt in two prefill chunks, the second reading the
first from the paged cache) and 32 decode steps, teacher-forced with the reference's tokens.
The criterion (`Agreement.failures`), over all positions and the whole vocabulary:

    top-1   argmax(fast) == argmax(ref) at >= 99% of positions
    rms     sqrt(mean((fast - ref)^2)) <= 0.75% of std(ref)
    each    |fast - ref| <= 2^-6 * |ref| + 5% of std(ref)

Why these numbers: logits leave `compute_logits` rounded to bf16 (8 significant bits), so two
correct paths whose hidden states differ in the last bits differ by about half a bf16 step per
logit: an rms of ~0.25% of std, and one or two steps (2^-7 relative each) on the worst logit.
That was measured on CPU with bf16 stand-ins for the fast kernels (loop attention, grouped_mm):
rms 0.25-0.28%, each-bound used to 0.58. 0.75% is three times that floor, and real bugs sit
above it: leaving out each token's top expert gives 1.4% (each-bound 1.8x), a softmax scale 20%
off 1.2% (1.6x); `test_criterion_rejects_a_dropped_expert` shows the failure on the GPU. Subtler
errors (the smallest of 8 routing weights dropped: 0.7%) stay under it.

Top-1 needs peaked logits: random weights give ~Gaussian logits over 151936 tokens whose top
two lie within one bf16 step at ~10% of positions, so any two bf16 computations disagree on ~1%
of top-1s from rounding alone (measured: 99.15%, with the bf16 stand-ins above). A trained
model's next-token distribution is peaked; `sharpen_logits` gives the random model that
property (a bigram component in lm_head: the top-1 leads by >= 1.5 std at 99.9% of positions),
so a top-1 flip means a real error. Top-1 is the coarse check; the rms is the sensitive one.

    pytest -m gpu tests/engine/test_gpu_bf16_agreement.py     # on the GPU machine

On CPU the same comparison runs on a tiny checkpoint in fp32 (Triton through its interpreter).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import random
import unittest.mock
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from moeserve.kernels.attention.metadata import build_attention_metadata
from moeserve.kernels.registry import get_attention_backend, get_mla_backend, get_moe_backend
from moeserve.layers import norm as norm_module
from moeserve.layers import rope as rope_module
from moeserve.layers.attention import Attention
from moeserve.layers.mla import MLAttention
from moeserve.layers.moe import MoeBackend, SparseMoeBlock
from moeserve.model_config import ModelConfig
from moeserve.models import build_model
from moeserve.models.decoder import CausalLM
from moeserve.presets import load_preset
from moeserve.runner.weights.loader import init_dummy_weights, load_weights
from tests.models.checkpoints import write_tiny_checkpoint

MIN_TOP1 = 0.99
MAX_RMS_PER_STD = 0.0075
RTOL, ATOL_PER_STD = 2.0 ** -6, 0.05
BLOCK_SIZE = 16
REFERENCE = ("torch", "torch")  # (attention_backend, moe_backend)
FAST = ("triton", "triton")
GPU_LAYERS = 4
GPU_PROMPT_LENS = (1, 7, 16, 33, 100, 128, 250, 301)  # 836 prompt positions
GPU_DECODE_STEPS = 32
ENGINE_PROMPT_LENS = (3, 9, 17, 31, 64, 65, 100, 127, 128, 200, 257, 300)  # 12: a padded batch


# ---- the criterion -------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Agreement:
    """How far the fast path's logits are from the reference's, over N positions."""

    num_positions: int
    top1: float  # fraction of positions whose argmax agrees
    rms_per_std: float  # sqrt(mean((fast - ref)^2)) / std(ref)
    worst: float  # max of |fast - ref| / (RTOL * |ref| + ATOL_PER_STD * std(ref)); <= 1 passes

    def failures(self) -> list[str]:
        """The parts of the criterion that fail (empty when it holds)."""
        out = []
        if self.top1 < MIN_TOP1:
            out.append(f"top-1 agreement {self.top1:.2%} < {MIN_TOP1:.0%}")
        if self.rms_per_std > MAX_RMS_PER_STD:
            out.append(f"rms logit diff {self.rms_per_std:.3%} of std > {MAX_RMS_PER_STD:.2%}")
        if self.worst > 1.0:
            out.append(f"a logit differs by {self.worst:.2f}x the allowed "
                       f"{RTOL:.3g} * |ref| + {ATOL_PER_STD:.0%} of std")
        return out


def compare_logits(fast: torch.Tensor, ref: torch.Tensor) -> Agreement:
    """fast, ref: [N, V] logits of the same N positions."""
    assert fast.shape == ref.shape, (fast.shape, ref.shape)
    fast, ref = fast.float(), ref.float()
    diff, std = fast - ref, ref.std()
    top1 = (fast.argmax(-1) == ref.argmax(-1)).float().mean().item()
    worst = (diff.abs() / (RTOL * ref.abs() + ATOL_PER_STD * std)).max().item()
    return Agreement(ref.shape[0], top1, (diff.pow(2).mean().sqrt() / std).item(), worst)


def check_agreement(agreement: Agreement) -> None:
    failures = agreement.failures()
    assert not failures, "; ".join(failures) + f" ({agreement})"


# ---- running one path ----------------------------------------------------------------------

def set_backends(model: CausalLM, attention: str | Callable, moe: str | MoeBackend) -> None:
    """Point every attention layer and MoE block of `model` at these backends (same weights)."""
    attn_fn = get_attention_backend(attention) if isinstance(attention, str) else attention
    mla_fn = get_mla_backend(attention) if isinstance(attention, str) else None
    moe_fn = get_moe_backend(moe) if isinstance(moe, str) else moe
    for module in model.modules():
        if isinstance(module, Attention):
            module.backend = attn_fn
        elif isinstance(module, MLAttention) and mla_fn is not None:
            module.backend = mla_fn
        elif isinstance(module, SparseMoeBlock):
            module.backend = moe_fn


@contextlib.contextmanager
def torch_norm_and_rope() -> Iterator[None]:
    """RMSNorm and RoPE run their torch references even on CUDA (layers pick Triton there)."""
    with (unittest.mock.patch.object(norm_module, "rms_norm_triton", norm_module.rms_norm_ref),
          unittest.mock.patch.object(rope_module, "rope_triton", rope_module.rope_ref)):
        yield


@torch.inference_mode()
def teacher_forced_logits(model: CausalLM, prompts: list[list[int]], num_decode: int,
                          feed: torch.Tensor | None = None,
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of every position: each prompt in two prefill chunks ([0, n // 2) then the rest,
    which reads the first from the paged cache), then `num_decode` batched decode steps.

    Decode inputs are `feed` [B, num_decode] when given (teacher forcing), else this path's own
    greedy tokens. Returns (logits [sum(n // 2) + sum(n - n // 2) + num_decode * B, V] fp32 in
    that order, decode steps step-major; the decode inputs [B, num_decode])."""
    cfg, device = model.config, model.model.embed_tokens.device
    lens = [len(p) for p in prompts]
    blocks = [-(-(n + num_decode) // BLOCK_SIZE) for n in lens]
    ids = (torch.randperm(sum(blocks), generator=torch.Generator().manual_seed(0)) + 1).tolist()
    tables = [ids[sum(blocks[:i]):sum(blocks[:i + 1])] for i in range(len(lens))]  # scattered
    shape = ((sum(blocks) + 1, BLOCK_SIZE, cfg.mla.latent_dim) if cfg.mla is not None else
             (2, sum(blocks) + 1, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim))
    model.bind_kv_caches([torch.zeros(shape, dtype=model.model.embed_tokens.dtype, device=device)
                          for _ in range(cfg.num_layers)])
    try:
        firsts = [n // 2 for n in lens]
        rows = [i for i, k in enumerate(firsts) if k]
        logits = [_forward(model, [prompts[i][:firsts[i]] for i in rows], [0] * len(rows),
                           [tables[i] for i in rows])]
        logits.append(_forward(model, [p[k:] for p, k in zip(prompts, firsts)], firsts, tables))
        ends = torch.tensor([n - k for n, k in zip(lens, firsts)]).cumsum(0) - 1  # [B]
        tokens = logits[-1][ends.to(device)].argmax(-1)  # [B]: greedy after each prompt
        inputs = []
        for step in range(num_decode):
            if feed is not None:
                tokens = feed[:, step].to(device)
            inputs.append(tokens)
            logits.append(_forward(model, tokens[:, None], [n + step for n in lens], tables))
            tokens = logits[-1].argmax(-1)  # [B]
        decode_inputs = (torch.stack(inputs, dim=1) if inputs
                         else torch.empty(len(lens), 0, dtype=torch.long, device=device))
        return torch.cat(logits), decode_inputs
    finally:
        model.bind_kv_caches([])


def _forward(model: CausalLM, chunks: list[list[int]] | torch.Tensor, computed: list[int],
             tables: list[list[int]]) -> torch.Tensor:
    """One step over the rows' new tokens (`chunks`, row by row) -> logits [T, V] fp32."""
    device = model.model.embed_tokens.device
    meta = build_attention_metadata(computed, [len(c) for c in chunks], tables, BLOCK_SIZE,
                                    device)
    if isinstance(chunks, torch.Tensor):
        input_ids = chunks.flatten()  # [B]: one decode token per row
    else:
        input_ids = torch.tensor([t for c in chunks for t in c], device=device)  # [T]
    return model.compute_logits(model(input_ids, meta.positions, meta))


def next_token_logits(model: CausalLM, prompts: list[list[int]],
                      tokens: torch.Tensor) -> torch.Tensor:
    """The logits that predict tokens[:, j] (generated after prompt i), teacher-forced:
    [B, S, V] for tokens [B, S]."""
    num_reqs, steps = tokens.shape
    logits, _ = teacher_forced_logits(model, prompts, steps - 1, feed=tokens[:, :steps - 1])
    lens = [len(p) for p in prompts]
    num_first = sum(n // 2 for n in lens)
    ends = num_first + torch.tensor([n - n // 2 for n in lens]).cumsum(0) - 1  # [B]
    decode = logits[num_first + sum(n - n // 2 for n in lens):]  # [(S - 1) * B, V]
    decode = decode.view(steps - 1, num_reqs, -1).transpose(0, 1)  # [B, S - 1, V]
    return torch.cat([logits[ends.to(logits.device)][:, None], decode], dim=1)


def fast_vs_reference(model: CausalLM, prompts: list[list[int]], num_decode: int,
                      fast: tuple[str | Callable, str | MoeBackend] = FAST) -> Agreement:
    """Reference first (its greedy tokens become the decode inputs), then the fast path fed the
    same tokens, on the same weights."""
    set_backends(model, *REFERENCE)
    with torch_norm_and_rope():
        ref_logits, tokens = teacher_forced_logits(model, prompts, num_decode)
    set_backends(model, *fast)
    fast_logits, _ = teacher_forced_logits(model, prompts, num_decode, feed=tokens)
    set_backends(model, *REFERENCE)
    return compare_logits(fast_logits, ref_logits)


@torch.no_grad()
def sharpen_logits(model: CausalLM, strength: float = 0.004, seed: int = 1) -> None:
    """Make next-token distributions peaked, as a trained model's are: lm_head[v] +=
    strength * embed_tokens[perm[v]] (a random bigram). The final hidden state is mostly the
    current token's embedding (N(0, 1) rows; the dummy residual writes are small), so token
    perm^-1(current) gains ~strength * hidden_size (8 std at the preset's shape) and wins."""
    vocab = model.config.vocab_size
    perm = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))
    model.lm_head.add_(strength * model.model.embed_tokens[perm.to(model.lm_head.device)])


def random_prompts(vocab: int, lens: tuple[int, ...], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lens]


def drop_top_expert(moe: str) -> MoeBackend:
    """A wrong MoE: each token's highest-weighted routed expert is left out (the kind of error
    an off-by-one over top_k makes)."""
    fn = get_moe_backend(moe)

    def broken(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
               topk_ids: torch.Tensor, *, reduce: bool = True) -> torch.Tensor:
        weights = topk_weights.clone()  # [T, k]
        weights.scatter_(1, weights.argmax(-1, keepdim=True), 0.0)
        return fn(x, w13, w2, weights, topk_ids, reduce=reduce)

    return broken


# ---- CPU: the comparison itself, on a tiny checkpoint in fp32 ------------------------------

@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> CausalLM:
    """tests/models' tiny Qwen3-MoE (initializer_range 0.1: every layer shows in the logits)."""
    folder = write_tiny_checkpoint("qwen3_moe", tmp_path_factory.mktemp("tiny"),
                                   mlp_only_layers=[])
    cfg = ModelConfig.from_file(os.path.join(folder, "config.json"))
    model = build_model(cfg, torch.float32, "cpu", "torch", "torch")
    load_weights(model, cfg, folder)
    return model


def test_fast_path_agrees_on_cpu_fp32(tiny_model: CausalLM) -> None:
    prompts = random_prompts(tiny_model.config.vocab_size, (1, 5, 19, 40))
    agreement = fast_vs_reference(tiny_model, prompts, num_decode=4)
    assert agreement.num_positions == 65 + 4 * 4
    check_agreement(agreement)
    assert agreement.top1 == 1.0 and agreement.rms_per_std < 1e-4, agreement  # fp32: ~exact


def test_criterion_rejects_a_dropped_expert_cpu(tiny_model: CausalLM) -> None:
    prompts = random_prompts(tiny_model.config.vocab_size, (5, 19, 40))
    agreement = fast_vs_reference(tiny_model, prompts, 4, (FAST[0], drop_top_expert(FAST[1])))
    assert agreement.failures(), agreement


def test_next_token_logits_line_up_with_greedy(tiny_model: CausalLM) -> None:
    """next_token_logits(prompts, greedy tokens) predicts exactly those tokens."""
    prompts = random_prompts(tiny_model.config.vocab_size, (1, 6, 13))
    set_backends(tiny_model, *REFERENCE)
    _, inputs = teacher_forced_logits(tiny_model, prompts, 5)  # inputs = greedy tokens
    logits = next_token_logits(tiny_model, prompts, inputs)
    assert logits.shape == (3, 5, tiny_model.config.vocab_size)
    assert torch.equal(logits.argmax(-1), inputs)


# ---- GPU: bf16 at the real per-layer shapes ------------------------------------------------

def _require_cuda() -> None:
    """These tests are marked gpu (deselected on CPU): run without CUDA, they fail loudly."""
    if not torch.cuda.is_available():
        pytest.fail("a gpu-marked test ran without a CUDA device")


def _mid_hf_config() -> dict:
    """qwen3-30b-a3b's config with 4 layers: the real per-layer shapes, ~7 GiB in bf16."""
    return {**load_preset("qwen3-30b-a3b"), "num_hidden_layers": GPU_LAYERS}


@pytest.fixture(scope="module")
def mid_model() -> CausalLM:
    _require_cuda()
    model = build_model(ModelConfig.from_hf(_mid_hf_config()), torch.bfloat16, "cuda",
                        "torch", "torch")
    init_dummy_weights(model, seed=0)
    sharpen_logits(model)
    return model


@pytest.mark.gpu
def test_fast_path_logits_agree_bf16(mid_model: CausalLM) -> None:
    """8 prompts (1 to 301 tokens): 836 prompt positions + 32 decode steps x 8 = 1092."""
    prompts = random_prompts(mid_model.config.vocab_size, GPU_PROMPT_LENS)
    agreement = fast_vs_reference(mid_model, prompts, GPU_DECODE_STEPS)
    print(agreement)
    assert agreement.num_positions == sum(GPU_PROMPT_LENS) + len(prompts) * GPU_DECODE_STEPS
    check_agreement(agreement)


@pytest.mark.gpu
def test_criterion_rejects_a_dropped_expert(mid_model: CausalLM) -> None:
    """The criterion can fail: the same comparison with a fused MoE that leaves out each
    token's top expert."""
    prompts = random_prompts(mid_model.config.vocab_size, GPU_PROMPT_LENS[:6])
    agreement = fast_vs_reference(mid_model, prompts, 8, (FAST[0], drop_top_expert(FAST[1])))
    print(agreement)
    assert agreement.failures(), agreement


@pytest.mark.gpu
def test_engine_fast_path_top1_agrees_bf16(tmp_path: Path) -> None:
    """Through the public API: the CUDA engine with Triton kernels (and its CUDA-graph decode)
    greedy-decodes 32 tokens for 12 prompts; the reference path, on a copy of the engine's
    weights, predicts each of those 384 tokens from the engine's own prefix (teacher forcing).
    Top-1 must agree at >= 99% of positions."""
    _require_cuda()
    from moeserve import LLM, SamplingParams

    (tmp_path / "config.json").write_text(json.dumps(_mid_hf_config()))
    llm = LLM(str(tmp_path), device="cuda", dtype="bfloat16", load_format="dummy", seed=0,
              attention_backend=FAST[0], moe_backend=FAST[1], mem_fraction=0.3,
              max_model_len=1024, cuda_graph_max_batch_size=16, moe_tune_budget_s=0)
    runner = llm.engine.runner
    served = runner.model
    sharpen_logits(served)  # in place: captured graphs keep reading the same lm_head
    prompts = random_prompts(served.config.vocab_size, ENGINE_PROMPT_LENS, seed=1)
    params = SamplingParams(max_tokens=GPU_DECODE_STEPS, temperature=0.0, ignore_eos=True)
    outputs = torch.tensor([r.token_ids for r in llm.generate(prompts, params)])  # [B, S]
    assert runner.graphs is not None and runner.graphs.graphs, "no CUDA graphs were captured"
    assert runner.num_graph_steps >= GPU_DECODE_STEPS - 1, runner.num_graph_steps

    ref = build_model(served.config, torch.bfloat16, "cuda", "torch", "torch")
    ref.load_state_dict(served.state_dict())
    del llm, runner, served
    gc.collect()
    with torch_norm_and_rope():
        logits = next_token_logits(ref, prompts, outputs)  # [B, S, V]
    top1 = (logits.argmax(-1).cpu() == outputs).float().mean().item()
    print(f"engine top-1 agreement {top1:.2%} over {outputs.numel()} positions")
    assert outputs.shape == (len(prompts), GPU_DECODE_STEPS)
    assert top1 >= MIN_TOP1, f"top-1 agreement {top1:.2%} < {MIN_TOP1:.0%}"


# MLA presets sliced to a few layers at their real widths (the first layers dense, then MoE)
MLA_PRESET_LAYERS = {"glm-4.7-flash": 3, "deepseek-v3": 4}
FLOOR_FACTOR = 3.0  # the fast path's rms and worst logit within 3x the model's rounding floor


def mla_preset_model(preset: str) -> CausalLM:
    hf = {**load_preset(preset), "num_hidden_layers": MLA_PRESET_LAYERS[preset]}
    model = build_model(ModelConfig.from_hf(hf), torch.bfloat16, "cuda", "torch", "torch")
    init_dummy_weights(model, seed=0)
    sharpen_logits(model)
    return model


def floor_failures(fast: Agreement, floor: Agreement) -> list[str]:
    """The MLA presets' criterion: top-1 as everywhere, and the rms and the worst logit within
    FLOOR_FACTOR x the same model's rounding floor (`floor`: the reference path with only the
    Triton RMSNorm swapped in, a change that is right by construction).

    Why not qwen3's fixed bounds: on these dummy-weight models the floor itself breaks them.
    Measured on the H200 at 1d627ad (all 1,092 positions): deepseek-v3 (4 layers) floor rms
    0.42% of std, worst 7.7x the per-logit bound, fast path 0.90% / 7.75x; glm-4.7-flash (3
    layers) floor 0.16% / 1.93x, fast 0.30% / 2.37x; top-1 100% in all four. The likely cause
    (not measured): a rounding step flips near-tied experts of the sigmoid router, whose dummy
    gate logits all sit near 0. The ratio depends on the positions compared (on a 333-position
    subset glm-4.7-flash's fast path was 3.7x its floor), so the factor holds for this set."""
    out = [f for f in fast.failures() if f.startswith("top-1")]
    if fast.rms_per_std > FLOOR_FACTOR * floor.rms_per_std:
        out.append(f"rms logit diff {fast.rms_per_std:.3%} of std > {FLOOR_FACTOR:g}x the "
                   f"rounding floor's {floor.rms_per_std:.3%}")
    if fast.worst > FLOOR_FACTOR * max(floor.worst, 1.0):
        out.append(f"worst logit {fast.worst:.2f}x the per-logit bound > {FLOOR_FACTOR:g}x the "
                   f"rounding floor's {floor.worst:.2f}x")
    return out


def _free_cuda() -> None:
    gc.collect()
    torch.cuda.empty_cache()


@pytest.mark.gpu
@pytest.mark.parametrize("preset", list(MLA_PRESET_LAYERS))
def test_mla_fast_path_logits_agree_bf16(preset: str) -> None:
    """The Triton MLA kernel (absorbed decode, and the prefill rows' up-projected form) and the
    fused MoE against the torch references, in bf16 at the preset's real per-layer shapes."""
    _require_cuda()
    model = mla_preset_model(preset)
    prompts = random_prompts(model.config.vocab_size, GPU_PROMPT_LENS)
    floor = fast_vs_reference(model, prompts, GPU_DECODE_STEPS, REFERENCE)
    fast = fast_vs_reference(model, prompts, GPU_DECODE_STEPS)
    print(preset, "floor", floor, "fast", fast)
    failures = floor_failures(fast, floor)
    del model
    _free_cuda()
    assert not failures, "; ".join(failures) + f" (fast {fast}, floor {floor})"


@pytest.mark.gpu
def test_mla_floor_criterion_rejects_a_dropped_expert() -> None:
    """The floor criterion can fail: glm-4.7-flash's fused MoE leaving out each token's top
    routed expert, on the positions of the test above.

    Not an attention error: on these dummy weights the logits barely see the attention (the
    final hidden state is mostly the token's embedding; `sharpen_logits`). Measured on the H200
    at 1d627ad over 333 positions: the Triton MLA kernel with its softmax scale 20% high gave
    an rms of 0.331% of std against the right kernel's 0.299%. The MLA kernels' bf16 accuracy
    is pinned where the attention output is compared directly, in
    tests/kernels/attention/test_mla_triton.py's GPU cases at DeepSeek-V3's dims."""
    _require_cuda()
    model = mla_preset_model("glm-4.7-flash")
    prompts = random_prompts(model.config.vocab_size, GPU_PROMPT_LENS)
    floor = fast_vs_reference(model, prompts, GPU_DECODE_STEPS, REFERENCE)
    broken = fast_vs_reference(model, prompts, GPU_DECODE_STEPS,
                               (FAST[0], drop_top_expert(FAST[1])))
    print("floor", floor, "dropped top expert", broken)
    del model
    _free_cuda()
    assert floor_failures(broken, floor), (broken, floor)
