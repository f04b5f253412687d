"""The "measured" MoE backend and the engine tune: backend picks recorded by the tuner, nearest
token count lookup, the tile source (test_moe_measured_tune.py: the tuner's JSON round trip,
its time budget and resume, `ensure_tuned`).

On CPU the Triton kernel runs through the interpreter (tests/conftest.py) on tiny shapes; tuned
files are written for the device name "cpu" (what the backend looks up for CPU tensors) or
"Fake GPU", with fake timers standing in for the CUDA ones.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from moeserve.kernels.moe import measured as moe_measured
from moeserve.kernels.moe import tile_configs as moe_configs
from moeserve.kernels.moe.ref import moe_loop_ref
from moeserve.kernels.moe.tile_configs import (
    config_file_name,
    find_tuned,
    get_moe_config,
    nearest_token_count,
)
from moeserve.kernels.routing.select import select_experts
from tests.kernels.moe.launch_spy import spy_launches

pytestmark = pytest.mark.usefixtures("isolated_config_dirs")  # conftest.py

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
E, H, N, K = 8, 32, 16, 2  # tiny expert shape: experts, hidden, expert width, top-k
SMALL = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=1, num_warps=4, num_stages=2)
# test_moe_measured_tune.py's fake timers' pick: gated BLOCK_N 16, down BLOCK_N 32
SPLIT = {**dict(SMALL, BLOCK_N=16), "down": {k: SMALL[k] for k in moe_configs.DOWN_KEYS}
         | {"BLOCK_N": 32}}




def write_tuned(directory: Path, entries: dict[int, dict], device: str = "cpu",
                dtype: torch.dtype = torch.float32) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / config_file_name(E, H, N, dtype, device)
    doc = {"meta": {}, "configs": {str(n): e for n, e in entries.items()}}
    path.write_text(json.dumps(doc))
    moe_configs.clear_caches()
    return path


def experts_and_tokens(num_tokens: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(E, 2 * N, H, generator=gen) * H ** -0.5
    w2 = torch.randn(E, H, N, generator=gen) * N ** -0.5
    x = torch.randn(num_tokens, H, generator=gen)
    weights, ids = select_experts(torch.randn(num_tokens, E, generator=gen), K, renormalize=True)
    return tuple(t.to(DEVICE) for t in (x, w13, w2, weights, ids))


class Spy:
    """Counts the calls of each backend inside moe_measured, and runs the real one."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[str, int, dict | None]] = []
        real_triton, real_grouped = moe_measured.moe_triton, moe_measured.moe_grouped_mm

        def triton(x: torch.Tensor, *args: torch.Tensor, config: dict,
                   reduce: bool = True) -> torch.Tensor:
            self.calls.append(("triton", x.shape[0], config))
            return real_triton(x, *args, config=config, reduce=reduce)

        def grouped(x: torch.Tensor, *args: torch.Tensor, reduce: bool = True) -> torch.Tensor:
            self.calls.append(("grouped_mm", x.shape[0], None))
            return real_grouped(x, *args, reduce=reduce)

        monkeypatch.setattr(moe_measured, "moe_triton", triton)
        monkeypatch.setattr(moe_measured, "moe_grouped_mm", grouped)


# ---------------------------------------------------------------- lookup

def test_nearest_token_count_takes_the_closest_and_the_smaller_on_ties() -> None:
    tuned = [1, 4, 16, 64]
    assert [nearest_token_count(tuned, n) for n in (0, 1, 2, 3, 10, 11, 40, 41, 5000)] == \
        [1, 1, 1, 4, 4, 16, 16, 64, 64]  # 10: 6 from 4 and from 16
    assert nearest_token_count({8: "a", 2: "b"}, 5) == 2  # tie 2 / 8: the smaller


def test_entry_backend_is_read_and_defaults_to_triton(isolated_config_dirs: Path) -> None:
    path = write_tuned(isolated_config_dirs / "env", {
        1: {**SMALL, "ms": 0.3, "grouped_mm_ms": 0.2, "backend": "grouped_mm"},
        64: {**SMALL, "BLOCK_M": 32, "ms": 0.5}})  # an older file: no backend recorded
    small = get_moe_config(E, H, N, K, torch.float32, 3, "cpu")
    assert (small.backend, small.tuned_tokens, small.source) == ("grouped_mm", 1, str(path))
    large = get_moe_config(E, H, N, K, torch.float32, 100, "cpu")
    assert (large.backend, large.tuned_tokens, large.config["BLOCK_M"]) == ("triton", 64, 32)
    untuned = get_moe_config(E, H, N, K, torch.float16, 3, "cpu")
    assert (untuned.tuned, untuned.backend, untuned.tuned_tokens) == (False, "triton", None)
    write_tuned(isolated_config_dirs / "env", {1: {**SMALL, "backend": "cutlass"}})
    with pytest.raises(ValueError, match="backend 'cutlass'"):
        get_moe_config(E, H, N, K, torch.float32, 3, "cpu")


