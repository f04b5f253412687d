"""MoE over quantized expert weights: `moe_quant_triton` against `moe_quant_ref`, and the
reference itself against independent computations.

Without a GPU the kernel runs through Triton's interpreter in fp32 (and fp16) on small shapes:
each format with E 4..8, H 256 / 320 and I 128 / 192 / 200 (fp8's and int4's last groups
partial), top-k 2, T in {1, 7, 33}, weights quantized from random floats and, for nvfp4 / int4,
made of random raw bytes (every nibble code, every e4m3 scale code but NaN). The GPU tests in
bf16 (a CUDA-graph replay, a no-sync check) are test_moe_quant_triton_gpu.py's, and the FP8
scale forms' here.
"""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from moeserve.kernels.moe.quant.configs import default_quant_config
from moeserve.kernels.moe.quant.fused_triton import moe_quant_triton
from moeserve.kernels.moe.quant.ref import moe_quant_ref
from moeserve.kernels.moe.ref import moe_loop_ref
from moeserve.quant.fp8_block import E4M3, quantize_activations, quantize_blockwise
from moeserve.quant.packed import QuantView, QuantWeight, quantize_into

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOP_K = 2
# format -> (E, H, I, int4 group): H 320 / I 192 give fp8 a partial 128-group, I 200 int4 a
# partial 32-group; nvfp4 needs multiples of 16
SHAPES = {"fp8": (6, 320, 192, None), "nvfp4": (8, 256, 128, None), "int4": (4, 256, 200, 32)}
W4A16 = ("nvfp4", "int4")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| relative to max |ref|."""
    return float((out.float() - ref.float()).abs().max() / ref.float().abs().max())


def make_weight(fmt: str, e: int, n: int, k: int, group: int | None, *, raw: bool = False,
                dtype: torch.dtype = torch.float32, seed: int = 0,
                small_scales: bool = False) -> QuantWeight:
    """A QuantWeight [e, n, k]: quantized from random floats, or (raw) random bytes;
    small_scales (nvfp4, raw): only e4m3 codes of exponent 0 and 1 (subnormals and the
    smallest normals, both signs), so that they are not drowned by the large ones."""
    gen = torch.Generator().manual_seed(seed)
    w = QuantWeight(fmt, e, n, k, scale_dtype=dtype, device="cpu", int4_group=group)
    if not raw:
        quantize_into(w.view_of(), torch.randn(e, n, k, generator=gen) * k ** -0.5, w.group)
    elif fmt == "nvfp4":
        w.qweight.copy_(torch.randint(0, 256, w.qweight.shape, generator=gen))
        codes = torch.randint(0, 254, w.scale.shape, generator=gen)  # skip the NaNs 0x7F, 0xFF
        codes = codes + (codes >= 0x7F).long()
        if small_scales:  # sign, mantissa and the exponent's low bit: exponent 0 or 1
            codes = codes & 0x8F
        w.scale.copy_(codes.to(torch.uint8).view(E4M3))
        gs_base = 4.0 if small_scales else 1e-3
        w.global_scale.copy_((torch.rand(e, n, generator=gen) + 0.1) * gs_base)
    else:  # int4: every 4-bit code, high nibbles (the word's sign bit) included
        words = torch.randint(-2**31, 2**31, w.qweight.shape, generator=gen, dtype=torch.int64)
        w.qweight.copy_(words.to(torch.int32))
        w.scale.copy_(torch.rand(w.scale.shape, generator=gen) * 0.02 / math.sqrt(k))
    return w.to(DEVICE)


def experts(fmt: str, *, raw: bool = False, dtype: torch.dtype = torch.float32,
            inter: int | None = None) -> tuple[QuantWeight, QuantWeight]:
    e, h, i, group = SHAPES[fmt]
    i = inter or i
    return (make_weight(fmt, e, 2 * i, h, group, raw=raw, dtype=dtype, seed=1),
            make_weight(fmt, e, h, i, group, raw=raw, dtype=dtype, seed=2))


def routing(num_tokens: int, num_experts: int, seed: int, off_rank: bool = False
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_weights [T, k] fp32, topk_ids [T, k] int32): k distinct experts a token; with
    off_rank, every third pair's id is -1 (its expert on another rank)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:TOP_K]
                       for _ in range(num_tokens)]).int()
    if off_rank:
        ids.view(-1)[::3] = -1
    weights = torch.rand(num_tokens, TOP_K, generator=gen)
    return weights.to(DEVICE), ids.to(DEVICE)


def tokens(num_tokens: int, hidden: int, seed: int, dtype: torch.dtype = torch.float32
           ) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(num_tokens, hidden, generator=gen).to(DEVICE, dtype)


CASES = [(fmt, raw) for fmt in SHAPES for raw in ((False, True) if fmt in W4A16 else (False,))]


# ---------------------------------------------------------------- kernel vs reference

@pytest.mark.parametrize("num_tokens", [1, 7, 33])
@pytest.mark.parametrize(("fmt", "raw"), CASES)
def test_kernel_matches_ref_fp32(fmt: str, raw: bool, num_tokens: int) -> None:
    w13, w2 = experts(fmt, raw=raw)
    x = tokens(num_tokens, w13.shape[2], seed=num_tokens)
    weights, ids = routing(num_tokens, w13.shape[0], seed=num_tokens)
    out = moe_quant_triton(x, w13, w2, weights, ids)
    ref = moe_quant_ref(x, w13, w2, weights, ids)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert rel_err(out, ref) < 1e-4


@pytest.mark.parametrize("fmt", list(SHAPES))
def test_parts_and_off_rank_ids(fmt: str) -> None:
    """reduce=False: [T, k, H] parts, exactly summing to the reduced result; pairs of id -1
    give parts of exactly zero (their rows start as garbage: the kernel must zero them)."""
    w13, w2 = experts(fmt)
    x = tokens(7, w13.shape[2], seed=3)
    weights, ids = routing(7, w13.shape[0], seed=3, off_rank=True)
    parts = moe_quant_triton(x, w13, w2, weights, ids, reduce=False)
    assert parts.shape == (7, TOP_K, x.shape[1])
    assert torch.equal(parts.sum(1), moe_quant_triton(x, w13, w2, weights, ids))
    off = ids == -1
    assert off.any() and torch.equal(parts[off], torch.zeros_like(parts[off]))
    ref = moe_quant_ref(x, w13, w2, weights, ids, reduce=False)
    assert rel_err(parts, ref) < 1e-4


def assert_tiles_match_ref(fmt: str, config: dict, num_tokens: int, seed: int) -> None:
    w13, w2 = experts(fmt)
    x = tokens(num_tokens, w13.shape[2], seed=seed)
    weights, ids = routing(num_tokens, w13.shape[0], seed=seed)
    out = moe_quant_triton(x, w13, w2, weights, ids, config=config)
    assert rel_err(out, moe_quant_ref(x, w13, w2, weights, ids)) < 1e-4


def test_nvfp4_subnormal_scales() -> None:
    """e4m3 group scales of exponent 0 (subnormal: mantissa x 2^-9) and 1, decoded by bits."""
    e, h, i, _ = SHAPES["nvfp4"]
    w13 = make_weight("nvfp4", e, 2 * i, h, None, raw=True, seed=1, small_scales=True)
    w2 = make_weight("nvfp4", e, h, i, None, raw=True, seed=2, small_scales=True)
    assert (w13.scale.view(torch.uint8) & 0x78 == 0).float().mean() > 0.3  # subnormals
    x = tokens(7, h, seed=14)
    weights, ids = routing(7, e, seed=14)
    out = moe_quant_triton(x, w13, w2, weights, ids)
    assert rel_err(out, moe_quant_ref(x, w13, w2, weights, ids)) < 1e-4


def test_int4_partial_last_word() -> None:
    """I = 196: the last int32 word of each w2 row holds 4 values and 4 padding nibbles."""
    w13, w2 = experts("int4", raw=True, inter=196)
    x = tokens(7, w13.shape[2], seed=5)
    weights, ids = routing(7, w13.shape[0], seed=5)
    out = moe_quant_triton(x, w13, w2, weights, ids)
    assert rel_err(out, moe_quant_ref(x, w13, w2, weights, ids)) < 1e-4


def test_fp8_compact_scales_and_quant_views() -> None:
    """fp8 with scale_rows 128 (one scale per 128 x 128 block: w13's 128-row blocks straddle
    the gate / up boundary at I = 192); QuantViews as inputs, and weights that carry neither
    group nor scale_rows (the int4 group then read off the scale's columns)."""
    e, h, i, _ = SHAPES["fp8"]
    w13, w2 = experts("fp8")
    for w in (w13, w2):
        gen = torch.Generator().manual_seed(w.shape[1])
        blocks = [quantize_blockwise(torch.randn(*w.shape[1:], generator=gen) * 0.05)
                  for _ in range(e)]
        w.qweight.copy_(torch.stack([q for q, _ in blocks]).to(DEVICE))
        w.scale = torch.nn.Parameter(torch.stack([s for _, s in blocks]).to(DEVICE),
                                     requires_grad=False)  # [E, ceil(N / 128), ceil(K / 128)]
        w.scale_rows = 128
    x = tokens(33, h, seed=6)
    weights, ids = routing(33, e, seed=6, off_rank=True)
    ref = moe_quant_ref(x, w13, w2, weights, ids)
    assert rel_err(moe_quant_triton(x, w13, w2, weights, ids), ref) < 1e-4
    for fmt in W4A16:
        v13, v2 = experts(fmt, raw=True)
        views = v13.view_of(), v2.view_of()
        assert isinstance(views[0], QuantView)
        bare = [SimpleNamespace(format=w.format, qweight=w.qweight, scale=w.scale,
                                global_scale=w.global_scale, shape=w.shape) for w in (v13, v2)]
        x = tokens(7, v13.shape[2], seed=7)
        weights, ids = routing(7, v13.shape[0], seed=7)
        ref = moe_quant_ref(x, v13, v2, weights, ids)
        assert rel_err(moe_quant_triton(x, *views, weights, ids), ref) < 1e-4
        assert torch.equal(moe_quant_triton(x, *bare, weights, ids),
                           moe_quant_triton(x, v13, v2, weights, ids))


def _fp8_block_experts(e: int, h: int, i: int, dtype: torch.dtype
                       ) -> tuple[list[QuantWeight], list[QuantWeight]]:
    """The same FP8 128 x 128-block experts (w13, w2) twice: scales one row per 128 rows
    (scale_rows 128), and repeated to one a row (scale_rows 1)."""
    compact, per_row = [], []
    for n, k in ((2 * i, h), (h, i)):
        gen = torch.Generator().manual_seed(n)
        blocks = [quantize_blockwise(torch.randn(n, k, generator=gen) * 0.05) for _ in range(e)]
        for rows, out in ((128, compact), (1, per_row)):
            w = make_weight("fp8", e, n, k, None, dtype=dtype)
            w.qweight.copy_(torch.stack([q for q, _ in blocks]).to(DEVICE))
            scale = torch.stack([s_ for _, s_ in blocks])  # [E, N / 128, K / 128]
            if rows == 1:
                scale = scale.repeat_interleave(128, 1)
            w.scale = torch.nn.Parameter(scale.to(DEVICE), requires_grad=False)
            w.scale_rows = rows
            out.append(w)
    return compact, per_row


def test_fp8_one_weight_scale_a_tile_gives_the_per_row_bits(monkeypatch: pytest.MonkeyPatch
                                                             ) -> None:
    """N a multiple of 128 and BLOCK_N dividing it: each tile's rows share one 128-row scale,
    loaded once a step (ONE_SCALE_ROW); the same weights with a scale per row (scale_rows 1,
    loaded per row) give the same bits, and both the reference's sums; so do both with the
    scales loaded a step ahead (prefetch_scales: h 256, two 128-groups a row)."""
    from moeserve.kernels.moe.quant import fused_triton

    e, h, i = 4, 256, 128
    compact, per_row = _fp8_block_experts(e, h, i, torch.float32)
    x = tokens(21, h, seed=8)
    weights, ids = routing(21, e, seed=8, off_rank=True)
    config = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=2)
    out = moe_quant_triton(x, *compact, weights, ids, config=config)
    assert torch.equal(out, moe_quant_triton(x, *per_row, weights, ids, config=config))
    assert rel_err(out, moe_quant_ref(x, *compact, weights, ids)) < 1e-4
    monkeypatch.setattr(fused_triton, "prefetch_scales", True)
    for experts in (compact, per_row):
        assert torch.equal(out, moe_quant_triton(x, *experts, weights, ids, config=config))


