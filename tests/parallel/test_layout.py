"""The split of the ranks: each rank's shard, the refusals naming the size that does not
divide, the flags (with the peers' --tp), and the watchdog's naming of a failed rank under an
injected clock."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from moeserve.config import ConfigError, ParallelConfig, load_model_config
from moeserve.engine.args import add_engine_args, engine_config_from_kwargs, engine_kwargs_from_args
from moeserve.parallel.env import guard_multicast
from moeserve.parallel.layout import (
    RankLayout,
    check_layout,
    kv_head_start,
    local_experts,
    local_model_config,
    local_vocab,
    quantized_split_breaks,
)
from moeserve.parallel.watchdog import SILENT_AFTER_S, Watchdog


@pytest.fixture(scope="module")
def qwen3_moe():
    """qwen3-30b-a3b's shapes: 32 heads, 4 KV heads, 128 experts of width 768."""
    return load_model_config("qwen3-30b-a3b")[0]


def test_mixed_moe_split_places_each_rank() -> None:
    layouts = [RankLayout(4, r, expert_parallel_size=2) for r in range(4)]
    assert [(lay.ep_rank, lay.moe_tp_rank) for lay in layouts] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [local_experts(128, lay) for lay in layouts] == [(0, 64), (0, 64), (64, 64), (64, 64)]
    assert layouts[0].describe() == ("4 ranks: attention and dense layers TP 4, MoE TP 2 x EP 2")


def test_kv_heads_split_or_replicate() -> None:
    assert [kv_head_start(8, RankLayout(4, r)) for r in range(4)] == [0, 2, 4, 6]
    assert [kv_head_start(2, RankLayout(4, r)) for r in range(4)] == [0, 0, 1, 1]


def test_vocab_rows_cover_the_vocabulary_with_padding_on_the_last_rank() -> None:
    rows = [local_vocab(10, RankLayout(4, r)) for r in range(4)]
    assert rows == [(0, 3), (3, 3), (6, 3), (9, 3)]  # rank 3 holds row 9 and two padding rows


def test_local_config_divides_heads_and_widths(qwen3_moe) -> None:
    mc = qwen3_moe
    local = local_model_config(mc, RankLayout(4, 1, expert_parallel_size=2))
    assert (local.num_heads, local.num_kv_heads) == (8, 1)
    assert local.moe_intermediate_size == mc.moe_intermediate_size // 2
    assert local.num_experts == mc.num_experts  # the router sees every expert
    assert local_model_config(mc, RankLayout()) is mc


@pytest.mark.parametrize("layout, change, named", [
    (RankLayout(3), {}, "num_attention_heads"),
    (RankLayout(8, expert_parallel_size=8), {"num_experts": 12}, "n_routed_experts"),
    (RankLayout(4, expert_parallel_size=2), {"moe_intermediate_size": 9},
     "moe_intermediate_size"),
    (RankLayout(8), {"num_kv_heads": 3, "num_heads": 24}, "num_key_value_heads"),
])
def test_a_split_that_does_not_divide_names_the_size(qwen3_moe, layout, change, named) -> None:
    with pytest.raises(ConfigError, match=named):
        check_layout(dataclasses.replace(qwen3_moe, **change), layout)


def test_parallel_config_refusals() -> None:
    with pytest.raises(ConfigError, match="expert_parallel_size 3 must divide"):
        ParallelConfig(tensor_parallel_size=4, expert_parallel_size=3)
    with pytest.raises(ConfigError, match="nnodes"):
        ParallelConfig(tensor_parallel_size=3, nnodes=2, master_port=1)
    with pytest.raises(ConfigError, match="master-port"):
        ParallelConfig(tensor_parallel_size=4, nnodes=2)
    with pytest.raises(ConfigError, match="--headless is for node_rank >= 1"):
        ParallelConfig(tensor_parallel_size=4, nnodes=2, master_port=1, headless=True)
    with pytest.raises(ConfigError, match="--headless is for node_rank >= 1"):
        ParallelConfig(tensor_parallel_size=2, headless=True)  # one node: no engine anywhere
    assert ParallelConfig(tensor_parallel_size=4, enable_expert_parallel=True).ep_size == 4
    assert ParallelConfig(tensor_parallel_size=4).ep_size == 1


def test_flags_with_the_peers_names() -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--tp", "4", "--enable-expert-parallel", "--nnodes", "2",
                              "--node-rank", "1", "--master-port", "29500", "--headless"])
    pc = engine_config_from_kwargs(**engine_kwargs_from_args(args)).parallel
    assert (pc.tensor_parallel_size, pc.ep_size, pc.ranks_per_node) == (4, 4, 2)
    assert pc.headless and pc.node_rank == 1


