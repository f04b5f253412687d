"""A worker rank: join the world, build this rank's shard, run rank 0's calls until shutdown.

    python -m moeserve.parallel.worker --rank R --local-rank L --master-port P \
        --parallel '<ParallelConfig as JSON>' [--parent PID]

is how the engine (rank 0) and `moeserve serve --headless` start a node's other ranks; under
torchrun a process of RANK > 0 calls `run_rank` itself. The first call from rank 0 is "init"
with the engine's resolved config, so every rank builds its runner from the same values; then
each message on the control group is (runner method, args, kwargs): the start-up's memory
profile and plan, the KV allocation, warm-up, graph capture, and each step's `launch` /
`execute` with the scheduler's plan. A worker resolves each launched step when rank 0 launches
the next (the same overlap as rank 0), publishes its steps done in its heartbeat, and returns
results only for the calls rank 0 gathers (`GATHERED`). It dies with its parent engine.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
import logging
import os
import signal
import sys

import torch
import torch.distributed as dist

from moeserve.config import EngineConfig, ParallelConfig, load_model_config
from moeserve.parallel.group import RankGroups, join, leave
from moeserve.parallel.plan_codec import PLAN_CALLS, PlanDecoder
from moeserve.parallel.watchdog import Heartbeat

logger = logging.getLogger("moeserve.parallel")

# runner calls whose results rank 0 gathers from every rank, and how it combines them
GATHERED = ("profile_activation_peak", "plan_memory")
SHUTDOWN = "shutdown"
_PR_SET_PDEATHSIG = 1


def receive(control: dist.ProcessGroup) -> tuple[str, tuple, dict]:
    box: list = [None]
    dist.broadcast_object_list(box, src=0, group=control)
    return box[0]


def run_rank(pc: ParallelConfig, rank: int, local_rank: int, master_port: int,
             device_type: str) -> None:
    """A worker's whole life (see the module doc); returns at rank 0's shutdown."""
    groups = join(pc, rank, local_rank, master_port, device_type)
    beat = Heartbeat(groups.store, groups.rank).start()
    try:
        name, args, _ = receive(groups.control)
        assert name == "init", f"rank {groups.rank}: first call {name!r}, expected 'init'"
        runner = _build_runner(args[0], groups)
        serve_calls(runner, groups, beat)
    finally:
        beat.stop()
        leave()


def _build_runner(cfg: EngineConfig, groups: RankGroups):
    from moeserve.runner.model_runner import ModelRunner

    if cfg.torch_threads != "auto":
        torch.set_num_threads(int(cfg.torch_threads))
    model_config, preset = load_model_config(cfg.model, cfg.hf_overrides)
    return ModelRunner(rank_config(cfg, groups.local_rank), model_config,
                       None if preset else cfg.model, tp=groups.tp)


def rank_config(cfg: EngineConfig, local_rank: int) -> EngineConfig:
    """The engine config as a rank runs it: on CUDA, device cuda:<local rank>."""
    if cfg.device.startswith("cuda"):
        return dataclasses.replace(cfg, device=f"cuda:{local_rank}")
    return cfg


def serve_calls(runner, groups: RankGroups, beat: Heartbeat) -> None:
    """Run rank 0's calls in order until SHUTDOWN."""
    pending = None
    plans = PlanDecoder()
    while True:
        name, args, kwargs = receive(groups.control)
        if name in PLAN_CALLS:
            args = (plans.decode(*args),)
        if name != "launch" and pending is not None:
            pending.result()
            pending, beat.steps = None, beat.steps + 1
        if name == SHUTDOWN:
            return
        result = getattr(runner, name)(*args, **kwargs)
        if name == "launch":
            if pending is not None:  # the previous step: done once this one is queued
                pending.result()
                beat.steps += 1
            pending = result
        elif name == "execute":
            beat.steps += 1
        if name in GATHERED:
            dist.gather_object(result, None, dst=0, group=groups.control)


def _die_with_parent(parent: int) -> None:
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        raise SystemExit(1)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m moeserve.parallel.worker")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--local-rank", type=int, required=True)
    parser.add_argument("--master-port", type=int, required=True)
    parser.add_argument("--parallel", required=True, help="ParallelConfig fields as JSON")
    parser.add_argument("--device-type", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--parent", type=int, default=None, help="die when this pid dies")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"[rank {args.rank}] %(message)s")
    if args.parent is not None:
        _die_with_parent(args.parent)
    pc = ParallelConfig(**json.loads(args.parallel))
    run_rank(pc, args.rank, args.local_rank, args.master_port, args.device_type)


if __name__ == "__main__":
    main()