@pytest.mark.parametrize("fmt", list(SHAPES))
def test_kernel_matches_ref_fp16(fmt: str) -> None:
    """fp16 activations (int4 scales fp16 too): the same dequantized fp16 weights on both
    sides; act's rounding to fp16 may differ by an ulp."""
    w13, w2 = experts(fmt, raw=fmt in W4A16, dtype=torch.float16)
    x = tokens(7, w13.shape[2], seed=8, dtype=torch.float16)
    weights, ids = routing(7, w13.shape[0], seed=8)
    out = moe_quant_triton(x, w13, w2, weights, ids)
    assert out.dtype == torch.float16
    assert rel_err(out, moe_quant_ref(x, w13, w2, weights, ids)) < 1e-3


# ---------------------------------------------------------------- the reference itself

@pytest.mark.parametrize("fmt", W4A16)
def test_w4a16_ref_is_the_loop_on_dequantized_weights(fmt: str) -> None:
    w13, w2 = experts(fmt, raw=True)
    x = tokens(33, w13.shape[2], seed=9)
    weights, ids = routing(33, w13.shape[0], seed=9, off_rank=True)
    expected = moe_loop_ref(x, w13.dequantize(), w2.dequantize(), weights, ids)
    ref = moe_quant_ref(x, w13, w2, weights, ids)
    assert rel_err(ref, expected) < 1e-5
    assert rel_err(moe_quant_ref(x, w13, w2, weights, ids, reduce=False).sum(1), expected) < 1e-5