def test_the_guard_sets_what_is_absent_and_keeps_what_is_set() -> None:
    env = {"NCCL_NVLS_ENABLE": "0"}
    guard_multicast(env)
    assert env == {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                   "NVSHMEM_DISABLE_NVLS": "1"}


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _watchdog(beats: dict[int, str | None], clock: _Clock, fired: list) -> Watchdog:
    return Watchdog(beats.get, 3, timeout_s=5.0, on_fire=fired.append, clock=clock)


def test_watchdog_names_the_rank_that_stopped_beating() -> None:
    clock, fired = _Clock(), []
    beats = {1: "1 10", 2: "1 10"}
    dog = _watchdog(beats, clock, fired)
    dog.begin("launch")
    for t in range(1, 8):  # rank 2 beats on, rank 1 does not
        clock.now = float(t)
        beats[2] = f"{t + 1} 10"
        dog.check()
    assert clock.now - 0.0 > SILENT_AFTER_S
    assert fired == ["rank 1 stopped beating (dead, stopped or cut off): launch ran past the "
                     "step deadline of 5 s (step_timeout_s)"]
    dog.check()
    assert len(fired) == 1  # once


def test_watchdog_names_the_rank_behind_in_steps_and_is_quiet_in_time() -> None:
    clock, fired = _Clock(), []
    beats = {1: "1 7", 2: "1 6"}
    dog = _watchdog(beats, clock, fired)
    dog.begin("execute")
    for t in range(1, 5):
        clock.now = float(t)
        beats = {1: f"{t + 1} 7", 2: f"{t + 1} 6"}
        dog.read_beat = beats.get
        assert dog.check() is None  # within the deadline
    dog.end()
    clock.now = 100.0
    assert dog.check() is None  # no call in flight: nothing to time
    dog.begin("execute")
    clock.now = 106.0
    beats = {1: "9 7", 2: "9 6"}
    dog.read_beat = beats.get
    assert dog.check().startswith("rank 2 did not finish its step")


def test_splits_that_cut_quantized_groups_are_named(qwen3_moe) -> None:
    """Only column (K) cuts count: the in-memory layout has a scale row per weight row."""
    from moeserve.quant.spec import QuantSpec

    fp8 = dataclasses.replace(qwen3_moe, quantization=QuantSpec("fp8", block=(128, 128)))
    assert quantized_split_breaks(fp8, RankLayout(2)) == []  # 768 / 2 = 384: three groups
    assert [b.suffix for b in quantized_split_breaks(fp8, RankLayout(4))] == [".mlp.w2"]
    breaks = quantized_split_breaks(fp8, RankLayout(8))  # 768 / 8 = 96 columns an expert
    assert [b.line("fp8", 128) for b in breaks] == [
        "each expert's down_proj: 96 columns a rank cut the fp8 groups of 128"]
    assert quantized_split_breaks(fp8, RankLayout(8, expert_parallel_size=8)) == []  # EP: whole
    nvfp4 = dataclasses.replace(qwen3_moe, quantization=QuantSpec("nvfp4", group_size=16))
    assert quantized_split_breaks(nvfp4, RankLayout(8)) == []  # K splits of 96: 6 groups
    assert quantized_split_breaks(qwen3_moe, RankLayout(8)) == []  # not quantized


def test_a_node_needs_a_gpu_per_rank() -> None:
    from moeserve.parallel.layout import check_devices

    check_devices(8, "cuda", 8)
    check_devices(4, "cpu", 0)  # gloo ranks on CPU
    with pytest.raises(ConfigError, match="8 ranks a node .* need 8 GPUs on each node; this "
                                          "one has 1"):
        check_devices(8, "cuda", 1)


def test_watchdog_waits_to_tell_a_rank_stopped_just_now_from_rank_0() -> None:
    clock, fired = _Clock(), []
    beats = {1: "1 4", 2: "1 4"}
    dog = _watchdog(beats, clock, fired)
    dog.begin("launch")
    for t in (1.0, 2.0, 3.0, 4.0, 5.0):  # both beat until 4 s; rank 1 stops then
        clock.now = t
        beats = {1: f"{int(t) + 1} 4" if t < 4 else "5 4", 2: f"{int(t) + 1} 4"}
        dog.read_beat = beats.get
        dog.check()
    clock.now = 5.5  # past the 5 s deadline, rank 1 silent for 1.5 s only: not named yet
    beats = {1: "5 4", 2: "7 4"}
    dog.read_beat = beats.get
    assert dog.check() is None and not fired
    clock.now = 4.0 + SILENT_AFTER_S + 0.5
    beats = {1: "5 4", 2: "9 4"}
    dog.read_beat = beats.get
    assert dog.check().startswith("rank 1 stopped beating")
