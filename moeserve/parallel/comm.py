"""The model's collectives over torch.distributed: what a sharded layer calls.

`TensorParallel` is handed to the model at construction (models.build_model); a layer holding
a shard calls `all_reduce` on its partial sums (after attention's o_proj, after each MLP or
MoE layer: routed and shared experts' partials together) and the LM head `all_gather_last`
on its vocabulary slice. The group is the world: NCCL on GPUs, gloo on CPU. At W = 1 the model
holds no TensorParallel and calls nothing.

NOTE: the collectives are issued on the current stream, so CUDA graphs capture them (NCCL);
that is why a rank that hangs is caught by the engine's step deadline (parallel/watchdog.py),
not by the process group's timeout.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from moeserve import envs
from moeserve.parallel.layout import RankLayout


@dataclass
class TensorParallel:
    """This rank's layout and the process group its shards sum over."""

    layout: RankLayout
    group: dist.ProcessGroup | None = None  # None: the default (world) group
    # (before, after) each collective: the step profile's communication span, or None
    hooks: tuple[Callable[[], None], Callable[[], None]] | None = field(default=None,
                                                                        repr=False)

    @property
    def sums(self) -> bool:
        """Whether the layers' partial sums need the collectives (more than one rank; or a
        test's MOESERVE_COLLECTIVES_AT_ONE_RANK)."""
        return self.layout.world_size > 1 or envs.collectives_at_one_rank()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place; returns x."""
        if self.hooks is not None:
            self.hooks[0]()
        dist.all_reduce(x, group=self.group)
        if self.hooks is not None:
            self.hooks[1]()
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] on each rank -> [..., W * n], rank r's slice at [r * n, (r + 1) * n)."""
        if self.hooks is not None:
            self.hooks[0]()
        parts = [torch.empty_like(x) for _ in range(self.layout.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        if self.hooks is not None:
            self.hooks[1]()
        return torch.cat(parts, dim=-1)