def _block_dot(xq: torch.Tensor, sx: torch.Tensor, wq: torch.Tensor, sw: torch.Tensor,
               scale_rows: int) -> torch.Tensor:
    """One row's W8A8 product, written as the format states it: out[n] = sum over 128-blocks
    kb of sx[kb] * sw[n // scale_rows, kb] * (sum over k in kb of xq[k] * wq[n, k])."""
    n, k = wq.shape
    out = torch.zeros(n, dtype=torch.float32)
    for kb in range(math.ceil(k / 128)):
        cols = slice(kb * 128, min(k, (kb + 1) * 128))
        exact = wq[:, cols].double() @ xq[cols].double()  # e4m3 products: exact in fp64
        out += (sx[kb] * sw[torch.arange(n) // scale_rows, kb] * exact).float()
    return out


def test_fp8_ref_is_a_per_pair_loop() -> None:
    w13, w2 = (w.cpu() for w in experts("fp8"))
    e, h, i, _ = SHAPES["fp8"]
    x = tokens(7, h, seed=10).cpu()
    weights, ids = (t.cpu() for t in routing(7, e, seed=10, off_rank=True))
    expected = torch.zeros(7, h)
    for t in range(7):
        xq, sx = quantize_activations(x[t:t + 1])  # per token: the same for both its experts
        for slot in range(TOP_K):
            ex = int(ids[t, slot])
            if ex < 0:
                continue
            gate_up = _block_dot(xq[0].float(), sx[0], w13.qweight[ex].float(), w13.scale[ex], 1)
            act = (F.silu(gate_up[:i]) * gate_up[i:])[None]  # [1, I], fp32 = x's dtype
            aq, sa = quantize_activations(act)
            y = _block_dot(aq[0].float(), sa[0], w2.qweight[ex].float(), w2.scale[ex], 1)
            expected[t] += weights[t, slot] * y
    assert rel_err(moe_quant_ref(x, w13, w2, weights, ids), expected) < 1e-5


# ---------------------------------------------------------------- input checks

def test_errors_name_the_tensor() -> None:
    w13, w2 = experts("nvfp4")
    x = tokens(3, w13.shape[2], seed=11)
    weights, ids = routing(3, w13.shape[0], seed=11)
    bad_q = dataclasses.replace(w13.view_of(), qweight=w13.qweight.view(torch.int8))
    with pytest.raises(ValueError, match=r"w13\.qweight must be torch\.uint8"):
        moe_quant_triton(x, bad_q, w2, weights, ids)
    with pytest.raises(ValueError, match=r"w2: logical shape"):
        moe_quant_triton(x, w13, w13, weights, ids)  # w13 where w2 belongs
    with pytest.raises(ValueError, match=r"w13: logical shape"):
        moe_quant_triton(tokens(3, 128, seed=0), w13, w2, weights, ids)  # H disagrees
    bad_s = dataclasses.replace(w2.view_of(), scale=w2.scale[:, :, :-1])
    with pytest.raises(ValueError, match=r"w2\.scale must be"):
        moe_quant_triton(x, w13, bad_s, weights, ids)
    f13, f2 = experts("fp8")
    with pytest.raises(ValueError, match=r"w2: format 'nvfp4'"):
        moe_quant_triton(tokens(3, f13.shape[2], seed=0), f13, w2, weights, ids)
    with pytest.raises(ValueError, match=r"topk_weights"):
        moe_quant_triton(x, w13, w2, weights.double(), ids)
    with pytest.raises(ValueError, match=r"topk_ids"):
        moe_quant_triton(x, w13, w2, weights, ids[:2])


def test_config_errors() -> None:
    w13, w2 = experts("int4")
    x = tokens(3, w13.shape[2], seed=12)
    weights, ids = routing(3, w13.shape[0], seed=12)
    config = default_quant_config("int4", 3, TOP_K, w13.shape[0], 32)
    with pytest.raises(ValueError, match=r"BLOCK_K 16 must be a multiple"):
        moe_quant_triton(x, w13, w2, weights, ids, config=config | {"BLOCK_K": 16})
    with pytest.raises(ValueError, match=r"ONE_DOT"):
        moe_quant_triton(x, w13, w2, weights, ids, config=config | {"ONE_DOT": 1})
    down = {k: config[k] for k in ("BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages")}
    with pytest.raises(ValueError, match=r"'down': BLOCK_K 16 must be a multiple"):
        moe_quant_triton(x, w13, w2, weights, ids, config=config | {"down": down
                                                                    | {"BLOCK_K": 16}})
    with pytest.raises(ValueError, match=r"'down': \['PERSISTENT'\] are not supported"):
        moe_quant_triton(x, w13, w2, weights, ids, config=config | {"down": down
                                                                    | {"PERSISTENT": 2}})
    f13, f2 = experts("fp8")
    fx = tokens(3, f13.shape[2], seed=12)
    with pytest.raises(ValueError, match=r"fp8 needs BLOCK_K 128"):
        moe_quant_triton(fx, f13, f2, weights, ids, config=config | {"BLOCK_K": 64})


@pytest.mark.skipif(DEVICE != "cpu", reason="the CPU rule")
def test_bf16_is_refused_on_cpu() -> None:
    w13, w2 = experts("int4")
    weights, ids = routing(3, w13.shape[0], seed=13)
    with pytest.raises(ValueError, match=r"bf16"):
        moe_quant_triton(tokens(3, w13.shape[2], seed=13, dtype=torch.bfloat16), w13, w2,
                         weights, ids)


def test_no_tokens() -> None:
    w13, w2 = experts("nvfp4")
    x = tokens(0, w13.shape[2], seed=0)
    ids = torch.zeros(0, TOP_K, dtype=torch.int32, device=DEVICE)
    weights = torch.zeros(0, TOP_K, device=DEVICE)
    assert moe_quant_triton(x, w13, w2, weights, ids).shape == (0, x.shape[1])
    assert moe_quant_triton(x, w13, w2, weights, ids, reduce=False).shape == (0, TOP_K,
                                                                              x.shape[1])


# ---------------------------------------------------------------- GPU (bf16, graphs)

GPU_SHAPE = (16, 1024, 512)  # E, H, I
GPU_FORMATS = {"fp8": None, "nvfp4": None, "int4": 32}


def gpu_experts(fmt: str) -> tuple[QuantWeight, QuantWeight]:
    e, h, i = GPU_SHAPE
    group = GPU_FORMATS[fmt]
    return (make_weight(fmt, e, 2 * i, h, group, dtype=torch.bfloat16, seed=21),
            make_weight(fmt, e, h, i, group, dtype=torch.bfloat16, seed=22))


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [5, 64, 300])
def test_gpu_fp8_one_weight_scale_a_tile_gives_the_per_row_bits(
        num_tokens: int, monkeypatch: pytest.MonkeyPatch) -> None:
    from moeserve.kernels.moe.quant import fp8_gluon, fused_triton

    monkeypatch.setattr(fp8_gluon, "backend", "triton")  # this kernel's ONE_SCALE_ROW
    e, h, i = 16, 1024, 512
    compact, per_row = _fp8_block_experts(e, h, i, torch.bfloat16)
    x = tokens(num_tokens, h, seed=num_tokens, dtype=torch.bfloat16)
    weights, ids = routing(num_tokens, e, seed=num_tokens, off_rank=True)
    out = moe_quant_triton(x, *compact, weights, ids, tiles="default")
    assert torch.equal(out, moe_quant_triton(x, *per_row, weights, ids, tiles="default"))
    assert rel_err(out, moe_quant_ref(x, *compact, weights, ids)) < 2e-2
    monkeypatch.setattr(fused_triton, "prefetch_scales", True)  # the scales a step ahead
    for experts in (compact, per_row):
        assert torch.equal(out, moe_quant_triton(x, *experts, weights, ids, tiles="default"))


def test_fp8_act_quant_is_fused_where_a_tile_holds_whole_groups(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """act_quant: launch 1 quantizes act in its epilogue on CUDA, where it runs the
    Triton kernel (not the Gluon one), its row blocks are at most MAX_BLOCK_M high and
    its tiles' columns whole 128-groups; nowhere else (the CPU interpreter's e4m3 cast is
    wrong: the separate torch quantization)."""
    from moeserve.kernels.moe.quant import act_quant, fp8_gluon, fused_triton

    def fuses(n_cols: int, inter: int, device: str = "cuda", fmt: str = "fp8",
              rows: int = 16) -> bool:
        a = SimpleNamespace(device=torch.device(device))
        w13 = SimpleNamespace(shape=(8, 2 * inter, 1024))
        return fused_triton._fuses_act_quant(fmt, a, None, w13, 128,
                                             {"BLOCK_M": rows, "BLOCK_N": n_cols})

    assert fuses(128, 768) and fuses(256, 512) and fuses(128, 768, rows=32)
    assert not fuses(64, 768) and not fuses(128, 320) and not fuses(128, 768, "cpu")
    assert not fuses(128, 768, fmt="nvfp4")
    assert not fuses(128, 768, rows=64)  # its epilogue costs more than the launch it saves
    monkeypatch.setattr(fp8_gluon, "backend", "gluon-down")  # the gated launch stays Triton's
    assert fuses(128, 768)
    monkeypatch.setattr(act_quant, "enabled", False)
    assert not fuses(128, 768)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("num_tokens", [5, 64, 300])
def test_gpu_fp8_act_quantized_in_the_epilogue_gives_the_separate_launchs_bits(
        num_tokens: int, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """act quantized in launch 1's epilogue (one and two 128-groups a tile) gives the op the
    bits of act written in x's dtype and quantized by its own launch; the spy shows which
    ran (one quantization of x alone, or x's and act's)."""
    from moeserve.kernels.moe.quant import act_quant, fused_triton

    e, h, i = 16, 1024, 512
    compact, _ = _fp8_block_experts(e, h, i, dtype)
    x = tokens(num_tokens, h, seed=num_tokens, dtype=dtype)
    weights, ids = routing(num_tokens, e, seed=num_tokens, off_rank=True)
    quantized = []
    real = fused_triton._activations
    monkeypatch.setattr(fused_triton, "_activations",
                        lambda a, fmt: quantized.append(a.shape) or real(a, fmt))
    for n_cols in (128, 256):
        config = dict(BLOCK_M=16, BLOCK_N=n_cols, BLOCK_K=128, GROUP_M=1, num_warps=4,
                      num_stages=3)
        runs = {}
        for fused in (True, False):
            monkeypatch.setattr(act_quant, "enabled", fused)
            quantized.clear()
            runs[fused] = moe_quant_triton(x, *compact, weights, ids, config=config,
                                           reduce=False)
            assert quantized == ([(num_tokens, h)] if fused else
                                 [(num_tokens, h), (num_tokens * TOP_K, i)])
        assert torch.equal(runs[True], runs[False]), n_cols
        assert torch.equal(runs[True][ids == -1], torch.zeros_like(runs[True][ids == -1]))
    assert rel_err(runs[True].sum(1), moe_quant_ref(x, *compact, weights, ids)) < 2e-2