def test_lookup_order_env_then_package_then_user_cache(isolated_config_dirs: Path) -> None:
    cache = isolated_config_dirs / "cache" / "moe_configs"
    write_tuned(cache, {8: dict(SMALL, BLOCK_N=64)})
    assert find_tuned(E, H, N, torch.float32, "cpu")[0] == str(cache / config_file_name(
        E, H, N, torch.float32, "cpu"))
    write_tuned(isolated_config_dirs / "package", {8: dict(SMALL, BLOCK_N=32)})
    assert get_moe_config(E, H, N, K, torch.float32, 8, "cpu").config["BLOCK_N"] == 32
    write_tuned(isolated_config_dirs / "env", {8: dict(SMALL, BLOCK_N=16)})
    assert get_moe_config(E, H, N, K, torch.float32, 8, "cpu").config["BLOCK_N"] == 16


def test_the_capacity_report_names_the_down_tiles(isolated_config_dirs: Path) -> None:
    from moeserve.engine import moe_setup

    write_tuned(isolated_config_dirs / "env", {1: SMALL, 64: {**SPLIT, "backend": "grouped_mm"}},
                device="Fake GPU", dtype=torch.float16)
    cfg = SimpleNamespace(moe_backend="measured", moe_tiles="tuned",
                          scheduler=SimpleNamespace(max_num_batched_tokens=2048))
    mc = SimpleNamespace(num_experts=E, hidden_size=H, moe_intermediate_size=N,
                         num_experts_per_tok=K)
    report = moe_setup.moe_configs(cfg, mc, torch.float16, "Fake GPU", (E, H, N))
    assert report["1"]["config"] == SMALL and report["1"]["tiles"] == "M16_N16_K16_G1_w4_s2"
    assert report["64"]["config"] == SPLIT and report["64"]["backend"] == "grouped_mm"
    assert report["64"]["tiles"] == "M16_N16_K16_G1_w4_s2+down_N32_K16_G1_w4_s2"


# ---------------------------------------------------------------- the measured backend

# grouped_mm measured faster at 2 tokens, triton (BLOCK_N 32) at 16
TWO_BACKENDS = {2: {**SMALL, "ms": 0.3, "grouped_mm_ms": 0.2, "backend": "grouped_mm"},
                16: {**SMALL, "BLOCK_N": 32, "ms": 0.4, "grouped_mm_ms": 0.6, "backend": "triton"}}


