"""Triton fused MoE: the kernel vs the per-expert loop (the alignment: test_moe_align.py; tile
configs and the tuner: test_moe_triton_tune.py).

Without a GPU the kernel runs through Triton's interpreter (TRITON_INTERPRET=1, set before triton
is first imported), in fp32 and fp16 on tiny shapes; with one, the same tests run compiled, and
the @pytest.mark.gpu tests add bf16 at the qwen3-30b-a3b shape and a CUDA-graph replay.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moeserve.kernels.moe import tile_configs as moe_configs
from moeserve.kernels.moe.fused_triton import moe_triton
from moeserve.kernels.moe.ref import moe_loop_ref
from moeserve.kernels.moe.search import candidate_key
from moeserve.kernels.moe.tile_configs import config_file_name, get_moe_config
from moeserve.kernels.routing.select import select_experts

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HIDDEN, INTER = 32, 16
SMALL = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=2, num_warps=4, num_stages=2)


def test_kernel_is_interpreted_without_a_gpu() -> None:
    from moeserve.kernels.moe.fused_triton import _kernel

    # triton.language binds its jit helpers at import: TRITON_INTERPRET must be set before
    interpreted = type(_kernel()).__name__ == "InterpretedFunction"
    assert interpreted == (DEVICE == "cpu")


# ---------------------------------------------------------------- the kernel

def make_experts(num_experts: int, dtype: torch.dtype, hidden: int = HIDDEN,
                 inter: int = INTER, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen) * hidden ** -0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=gen) * inter ** -0.5
    return w13.to(DEVICE, dtype), w2.to(DEVICE, dtype)


def make_routing(num_tokens: int, num_experts: int, top_k: int, dtype: torch.dtype,
                 hidden: int = HIDDEN, seed: int = 1) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen)
    weights, ids = select_experts(torch.randn(num_tokens, num_experts, generator=gen), top_k,
                                  renormalize=True)
    return x.to(DEVICE, dtype), weights.to(DEVICE), ids.to(DEVICE)


def assert_matches_ref(out: torch.Tensor, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                       weights: torch.Tensor, ids: torch.Tensor) -> None:
    assert out.shape == x.shape and out.dtype == x.dtype
    if x.dtype == torch.float32:
        torch.testing.assert_close(out, moe_loop_ref(x, w13, w2, weights, ids),
                                   atol=1e-5, rtol=1e-5)
    else:  # fp16 kernel (fp32 accumulation) vs the fp32 loop on the same fp16 values
        expected = moe_loop_ref(x.float(), w13.float(), w2.float(), weights, ids)
        torch.testing.assert_close(out.float(), expected, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("num_tokens", [0, 1, 7, 33])
@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("num_experts", [8, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_matches_loop_ref(dtype: torch.dtype, num_experts: int, top_k: int,
                          num_tokens: int) -> None:
    w13, w2 = make_experts(num_experts, dtype)
    x, weights, ids = make_routing(num_tokens, num_experts, top_k, dtype)
    out = moe_triton(x, w13, w2, weights, ids)  # default tile config
    assert_matches_ref(out, x, w13, w2, weights, ids)
    if num_tokens:
        assert out.abs().max() > 0.05


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_idle_experts_and_several_tiles_per_expert(dtype: torch.dtype) -> None:
    # BLOCK 16 over H 64 / I 48: several N- and K-tiles; 21 pairs of expert 3 span 2 blocks
    w13, w2 = make_experts(8, dtype, hidden=64, inter=48)
    x, _, _ = make_routing(21, 8, 2, dtype, hidden=64)
    ids = torch.tensor([[0, 3], [3, 0]] * 10 + [[6, 3]], device=DEVICE)  # 1,2,4,5,7 idle
    weights = torch.rand(21, 2, device=DEVICE)  # need not sum to 1
    out = moe_triton(x, w13, w2, weights, ids, config=SMALL)
    assert_matches_ref(out, x, w13, w2, weights, ids)


def test_all_tokens_to_one_expert_and_ragged_widths() -> None:
    # H 40, I 24: K and N tails masked (40 % 16, 24 % 16); all 33 tokens on expert 5
    w13, w2 = make_experts(16, torch.float32, hidden=40, inter=24)
    x, weights, _ = make_routing(33, 16, 1, torch.float32, hidden=40)
    ids = torch.full((33, 1), 5, device=DEVICE)
    out = moe_triton(x, w13, w2, weights, ids, config=SMALL)
    gate_up = x @ w13[5].T
    expected = (torch.nn.functional.silu(gate_up[:, :24]) * gate_up[:, 24:]) @ w2[5].T
    torch.testing.assert_close(out, expected * weights, atol=1e-5, rtol=1e-5)


def test_strided_rows_and_weights_are_read_in_place() -> None:
    # x rows and w13/w2 rows padded by 16 columns: only the last dim is contiguous
    w13_big, w2_big = make_experts(8, torch.float32, hidden=HIDDEN + 16, inter=INTER + 16)
    w13, w2 = w13_big[:, :2 * INTER, :HIDDEN], w2_big[:, :HIDDEN, :INTER]
    x_big, weights, ids = make_routing(9, 8, 2, torch.float32, hidden=HIDDEN + 16)
    x = x_big[:, :HIDDEN]
    assert not (x.is_contiguous() or w13.is_contiguous() or w2.is_contiguous())
    out = moe_triton(x, w13, w2, weights, ids, config=SMALL)
    assert_matches_ref(out, x.contiguous(), w13.contiguous(), w2.contiguous(), weights, ids)


def test_atomic_combine_and_torch_align_match_the_default() -> None:
    w13, w2 = make_experts(8, torch.float32)
    x, weights, ids = make_routing(33, 8, 2, torch.float32)
    summed = moe_triton(x, w13, w2, weights, ids, config=SMALL)
    atomic = moe_triton(x, w13, w2, weights, ids, config=SMALL, combine="atomic")
    torch.testing.assert_close(atomic, summed, atol=1e-6, rtol=1e-6)
    assert_matches_ref(atomic, x, w13, w2, weights, ids)
    # rows are computed independently: the order within an expert changes no bit
    torch_align = moe_triton(x, w13, w2, weights, ids, config=SMALL, align="torch")
    assert torch.equal(torch_align, summed)


@pytest.mark.parametrize("persistent", [1, 3])
@pytest.mark.parametrize("num_tokens", [1, 5, 40])
def test_persistent_launch_matches_one_program_per_tile(num_tokens: int,
                                                        persistent: int) -> None:
    """PERSISTENT n: n programs per SM (4 "SMs" off CUDA) walking the used tiles give the same
    bits as one program per tile, set on the gated launch, on the down launch alone (its "down"
    entry) or on both, fp32 and fp16, K not a multiple of BLOCK_K; a bad value is refused."""
    down = dict(BLOCK_N=32, BLOCK_K=16, GROUP_M=1, num_warps=4, num_stages=2)
    for dtype in (torch.float32, torch.float16):
        w13, w2 = make_experts(8, dtype, hidden=40)
        x, weights, ids = make_routing(num_tokens, 8, 2, dtype, hidden=40)
        once = moe_triton(x, w13, w2, weights, ids, config=SMALL)
        split_once = moe_triton(x, w13, w2, weights, ids, config={**SMALL, "down": down})
        for config, expected in (
                ({**SMALL, "PERSISTENT": persistent}, once),  # both launches (no "down")
                ({**SMALL, "PERSISTENT": persistent, "down": down}, split_once),  # gated only
                ({**SMALL, "down": {**down, "PERSISTENT": persistent}}, split_once)):
            assert torch.equal(moe_triton(x, w13, w2, weights, ids, config=config), expected)
    for bad in (-1, 9, True, 1.0):
        with pytest.raises(ValueError, match="PERSISTENT"):
            moe_triton(x, w13, w2, weights, ids, config={**SMALL, "PERSISTENT": bad})


def test_one_dot_gate_up_gives_the_same_output() -> None:
    """ONE_DOT: the gated launch reads gate and up columns side by side (w13 in its own layout)
    and does one dot of twice the width: the same output as two dots (fp32 ieee dots over the
    same K order), for N not a multiple of BLOCK_N (I = 24 with BLOCK_N 16) and K not a
    multiple of BLOCK_K, persistent too; the down launch refuses the option."""
    w13, w2 = make_experts(8, torch.float32, hidden=40, inter=24)
    x, weights, ids = make_routing(19, 8, 2, torch.float32, hidden=40)
    plain = moe_triton(x, w13, w2, weights, ids, config=SMALL)
    for extra in ({}, {"PERSISTENT": 2}):
        out = moe_triton(x, w13, w2, weights, ids, config={**SMALL, "ONE_DOT": 1, **extra})
        torch.testing.assert_close(out, plain, atol=1e-6, rtol=1e-6)
    assert_matches_ref(plain, x, w13, w2, weights, ids)
    down = {k: SMALL[k] for k in moe_configs.DOWN_KEYS}
    with pytest.raises(ValueError, match="unknown keys \\['ONE_DOT'\\]"):
        moe_triton(x, w13, w2, weights, ids, config={**SMALL, "down": {**down, "ONE_DOT": 1}})
    with pytest.raises(ValueError, match="ONE_DOT must be an int in \\[0, 1\\]"):
        moe_triton(x, w13, w2, weights, ids, config={**SMALL, "ONE_DOT": 2})


def sub_m_routing(dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """top-1 routing over 5 experts whose loads hit each SUB_M case at BLOCK_M 64 (quarter 16,
    half 32): 10 rows (a quarter tile), 20 (a half), 16 and 32 (the edges), 40 (the whole
    block) and 70 (one full block, then a block of 6: a quarter tile)."""
    loads = [10, 20, 16, 32, 40, 70]
    ids = torch.cat([torch.full((n,), e) for e, n in enumerate(loads)])
    ids = ids[torch.randperm(ids.numel(), generator=torch.Generator().manual_seed(3))]
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(ids.numel(), 40, generator=gen).to(DEVICE, dtype)
    weights = torch.rand(ids.numel(), 1, generator=gen).to(DEVICE)
    return x, weights, ids[:, None].to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_sub_m_tiles_compute_only_the_real_rows(dtype: torch.dtype) -> None:
    """SUB_M: blocks whose real rows fit a quarter or half of BLOCK_M take a tile of that
    height (both launches, or the down launch alone through its "down" entry, with ONE_DOT
    too): the same output as whole blocks; SUB_M with PERSISTENT is refused."""
    w13, w2 = make_experts(6, dtype, hidden=40)
    x, weights, ids = sub_m_routing(dtype)
    config = dict(SMALL, BLOCK_M=64, GROUP_M=1)
    whole = moe_triton(x, w13, w2, weights, ids, config=config)
    assert_matches_ref(whole, x, w13, w2, weights, ids)
    down = {k: config[k] for k in moe_configs.DOWN_KEYS}
    for sub in ({**config, "SUB_M": 1}, {**config, "SUB_M": 1, "ONE_DOT": 1},
                {**config, "down": {**down, "SUB_M": 1}}, dict(config, BLOCK_M=32, SUB_M=1)):
        out = moe_triton(x, w13, w2, weights, ids, config=sub)
        torch.testing.assert_close(out, whole, atol=1e-6 if dtype == torch.float32 else 1e-3,
                                   rtol=1e-6 if dtype == torch.float32 else 1e-3)
    with pytest.raises(ValueError, match="SUB_M and PERSISTENT"):
        moe_triton(x, w13, w2, weights, ids, config={**config, "SUB_M": 1, "PERSISTENT": 1})


@pytest.mark.parametrize("top_k", [1, 3])
def test_unreduced_output_is_the_k_weighted_rows(top_k: int) -> None:
    """reduce=False hands on [T, k, H] (the next norm sums them): their sum is the default
    output bit for bit, and each row is one expert's weighted output; "atomic" gives [T, 1, H];
    the reference backends follow the same contract."""
    from moeserve.kernels.registry import MOE_BACKENDS

    w13, w2 = make_experts(8, torch.float32)
    x, weights, ids = make_routing(21, 8, top_k, torch.float32)
    summed = moe_triton(x, w13, w2, weights, ids, config=SMALL)
    parts = moe_triton(x, w13, w2, weights, ids, config=SMALL, reduce=False)
    assert parts.shape == (21, top_k, x.shape[1])
    assert torch.equal(parts.sum(1) if top_k > 1 else parts[:, 0], summed)
    for slot in range(top_k):  # slot i of token t: expert ids[t, i] alone, weighted
        alone = moe_triton(x, w13, w2, weights[:, slot:slot + 1].contiguous(),
                           ids[:, slot:slot + 1].contiguous(), config=SMALL)
        torch.testing.assert_close(parts[:, slot], alone, atol=1e-6, rtol=1e-6)
    atomic = moe_triton(x, w13, w2, weights, ids, config=SMALL, combine="atomic", reduce=False)
    assert atomic.shape == (21, 1, x.shape[1])
    torch.testing.assert_close(atomic[:, 0], summed, atol=1e-6, rtol=1e-6)
    assert moe_triton(x[:0], w13, w2, weights[:0], ids[:0], reduce=False).shape == (0, 1, 32)
    ref = MOE_BACKENDS["torch"](x, w13, w2, weights, ids, reduce=False)
    assert ref.shape == (21, 1, x.shape[1])
    torch.testing.assert_close(ref[:, 0], summed, atol=1e-5, rtol=1e-5)


def test_launcher_rejects_bad_inputs() -> None:
    w13, w2 = make_experts(8, torch.float32)
    x, weights, ids = make_routing(4, 8, 2, torch.float32)
    with pytest.raises(TypeError, match="share one of"):
        moe_triton(x.half(), w13, w2, weights, ids)
    with pytest.raises(ValueError, match="shapes disagree"):
        moe_triton(x, w13, w2[:, :, :8], weights, ids)
    with pytest.raises(ValueError, match="w13 needs a contiguous last dim"):
        moe_triton(x, w13.transpose(1, 2).contiguous().transpose(1, 2), w2, weights, ids)
    with pytest.raises(ValueError, match="topk_weights must be float32"):
        moe_triton(x, w13, w2, weights.half(), ids)
    with pytest.raises(TypeError, match="topk_ids must be integer"):
        moe_triton(x, w13, w2, weights, ids.float())
    with pytest.raises(ValueError, match="power of two"):
        moe_triton(x, w13, w2, weights, ids, config={**SMALL, "BLOCK_K": 8})
    with pytest.raises(ValueError, match="combine must be"):
        moe_triton(x, w13, w2, weights, ids, combine="mean")
    with pytest.raises(ValueError, match="align must be"):
        moe_triton(x, w13, w2, weights, ids, align="numpy")


SPLIT = {**dict(SMALL, BLOCK_K=32, GROUP_M=1),
         "down": dict(BLOCK_N=32, BLOCK_K=16, GROUP_M=2, num_warps=2, num_stages=3)}


@pytest.mark.parametrize("combine", ["sum", "atomic"])
def test_split_config_matches_loop_ref_and_each_launch_gets_its_tiles(
        combine: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import moeserve.kernels.moe.fused_triton as mt

    # H 64, I 48: the gated launch (N = I) and the down one (N = H) each span several N- and
    # K-tiles of their own sizes; expert 3 gets two row blocks, some experts none
    w13, w2 = make_experts(8, torch.float32, hidden=64, inter=48)
    x, _, _ = make_routing(21, 8, 2, torch.float32, hidden=64)
    ids = torch.tensor([[0, 3], [3, 0]] * 10 + [[6, 3]], device=DEVICE)
    weights = torch.rand(21, 2, device=DEVICE)
    launches: list[tuple[bool, dict]] = []
    real = mt._launch

    def spy(*args: object, **kwargs: object) -> None:
        config = args[8]  # _launch reads the top-level tiles only
        launches.append((kwargs["gated"], {k: config[k] for k in moe_configs.CONFIG_KEYS}))
        real(*args, **kwargs)

    monkeypatch.setattr(mt, "_launch", spy)
    out = moe_triton(x, w13, w2, weights, ids, config=SPLIT, combine=combine)
    assert_matches_ref(out, x, w13, w2, weights, ids)
    top = {k: SPLIT[k] for k in moe_configs.CONFIG_KEYS}
    assert launches == [(True, top), (False, {"BLOCK_M": 16, **SPLIT["down"]})]
    # the same down tiles written out in full give the same bits as the top-level ones
    same = moe_triton(x, w13, w2, weights, ids, combine=combine,
                      config={**top, "down": {k: top[k] for k in moe_configs.DOWN_KEYS}})
    unsplit = moe_triton(x, w13, w2, weights, ids, config=top, combine=combine)
    if combine == "sum":
        assert torch.equal(same, unsplit)
    torch.testing.assert_close(out, unsplit, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("down", "message"), [
    (dict(SPLIT["down"], BLOCK_N=48),
     r"MoE tile config 'down' BLOCK_N must be a power of two >= 16 \(tl.dot\), got 48"),
    (dict(SPLIT["down"], BLOCK_K=8), r"'down' BLOCK_K must be a power of two >= 16.*got 8"),
    (dict(SPLIT["down"], BLOCK_M=32), r"'down' must not set BLOCK_M \(got 32\)"),
    ({k: v for k, v in SPLIT["down"].items() if k != "num_stages"},
     r"'down' lacks \['num_stages'\]"),
    (dict(SPLIT["down"], num_warps=3), r"'down' num_warps must be a power of two >= 1, got 3"),
    (dict(SPLIT["down"], num_stages=0), r"'down' num_stages must be >= 1, got 0"),
    (dict(SPLIT["down"], GROUP_M="8"), r"'down' GROUP_M must be an int, got '8'"),
    (dict(SPLIT["down"], BLOCK_SIZE=64), r"'down' holds unknown keys \['BLOCK_SIZE'\]"),
    ([32, 16, 2, 2, 3], r"'down' must be a dict of \['BLOCK_N', .*got list"),
])
def test_a_bad_down_entry_is_refused(down: object, message: str) -> None:
    w13, w2 = make_experts(8, torch.float32)
    x, weights, ids = make_routing(4, 8, 2, torch.float32)
    with pytest.raises(ValueError, match=message):
        moe_triton(x, w13, w2, weights, ids, config={**SMALL, "down": down})


def test_a_tuned_file_with_a_bad_down_entry_fails_naming_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    name = config_file_name(8, 64, 32, torch.float16, "Fake GPU")
    entry = {**SMALL, "down": dict(SPLIT["down"], BLOCK_N=24), "ms": 1.0}
    (tmp_path / name).write_text(json.dumps({"meta": {}, "configs": {"64": entry}}))
    monkeypatch.setenv(moe_configs.CONFIG_DIR_ENV, str(tmp_path))
    moe_configs.clear_caches()
    try:
        with pytest.raises(ValueError, match=r"the entry for 64 tokens: tuned MoE entry 'down' "
                                             r"BLOCK_N must be a power of two >= 16.*got 24"):
            get_moe_config(8, 64, 32, 2, torch.float16, 64, "Fake GPU")
        entry["down"] = dict(SPLIT["down"], BLOCK_K=64.0)  # JSON floats of integers are fine
        (tmp_path / name).write_text(json.dumps({"meta": {}, "configs": {"64": entry}}))
        moe_configs.clear_caches()
        choice = get_moe_config(8, 64, 32, 2, torch.float16, 64, "Fake GPU")
        assert choice.config == {**SMALL, "down": dict(SPLIT["down"], BLOCK_K=64)}
        entry["down"] = dict(SPLIT["down"], BLOCK_K=64.5)
        (tmp_path / name).write_text(json.dumps({"meta": {}, "configs": {"64": entry}}))
        moe_configs.clear_caches()
        with pytest.raises(ValueError, match=r"'down' BLOCK_K must be an integer, got 64.5"):
            get_moe_config(8, 64, 32, 2, torch.float16, 64, "Fake GPU")
    finally:
        moe_configs.clear_caches()


def test_fit_shared_memory_fits_each_launch_by_its_own_need() -> None:
    budget = moe_configs.SHARED_MEMORY_BUDGET
    config = {**moe_configs.tile_config(128, 128, 128, 8, 8, 4),
              "down": dict(BLOCK_N=64, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=3)}
    fitted = moe_configs.fit_shared_memory(config, 4)  # fp32
    # gated: (128 + 2 * 128) * 128 * 4 * 4 = 768 KiB -> 2 stages, then BLOCK_K 64 (192 KiB);
    # down: (128 + 64) * 128 * 4 * 3 = 288 KiB -> 2 stages (192 KiB) is enough, BLOCK_K kept
    assert {k: fitted[k] for k in ("BLOCK_M", "BLOCK_K", "num_stages")} == dict(
        BLOCK_M=128, BLOCK_K=64, num_stages=2)
    assert fitted["down"] == dict(config["down"], num_stages=2)
    gated_bytes, down_bytes = moe_configs.shared_memory_bytes(fitted, 4)
    assert gated_bytes == (128 + 256) * 64 * 4 * 2 <= budget
    assert down_bytes == (128 + 64) * 128 * 4 * 2 <= budget
    assert "down" not in moe_configs.fit_shared_memory(moe_configs.tile_config(
        64, 64, 64, 8, 4, 4), 4)
    assert config["down"]["num_stages"] == 3  # the input is not changed


def test_split_config_and_its_key() -> None:
    gated = dict(SMALL, BLOCK_M=64, BLOCK_N=64, GROUP_M=8)
    down = dict(gated, BLOCK_N=128, num_warps=8)
    assert moe_configs.split_config(gated, gated) == gated
    split = moe_configs.split_config(gated, down)
    assert split == {**gated, "down": {k: down[k] for k in moe_configs.DOWN_KEYS}}
    assert moe_configs.down_tiles(split) == down and moe_configs.down_tiles(gated) == gated
    assert moe_configs.config_key(gated) == "M64_N64_K16_G8_w4_s2"
    assert moe_configs.config_key(split) == "M64_N64_K16_G8_w4_s2+down_N128_K16_G8_w8_s2"
    assert candidate_key(split) == "M64_N64_K16_G8_w4_s2"
    with pytest.raises(ValueError, match="share BLOCK_M"):
        moe_configs.split_config(gated, dict(down, BLOCK_M=32))


def test_importing_without_triton_works() -> None:
    code = ("import sys; sys.modules['triton'] = None; "  # `import triton` now fails
            "import moeserve.kernels.moe.fused_triton, moeserve.kernels.moe.tile_configs, "
            "moeserve.kernels.moe.tune, "
            "moeserve.kernels.moe.align; print('ok')")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.stdout.strip() == "ok", result.stderr
