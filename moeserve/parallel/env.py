"""The environment every rank's process runs with: the rendezvous and the multicast guard.

On the lent multi-GPU hosts NVLink multicast (NCCL's NVLS, torch's symmetric-memory
all-reduce, NVSHMEM's NVLS) can put the host's GPUs out of service, so every worker keeps
NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and NVSHMEM_DISABLE_NVLS=1: set when
absent, never cleared or overridden (a value the operator set stays). No code path in moeserve
asks for multicast or symmetric memory.
"""

from __future__ import annotations

import os
import socket
from collections.abc import MutableMapping

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                "NVSHMEM_DISABLE_NVLS": "1"}


def guard_multicast(env: MutableMapping[str, str] = os.environ) -> None:
    """Set the multicast guard's variables that `env` lacks (see the module doc)."""
    for name, value in NO_MULTICAST.items():
        env.setdefault(name, value)


def rank_env(rank: int, local_rank: int, world_size: int, master_addr: str,
             master_port: int) -> dict[str, str]:
    """The torch.distributed env:// variables of one rank (torchrun's names)."""
    return {"RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(world_size),
            "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port)}


def under_torchrun(env: MutableMapping[str, str] = os.environ) -> bool:
    """Started by torchrun (or another launcher with its env:// variables)."""
    return "RANK" in env and "WORLD_SIZE" in env and "MASTER_ADDR" in env


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on host now (for the rendezvous when --master-port is not given)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
