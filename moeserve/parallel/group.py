"""Joining the ranks: torch.distributed's process groups for one rank of the engine.

    model group    the world: the layers' all-reduce / all-gather (NCCL on CUDA, gloo on CPU)
    control group  gloo over the same ranks: rank 0's calls and step plans (pickled objects)
    store          the rendezvous' TCP store: each rank's heartbeat (parallel/watchdog.py)

Started by moeserve itself the ranks meet at tcp://master_addr:master_port; under torchrun
(RANK, WORLD_SIZE, MASTER_ADDR set) at env://, which also reuses the torchrun agent's store.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moeserve.config import ConfigError, ParallelConfig
from moeserve.parallel.comm import TensorParallel
from moeserve.parallel.env import guard_multicast, under_torchrun
from moeserve.parallel.layout import RankLayout

# slack over the step deadline for the groups' own timeout: the engine's watchdog names the
# rank first; the groups' timeout only ends a wait the watchdog could not
_GROUP_TIMEOUT_SLACK_S = 60.0


@dataclass
class RankGroups:
    """One rank's membership: its layout, the model's collectives, the control group."""

    tp: TensorParallel
    control: dist.ProcessGroup
    store: dist.Store
    local_rank: int

    @property
    def rank(self) -> int:
        return self.tp.layout.rank


def join(pc: ParallelConfig, rank: int, local_rank: int, master_port: int,
         device_type: str) -> RankGroups:
    """Join the world as `rank` (blocks until every rank has joined)."""
    guard_multicast()
    world = pc.tensor_parallel_size
    timeout = datetime.timedelta(seconds=pc.step_timeout_s + _GROUP_TIMEOUT_SLACK_S)
    backend = "nccl" if device_type == "cuda" else "gloo"
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
    if under_torchrun():
        if int(os.environ["WORLD_SIZE"]) != world:
            raise ConfigError(f"torchrun started {os.environ['WORLD_SIZE']} processes but "
                              f"tensor_parallel_size is {world}: they must agree")
        dist.init_process_group(backend, init_method="env://", timeout=timeout)
    else:
        dist.init_process_group(backend, init_method=f"tcp://{pc.master_addr}:{master_port}",
                                rank=rank, world_size=world, timeout=timeout)
    control = dist.new_group(backend="gloo", timeout=timeout)
    layout = RankLayout(world, dist.get_rank(), pc.ep_size)
    store = dist.distributed_c10d._get_default_store()
    return RankGroups(TensorParallel(layout), control, store, local_rank)


def leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
