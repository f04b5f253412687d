"""The MLA layer's fused latent norm + RoPE + latent write (kernels/attention/
mla/rope_cache_triton.py) against its unfused reference (rms_norm_ref -> rotate_pairs on q and
k_rope -> cat -> write_latent into a copy of the cache): CPU through Triton's interpreter in
fp32, fp16 and bf16, interleaved and half-split RoPE, at DeepSeek-V3's layout (q_lora: q is
q_b_proj's own tensor), DeepSeek-V2-Lite's (no q_lora: q is a view of in_proj's output) and an
odd one (6 heads, R 12, L 40: every block masked), each with extra in_proj rows after the
latent (DSA's indexer keys) and a cache whose other slots hold data that must stay.

Tolerances (what the kernel promises):
  * q_rope, cos, sin, the cache row's rotated k_rope and every slot not written: bit exact,
    in every dtype (bf16 too: the kernel rounds on the fp32 bits, which the interpreter's
    truncating cast would not).
  * the normed latent: its fp32 sum of squares runs in another order (and rsqrt may differ):
    fp32 within rtol 1e-6 (atol 1e-6); fp16 / bf16 within two ulps of the dtype (rtol 2^-9 /
    2^-6: HF's order rounds the normed value, then its product with the weight, so a one-ulp
    flip of the first can land two ulps away after the second; the H200 showed 4 such values of
    2,096,640 at T 4096), on at most max(2, 0.1%) of the values. Bit exact, in every dtype, on
    inputs whose norm is exact in any order (values in {0, +-1, +-2} * 2^k, mean square a power
    of 4, eps 0).
Through the layer: the tiny MLA checkpoints (DeepSeek-V2 / V3, Kimi K2, GLM-4.7-Flash, and the
DSA ones, GLM-5 and DeepSeek-V3.2, whose indexer takes the kernel's cos / sin) give the same
logits with the fused path forced on CPU as with the torch ops, fp32, prefill then decode.
GPU (marked gpu): bf16 up to T 4096, a CUDA-graph capture with host syncs made errors, and the
layer's CUDA branch (tests/kernels/test_specialization_gpu.py counts the kernel's variants).
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, replace

import pytest
import torch

from moeserve.kernels.attention.metadata import build_attention_metadata
from moeserve.kernels.attention.mla.rope_cache_triton import (
    mla_rope_cache_ref,
    mla_rope_cache_triton,
)
from moeserve.layers import mla as mla_module
from moeserve.layers.mla import MLAttention
from tests.models.checkpoints import write_tiny_checkpoint
from tests.models.conftest import MLA_VARIANTS, VARIANTS
from tests.models.test_models_vs_hf import PROMPT_LENS, _block_tables, _build

# name -> (H, nope, R, L, q_lora_rank or None)
LAYOUTS = {"v3": (128, 128, 64, 512, 1536), "v2_lite": (16, 128, 64, 512, None),
           "odd": (6, 8, 12, 40, None), "odd_q_lora": (6, 8, 12, 40, 24)}
EXTRA_ROWS, BLOCK_SIZE, MAX_POSITION, EPS = 8, 16, 4096, 1e-6
LATENT_RTOL = {torch.float32: 1e-6, torch.float16: 2.0 ** -9, torch.bfloat16: 2.0 ** -6}
DTYPES, DTYPE_IDS = (torch.float32, torch.float16, torch.bfloat16), ("fp32", "fp16", "bf16")


@dataclass
class Case:
    a: torch.Tensor  # [T, q_part + L + R + EXTRA_ROWS]: in_proj's output
    q: torch.Tensor  # [T, H, nope + R]: a view of a (no q_lora) or its own tensor
    q_part: int
    positions: torch.Tensor  # [T] int64
    cos: torch.Tensor  # [P, R / 2] fp32
    sin: torch.Tensor
    weight: torch.Tensor  # [L]
    cache: torch.Tensor  # [num_blocks, BLOCK_SIZE, L + R], random (not zeros)
    slots: torch.Tensor  # [T] int64, distinct; may hold -1 (not written)
    interleaved: bool

    @property
    def width(self) -> int:
        return self.cache.shape[-1]

    def args(self, cache: torch.Tensor, eps: float = EPS) -> tuple:
        kv_a = self.a[:, self.q_part:self.q_part + self.width]  # [T, L + R], row stride wider
        return (kv_a, self.q, self.positions, self.cos, self.sin, self.weight, eps, cache,
                self.slots, self.interleaved)


def pair_tables(rope_dim: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1e4 ** (-torch.arange(0, rope_dim, 2, dtype=torch.float) / rope_dim)
    angles = torch.arange(MAX_POSITION, dtype=torch.float)[:, None] * inv_freq[None, :]
    return angles.cos().to(device), angles.sin().to(device)  # [P, R / 2] each


def make_case(t: int, dtype: torch.dtype, layout: str, interleaved: bool, device: str = "cpu",
              seed: int = 0, pad: bool = True) -> Case:
    """pad: with T > 1, the last token's slot is -1."""
    heads, nope, rope_dim, rank, q_lora = LAYOUTS[layout]
    gen = torch.Generator().manual_seed(seed)
    q_part = q_lora or heads * (nope + rope_dim)
    a = (torch.randn(t, q_part + rank + rope_dim + EXTRA_ROWS, generator=gen) * 2).to(dtype)
    a = a.to(device)
    if q_lora:
        q = (torch.randn(t, heads, nope + rope_dim, generator=gen) * 2).to(dtype).to(device)
    else:
        q = a[:, :q_part].view(t, heads, nope + rope_dim)
    positions = torch.randint(0, MAX_POSITION, (t,), generator=gen)
    positions[0] = MAX_POSITION - 1
    num_blocks = -(-(2 * t + 3 * BLOCK_SIZE) // BLOCK_SIZE)  # room for untouched slots
    cache = torch.randn(num_blocks, BLOCK_SIZE, rank + rope_dim, generator=gen).to(dtype)
    slots = torch.randperm(num_blocks * BLOCK_SIZE, generator=gen)[:t]
    if pad and t > 1:
        slots[-1] = -1
    weight = (1 + 0.3 * torch.randn(rank, generator=gen)).to(dtype)
    return Case(a, q, q_part, positions.to(device), *pair_tables(rope_dim, device),
                weight.to(device), cache.to(device), slots.to(device), interleaved)


def exact_norm_case(dtype: torch.dtype, layout: str, interleaved: bool, t: int = 9,
                    device: str = "cpu", max_exp: int = 2) -> Case:
    """Latents of values in {0, +-1, +-2} * 2^k (|k| <= max_exp) with mean square 4^k: the sum
    of squares is exact in any order and rsqrt of a power of 4 is exact, so the normed latent
    (eps 0) agrees bit for bit and any difference would come from the rest."""
    case = make_case(t, dtype, layout, interleaved, device, seed=t)
    rank = LAYOUTS[layout][3]
    gen = torch.Generator().manual_seed(1)
    quads = torch.tensor([[1.0, 1, 1, 1], [2, 0, 0, 0], [0, 2, 0, 0], [0, 0, 0, 2]])  # sq sum 4
    latent = quads[torch.randint(0, 4, (t, rank // 4), generator=gen)]  # [T, L / 4, 4]
    signs = torch.randint(0, 2, latent.shape, generator=gen) * 2 - 1
    scale = 2.0 ** torch.randint(-max_exp, max_exp + 1, (t, 1, 1), generator=gen)
    with torch.no_grad():
        case.a[:, case.q_part:case.q_part + rank] = (latent * signs * scale).reshape(t, rank)
    return case


def assert_latent_close(got: torch.Tensor, want: torch.Tensor, exact: bool) -> None:
    """The normed latent's bound of the module docstring."""
    assert got.shape == want.shape and got.dtype == want.dtype
    if exact:
        assert torch.equal(got, want), "the normed latent differs"
        return
    torch.testing.assert_close(got, want, rtol=LATENT_RTOL[got.dtype], atol=1e-6)
    if got.dtype != torch.float32:
        flips = int((got != want).sum())
        assert flips <= max(2, 1e-3 * got.numel()), f"{flips} of {got.numel()} values differ"


def check_fused(case: Case, exact: bool = False, eps: float = EPS) -> None:
    """The kernel against the reference: the outputs for every token, the cache rows of the
    tokens with a slot in range, every other slot as it was; a and q not modified."""
    a_before, q_before = case.a.clone(), case.q.clone()
    got_cache = case.cache.clone()
    got = mla_rope_cache_triton(*case.args(got_cache, eps))
    assert torch.equal(case.a, a_before) and torch.equal(case.q, q_before), "input modified"
    t, width = case.a.shape[0], case.width
    scratch = case.cache.new_zeros(1, t, width)  # every token's row, at slots 0 .. T - 1
    want = mla_rope_cache_ref(*replace(case, slots=torch.arange(t, device=case.a.device))
                              .args(scratch, eps))
    for g, w, what in zip(got, want, ("q_rope", "cos", "sin"), strict=True):
        assert g.is_contiguous() and g.shape == w.shape and g.dtype == w.dtype, what
        assert torch.equal(g, w), f"{what} differs"
    flat_got = got_cache.view(-1, width)
    num_slots = flat_got.shape[0]
    valid = (case.slots >= 0) & (case.slots < num_slots)
    written = torch.zeros(num_slots, dtype=torch.bool, device=valid.device)
    written[case.slots[valid]] = True
    assert torch.equal(flat_got[~written], case.cache.view(-1, width)[~written]), \
        "a slot outside slot_mapping was written"
    rank = width - case.cos.shape[1] * 2
    want_rows = scratch[0][valid]  # [n, L + R]: the reference's rows of the written tokens
    got_rows = flat_got[case.slots[valid]]
    assert torch.equal(got_rows[:, rank:], want_rows[:, rank:]), "k_rope differs"
    assert_latent_close(got_rows[:, :rank], want_rows[:, :rank], exact)


# ---- CPU, through Triton's interpreter ----

@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("interleaved", (True, False), ids=("interleaved", "half"))
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("t", (1, 7))
def test_matches_reference(t: int, dtype: torch.dtype, interleaved: bool, layout: str) -> None:
    check_fused(make_case(t, dtype, layout, interleaved, seed=t))


@pytest.mark.parametrize("layout", ("v3", "odd"))
@pytest.mark.parametrize("interleaved", (True, False), ids=("interleaved", "half"))
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_bit_exact_given_an_exact_norm(dtype: torch.dtype, interleaved: bool,
                                       layout: str) -> None:
    check_fused(exact_norm_case(dtype, layout, interleaved), exact=True, eps=0.0)


def test_empty_step() -> None:
    case = make_case(3, torch.float32, "odd", True)
    empty = replace(case, a=case.a[:0], q=case.q[:0], positions=case.positions[:0],
                    slots=case.slots[:0])
    cache = case.cache.clone()
    q_rope, cos, sin = mla_rope_cache_triton(*empty.args(cache))
    assert q_rope.shape == (0, 6, 12) and cos.shape == sin.shape == (0, 6)
    assert torch.equal(cache, case.cache)


def test_padding_slots() -> None:
    """CUDA-graph padding rows all write the null block's slot 0 (duplicates: one of their rows
    lands there, as with write_latent); a slot outside the cache (-1, or past its end) is not
    written. q_rope is computed for every row."""
    case = exact_norm_case(torch.float32, "odd", False, t=6)
    num_slots = case.cache.shape[0] * BLOCK_SIZE
    case.slots = torch.tensor([5, -1, num_slots, 0, 0, 0])
    cache = case.cache.clone()
    got = mla_rope_cache_triton(*case.args(cache, 0.0))
    rows = case.cache.new_zeros(1, 6, 52)
    want = mla_rope_cache_ref(*replace(case, slots=torch.arange(6)).args(rows, 0.0))
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    flat = cache.view(num_slots, 52)
    assert torch.equal(flat[5], rows[0, 0])
    assert any(torch.equal(flat[0], rows[0, i]) for i in (3, 4, 5))
    rest = torch.ones(num_slots, dtype=torch.bool)
    rest[[0, 5]] = False
    assert torch.equal(flat[rest], case.cache.view(num_slots, 52)[rest])


@pytest.mark.parametrize("layout", ("v2_lite", "odd_q_lora"))
@pytest.mark.parametrize("fused", (True, False), ids=("kernel", "reference"))
def test_writes_q_rope_into_the_tail_of_a_latent_query_buffer(layout: str, fused: bool) -> None:
    """q_out, the last R columns of a [T, H, L + R] buffer (layers/mla.py's absorbed query):
    q_rope is written there, the same values as a new tensor's, and returned as that view; the
    buffer's first L columns keep what they held."""
    case = make_case(5, torch.float32, layout, True, seed=2, pad=False)  # the reference's slots
    heads, rope_dim = case.q.shape[1], 2 * case.cos.shape[1]
    rank = case.width - rope_dim
    buffer = torch.full((5, heads, rank + rope_dim), 7.0)
    fn = mla_rope_cache_triton if fused else mla_rope_cache_ref
    want = fn(*case.args(case.cache.clone()))
    got = fn(*case.args(case.cache.clone()), q_out=buffer[..., rank:])
    assert got[0].data_ptr() == buffer[..., rank:].data_ptr() and got[0].stride() == (
        heads * (rank + rope_dim), rank + rope_dim, 1)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    assert torch.equal(buffer[..., rank:], want[0])
    assert bool((buffer[..., :rank] == 7.0).all()), "the latent columns were written"


def test_rejects_bad_inputs() -> None:
    case = make_case(3, torch.float32, "odd", True)
    cache = case.cache.clone()
    names = ("kv_a", "q", "positions", "cos_table", "sin_table", "norm_weight", "eps",
             "latent_cache", "slot_mapping", "interleaved")

    def call(**change: object) -> None:
        mla_rope_cache_triton(**{**dict(zip(names, case.args(cache), strict=True)), **change})

    kv_a = case.args(cache)[0]
    with pytest.raises(ValueError, match="kv_a must be"):
        call(kv_a=kv_a[:, :-1])
    with pytest.raises(ValueError, match="kv_a must be"):
        call(kv_a=torch.randn(3, 104)[:, ::2])  # [T, L + R], last stride 2
    with pytest.raises(ValueError, match="q must be"):
        call(q=case.q[..., :10])
    with pytest.raises(ValueError, match="share one floating dtype"):
        call(q=case.q.half())
    with pytest.raises(ValueError, match="latent_cache must be"):
        call(latent_cache=cache.transpose(0, 1))
    with pytest.raises(ValueError, match="norm_weight must be"):
        call(norm_weight=case.weight[:-1])
    with pytest.raises(ValueError, match="slot_mapping must be int64"):
        call(slot_mapping=case.slots.int())
    with pytest.raises(ValueError, match="positions must be integer"):
        call(positions=case.positions.float())
    with pytest.raises(ValueError, match="cos_table must be"):
        call(cos_table=case.cos.double())
    with pytest.raises(ValueError, match="differ"):
        call(sin_table=case.sin[:, :4].contiguous())
    with pytest.raises(ValueError, match="q_out must be"):
        call(q_out=torch.empty(3, 6, 11))
    with pytest.raises(ValueError, match="q_out must be"):
        call(q_out=torch.empty(3, 6, 24)[..., ::2])  # last stride 2
    with pytest.raises(ValueError, match="q_out must be"):
        call(q_out=torch.empty(3, 6, 12, dtype=torch.float16))
    assert torch.equal(cache, case.cache)


# ---- the layer ----

@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory):
    """variant (tests/models/conftest.py's) -> its tiny checkpoint's folder, written once."""
    cache: dict[str, str] = {}

    def get(variant: str) -> str:
        if variant not in cache:
            arch, sharded, overrides = VARIANTS[variant]
            cache[variant] = str(write_tiny_checkpoint(arch, tmp_path_factory.mktemp(variant),
                                                       sharded=sharded, **overrides))
        return cache[variant]

    return get


def mla_layers(model: torch.nn.Module) -> list[MLAttention]:
    return [m for m in model.modules() if isinstance(m, MLAttention)]


def run_steps(model: torch.nn.Module, cfg: object, kv: list) -> list[torch.Tensor]:
    """A batched prefill of PROMPT_LENS (DSA: the 11-token prompt sparse) and a decode step on
    fresh (zeroed) caches; their logits and the caches after."""
    for c in kv:
        for x in c if isinstance(c, tuple) else (c,):
            x.zero_()
    rng = random.Random(0)
    prompts = [[rng.randrange(cfg.vocab_size) for _ in range(n)] for n in PROMPT_LENS]
    tables = _block_tables(rng, PROMPT_LENS)
    block_size = kv[0].latent.shape[1] if isinstance(kv[0], tuple) else kv[0].shape[1]
    meta = build_attention_metadata([0] * 3, list(PROMPT_LENS), tables, block_size, "cpu")
    ids = torch.tensor([t for p in prompts for t in p])
    prefill = model.compute_logits(model(ids, meta.positions, meta))  # [T, V]
    starts = meta.query_start_loc.tolist()
    new = prefill[[s - 1 for s in starts[1:]]].argmax(-1)
    meta = build_attention_metadata(list(PROMPT_LENS), [1] * 3, tables, block_size, "cpu")
    decode = model.compute_logits(model(new, meta.positions, meta))
    caches = [x.clone() for c in kv for x in (c if isinstance(c, tuple) else (c,))]
    return [prefill, decode, *caches]


@pytest.mark.parametrize("variant", MLA_VARIANTS)
@pytest.mark.parametrize("interleaved", (True, False), ids=("interleaved", "half"))
@torch.inference_mode()
def test_model_logits_fused_on_cpu_equal_the_torch_ops(
        variant: str, interleaved: bool, tiny_folder, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused branch (the layer's on CUDA) forced on CPU: the same logits and caches (fp32,
    within 1e-5 of their largest magnitude: the latents' norm bound, carried on); without
    forcing, the CPU layer never calls the kernel. Half-split RoPE set on the layers (the
    checkpoints' is interleaved)."""
    calls = []

    def counted(*args: object, **kwargs: object) -> tuple:
        calls.append(1)
        return mla_rope_cache_triton(*args, **kwargs)

    monkeypatch.setattr(mla_module, "mla_rope_cache_triton", counted)
    model, cfg, kv = _build(tiny_folder(variant), "torch")
    layers = mla_layers(model)
    assert layers
    for layer in layers:
        layer.interleaved = interleaved
    want = run_steps(model, cfg, kv)
    assert not calls, "the fused kernel ran on CPU unforced"
    for layer in layers:
        layer.fused_rope_cache = True
    got = run_steps(model, cfg, kv)
    assert len(calls) == 2 * len(layers)
    whats = ["prefill logits", "decode logits"] + [f"cache {i}" for i in range(len(got) - 2)]
    for g, w, what in zip(got, want, whats, strict=True):
        err = (g - w).abs().max().item()
        assert err <= 1e-5 * w.abs().max().item(), f"{what}: max error {err:.3g}"


def test_layer_branches_without_a_model(tiny_folder) -> None:
    """The layer's torch branch is the reference bit for bit (CPU, as before the kernel); its
    fused branch (forced) matches it to the kernel's bound."""
    model, _, kv = _build(tiny_folder("deepseek_v2"), "torch")  # no q_lora: q is a's view
    layer = mla_layers(model)[0]
    gen = torch.Generator().manual_seed(3)
    t = 6
    a = torch.randn(t, layer.in_proj.shape[0], generator=gen)
    q = a[:, :layer.q_part].view(t, layer.num_heads, -1)
    positions = torch.tensor([0, 1, 2, 300, 511, 7])
    slots = torch.tensor([16, 17, 18, 40, 60, 3])
    rank = layer.kv_lora_rank
    results = {}
    for branch in ("torch", "ref", "fused"):
        layer.kv_cache.zero_()
        if branch == "ref":
            out = mla_rope_cache_ref(a[:, layer.q_part:layer.latent_end], q, positions,
                                     layer.cos, layer.sin, layer.kv_a_layernorm.weight,
                                     layer.kv_a_layernorm.eps, layer.kv_cache, slots,
                                     layer.interleaved)
        else:
            out = layer._rope_cache(positions, a, q, slots, fused=branch == "fused")
        results[branch] = (*out, layer.kv_cache.clone())
    assert all(torch.equal(x, y) for x, y in zip(results["torch"], results["ref"], strict=True))
    *fused, fused_cache = results["fused"]
    *torch_out, torch_cache = results["torch"]
    assert all(torch.equal(x, y) for x, y in zip(fused, torch_out, strict=True))
    assert torch.equal(fused_cache[..., rank:], torch_cache[..., rank:])
    torch.testing.assert_close(fused_cache, torch_cache, rtol=1e-6, atol=1e-6)
    assert kv  # the model's caches stay bound


# ---- GPU, bf16 ----

@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("interleaved", (True, False), ids=("interleaved", "half"))
@pytest.mark.parametrize("t", (1, 7, 300, 4096))
def test_gpu_bf16(t: int, interleaved: bool, layout: str) -> None:
    check_fused(make_case(t, torch.bfloat16, layout, interleaved, "cuda", seed=t))


@pytest.mark.gpu
@pytest.mark.parametrize("interleaved", (True, False), ids=("interleaved", "half"))
def test_gpu_bit_exact_given_an_exact_norm(interleaved: bool) -> None:
    """As on CPU, with mean squares of 1 only (tl.rsqrt is the GPU's approximate rsqrt: exact
    at 1.0, not promised at other powers of 4)."""
    check_fused(exact_norm_case(torch.bfloat16, "v3", interleaved, t=64, device="cuda",
                                max_exp=0), exact=True, eps=0.0)


@pytest.mark.gpu
def test_gpu_in_cuda_graph_without_host_sync() -> None:
    """Captured once under sync-debug "error" (a host sync raises), replayed on new inputs
    written in place: the same as eager."""
    t = 256
    case = make_case(t, torch.bfloat16, "v3", True, "cuda", pad=False)
    graph_cache = case.cache.clone()
    mla_rope_cache_triton(*case.args(graph_cache))  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.graph(graph):
            out_graph = mla_rope_cache_triton(*case.args(graph_cache))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    num_slots = graph_cache.shape[0] * BLOCK_SIZE
    for seed in range(2):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        case.a.copy_(torch.randn(case.a.shape, device="cuda", generator=gen))
        case.q.copy_(torch.randn(case.q.shape, device="cuda", generator=gen))
        case.positions.copy_(torch.randint(0, MAX_POSITION, (t,), device="cuda", generator=gen))
        case.slots.copy_(torch.randperm(num_slots, device="cuda", generator=gen)[:t])
        eager_cache = graph_cache.clone()
        graph.replay()
        out_eager = mla_rope_cache_triton(*case.args(eager_cache))
        assert all(torch.equal(g, e) for g, e in zip(out_graph, out_eager, strict=True))
        assert torch.equal(graph_cache, eager_cache), f"replay {seed}: cache differs"


@pytest.mark.gpu
def test_gpu_layer_uses_the_fused_kernel(tiny_folder, monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA the layer's forward takes the fused branch (once per layer and step), and its
    results match the torch branch (fused_rope_cache False) to the kernel's bound."""
    calls = []

    def counted(*args: object, **kwargs: object) -> tuple:
        calls.append(1)
        return mla_rope_cache_triton(*args, **kwargs)

    monkeypatch.setattr(mla_module, "mla_rope_cache_triton", counted)
    from moeserve.kernels.attention.mla.reference import mla_attention_ref
    from moeserve.model_config import ModelConfig

    cfg = ModelConfig.from_file(os.path.join(tiny_folder("deepseek_v3"), "config.json"))
    layer = MLAttention(0, cfg, mla_attention_ref, torch.bfloat16, "cuda")
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape) * 0.1 + (p.dim() == 1))
    layer.kv_cache = torch.zeros(8, 4, layer.kv_lora_rank + layer.rope_dim,
                                 dtype=torch.bfloat16, device="cuda")
    meta = build_attention_metadata([0, 5], [4, 1], [[1, 2], [3, 4]], 4, "cuda")
    hidden = torch.randn(5, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    fused = layer.pre_attention(meta.positions, hidden, meta.slot_mapping)
    assert calls == [1]
    fused_cache = layer.kv_cache.clone()
    layer.fused_rope_cache = False
    unfused = layer.pre_attention(meta.positions, hidden, meta.slot_mapping)
    assert calls == [1]
    assert torch.equal(fused.q_rope, unfused.q_rope)
    assert torch.equal(fused.proj.cos, unfused.proj.cos)
    rank = layer.kv_lora_rank
    assert torch.equal(fused_cache[..., rank:], layer.kv_cache[..., rank:])
    assert_latent_close(fused_cache[..., :rank], layer.kv_cache[..., :rank], exact=False)