def test_measured_runs_the_backend_of_the_nearest_entry(isolated_config_dirs: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    write_tuned(isolated_config_dirs / "env", TWO_BACKENDS)
    spy = Spy(monkeypatch)
    for num_tokens in (1, 9, 10, 33):  # nearest: 2, 2 (a tie), 16, 16
        x, w13, w2, weights, ids = experts_and_tokens(num_tokens, seed=num_tokens)
        out = moe_measured.moe_measured(x, w13, w2, weights, ids)
        torch.testing.assert_close(out, moe_loop_ref(x, w13, w2, weights, ids),
                                   atol=1e-5, rtol=1e-5)
    assert [(b, n) for b, n, _ in spy.calls] == [("grouped_mm", 1), ("grouped_mm", 9),
                                                 ("triton", 10), ("triton", 33)]
    assert spy.calls[2][2] == dict(SMALL, BLOCK_N=32)  # the entry's tiles, not the defaults


def test_measured_without_a_tune_is_triton_with_default_tiles(
        monkeypatch: pytest.MonkeyPatch) -> None:
    spy = Spy(monkeypatch)
    for num_tokens in (0, 3, 33):
        x, w13, w2, weights, ids = experts_and_tokens(num_tokens, seed=7)
        out = moe_measured.moe_measured(x, w13, w2, weights, ids)
        assert out.shape == (num_tokens, H)
        torch.testing.assert_close(out, moe_loop_ref(x, w13, w2, weights, ids),
                                   atol=1e-5, rtol=1e-5)
    assert [(b, n) for b, n, _ in spy.calls] == [("triton", 0), ("triton", 3), ("triton", 33)]
    assert spy.calls[1][2] == moe_configs.fit_shared_memory(
        moe_configs.default_moe_config(E, K, 3), x.element_size())


def test_measured_picks_are_cached_per_shape_and_token_count(
        isolated_config_dirs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_tuned(isolated_config_dirs / "env", {4: {**SMALL, "backend": "grouped_mm"}})
    x, w13, w2, weights, ids = experts_and_tokens(4)
    lookups: list[int] = []
    real = moe_configs.get_moe_config

    def counting(*args: object, **kwargs: object) -> moe_configs.MoeConfigChoice:
        lookups.append(args[5])
        return real(*args, **kwargs)

    monkeypatch.setattr(moe_configs, "get_moe_config", counting)
    spy = Spy(monkeypatch)
    for _ in range(3):
        moe_measured.moe_measured(x, w13, w2, weights, ids)
    assert lookups == [4] and [b for b, _, _ in spy.calls] == ["grouped_mm"] * 3
    # a new tune (clear_caches) is seen by the next call
    write_tuned(isolated_config_dirs / "env", {4: {**SMALL, "backend": "triton"}})
    moe_measured.moe_measured(x, w13, w2, weights, ids)
    assert lookups == [4, 4] and spy.calls[-1][0] == "triton"


# ---------------------------------------------------------------- the tile source (moe_tiles)

def default_tiles(num_tokens: int, dtype: torch.dtype = torch.float32) -> dict:
    """What get_moe_config falls back to at this token count (the tiny shape, `dtype`)."""
    return moe_configs.fit_shared_memory(moe_configs.default_moe_config(E, K, num_tokens),
                                         torch.empty((), dtype=dtype).element_size())


def test_default_tiles_leave_a_tuned_file_out(isolated_config_dirs: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_tuned(isolated_config_dirs / "env", {
        1: {**SMALL, "backend": "grouped_mm"}, 64: dict(SMALL, BLOCK_M=32)})
    tuned = get_moe_config(E, H, N, K, torch.float32, 1, "cpu", tiles="tuned")
    assert (tuned.tuned, tuned.source, tuned.backend) == (True, str(path), "grouped_mm")

    def no_file(*args: object) -> None:
        raise AssertionError("tiles='default' reads no tuned file")

    monkeypatch.setattr(moe_configs, "find_tuned", no_file)
    for num_tokens in (1, 64, 4096):
        choice = get_moe_config(E, H, N, K, torch.float32, num_tokens, "cpu", tiles="default")
        assert choice == moe_configs.MoeConfigChoice(default_tiles(num_tokens), tuned=False,
                                                     source="default", backend="triton",
                                                     tuned_tokens=None)
    with pytest.raises(ValueError, match=r"MoE tiles must be one of tuned, default; got 'x'"):
        get_moe_config(E, H, N, K, torch.float32, 1, "cpu", tiles="x")


def test_triton_with_default_tiles_launches_the_defaults(isolated_config_dirs: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from moeserve.kernels.moe import fused_triton as triton_module

    write_tuned(isolated_config_dirs / "env", {4: dict(SMALL, BLOCK_N=32)})
    launched = spy_launches(monkeypatch, triton_module, 8)
    x, w13, w2, weights, ids = experts_and_tokens(4, seed=3)
    expected = moe_loop_ref(x, w13, w2, weights, ids)
    for tiles, config in (("tuned", dict(SMALL, BLOCK_N=32)), ("default", default_tiles(4))):
        launched.clear()
        out = triton_module.moe_triton(x, w13, w2, weights, ids, tiles=tiles)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
        assert launched == [config, moe_configs.down_tiles(config)], tiles
    with pytest.raises(ValueError, match="MoE tiles must be one of"):
        triton_module.moe_triton(x, w13, w2, weights, ids, tiles="x")


def test_measured_with_default_tiles_is_triton_and_keeps_its_own_picks(
        isolated_config_dirs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two engines in one process, one per tile source: the plan cache is keyed on the source,
    so neither sees the other's pick."""
    write_tuned(isolated_config_dirs / "env", {4: {**SMALL, "backend": "grouped_mm"}})
    spy = Spy(monkeypatch)
    x, w13, w2, weights, ids = experts_and_tokens(4, seed=5)
    expected = moe_loop_ref(x, w13, w2, weights, ids)
    for tiles in ("tuned", "default", "tuned", "default"):
        out = moe_measured.moe_measured(x, w13, w2, weights, ids, tiles=tiles)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert [(b, c) for b, _, c in spy.calls] == [("grouped_mm", None),
                                                 ("triton", default_tiles(4))] * 2


@pytest.mark.parametrize("backend", ["triton", "measured"])
def test_the_capacity_report_says_which_tiles_are_in_use(isolated_config_dirs: Path,
                                                         backend: str) -> None:
    from moeserve.config import EngineConfig, SchedulerConfig
    from moeserve.engine import moe_setup

    path = write_tuned(isolated_config_dirs / "env", {1: SMALL, 64: {**SPLIT, "backend":
                                                                     "grouped_mm"}},
                       device="Fake GPU", dtype=torch.float16)
    mc = SimpleNamespace(num_experts=E, hidden_size=H, moe_intermediate_size=N,
                         num_experts_per_tok=K)

    def report(tiles: str) -> dict[str, dict]:
        cfg = EngineConfig(moe_backend=backend, moe_tiles=tiles,
                           scheduler=SchedulerConfig(max_num_batched_tokens=2048))
        return moe_setup.moe_configs(cfg, mc, torch.float16, "Fake GPU", (E, H, N))

    tuned = report("tuned")
    assert all(c["tuned"] and c["source"] == str(path) for c in tuned.values())
    assert tuned["64"]["config"] == SPLIT
    assert tuned["64"]["backend"] == ("grouped_mm" if backend == "measured" else "triton")
    default = report("default")
    assert list(default) == ["1", "64", "256", "1024", "2048"]
    for n, c in default.items():
        config = default_tiles(int(n), torch.float16)
        assert c == {"config": config, "tiles": moe_configs.config_key(config), "tuned": False,
                     "source": "default", "backend": "triton", "tuned_tokens": None}


# ---------------------------------------------------------------- GPU

@pytest.mark.gpu
def test_gpu_measured_in_a_cuda_graph_without_sync() -> None:
    """Both picks at the qwen3-30b-a3b shape: no host sync, graph replay equals eager."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    e, h, i, k = 128, 2048, 768, 8
    w13 = (torch.randn(e, 2 * i, h, device="cuda", generator=gen) * h ** -0.5).bfloat16()
    w2 = (torch.randn(e, h, i, device="cuda", generator=gen) * i ** -0.5).bfloat16()
    device = torch.cuda.get_device_name()
    tmp = Path(moe_configs.tune_dir())
    tmp.mkdir(parents=True, exist_ok=True)
    doc = {"meta": {}, "configs": {
        "64": {**moe_configs.default_moe_config(e, k, 64), "backend": "grouped_mm"},
        "256": {**moe_configs.default_moe_config(e, k, 256), "backend": "triton"}}}
    (tmp / config_file_name(e, h, i, torch.bfloat16, device)).write_text(json.dumps(doc))
    moe_configs.clear_caches()
    for num_tokens in (64, 256):
        x = torch.randn(num_tokens, h, device="cuda", generator=gen).bfloat16()
        weights, ids = select_experts(torch.randn(num_tokens, e, device="cuda", generator=gen),
                                      k, renormalize=True)
        eager = moe_measured.moe_measured(x, w13, w2, weights, ids)  # compile, pick
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            moe_measured.moe_measured(x, w13, w2, weights, ids)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static = moe_measured.moe_measured(x, w13, w2, weights, ids)
        graph.replay()
        torch.testing.assert_close(static, eager)  # bf16 defaults: the same kernels, replayed
        expected = moe_loop_ref(x.float(), w13.float(), w2.float(), weights, ids)
        torch.testing.assert_close(eager.float(), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num_tokens", [1, 64, 1024, 8192])
def test_default_tiles_fit_shared_memory_in_every_dtype(dtype: torch.dtype,
                                                        num_tokens: int) -> None:
    """fp32 at a long prompt once asked for 240 KiB of shared memory (over the H200's 227)."""
    from moeserve.kernels.moe.tile_configs import SHARED_MEMORY_BUDGET, get_moe_config

    c = get_moe_config(8, 64, 32, 2, dtype, num_tokens, "no such device").config
    elem = torch.empty((), dtype=dtype).element_size()
    need = (c["BLOCK_M"] + 2 * c["BLOCK_N"]) * c["BLOCK_K"] * elem * c["num_stages"]
    assert need <= SHARED_MEMORY_BUDGET, c
