"""The processes of a node that runs no engine core: `moeserve serve --headless`, and the
ranks > 0 that torchrun starts.

    moeserve serve ... --tp 16 --nnodes 2 --node-rank 1 --master-addr A --master-port P --headless
        spawns this node's ranks (python -m moeserve.parallel.worker, one per local GPU) and
        waits for them; exits with the first non-zero code, or 0 once all end
    torchrun --nnodes 2 --nproc-per-node N ... moeserve serve ... --tp 2N
        the process of RANK 0 serves the API and spawns the engine core (rank 0, which joins
        at env://); every other process is a worker rank itself (`serve_role` says which)

A node's workers die with the process that started them (the headless launcher, or torchrun).
"""

from __future__ import annotations

import os
import signal
import time

from moeserve.config import EngineConfig
from moeserve.parallel.env import under_torchrun

_POLL_S = 0.2


def serve_role(cfg: EngineConfig) -> str:
    """"engine" (API server and engine core), "worker" (a torchrun rank > 0) or "headless"."""
    if under_torchrun() and int(os.environ["RANK"]) != 0:
        return "worker"
    if cfg.parallel.headless:
        if under_torchrun():
            raise ValueError("--headless is for nodes started without torchrun; under torchrun "
                             "every rank > 0 is a worker already")
        return "headless"
    return "engine"


def run_node(cfg: EngineConfig) -> int:
    """Run this process's part as serve_role says (not "engine"); the exit code."""
    from moeserve.parallel.executor import spawn_workers
    from moeserve.parallel.worker import run_rank

    device_type = _device_type(cfg)
    pc = cfg.parallel
    if serve_role(cfg) == "worker":
        run_rank(pc, int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0")),
                 int(os.environ["MASTER_PORT"]), device_type)
        return 0
    assert pc.master_port is not None, "ParallelConfig requires it with nnodes > 1"
    if device_type == "cuda":
        import torch

        from moeserve.parallel.layout import check_devices

        check_devices(pc.ranks_per_node, device_type, torch.cuda.device_count())
    procs = spawn_workers(cfg, pc.node_rank, pc.master_port, skip_local_rank_0=False)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    try:
        while not stop:
            codes = [p.poll() for p in procs]
            failed = [c for c in codes if c not in (None, 0)]
            if failed:
                return failed[0] if failed[0] > 0 else 128 - failed[0]
            if all(c == 0 for c in codes):
                return 0
            time.sleep(_POLL_S)
        return 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()


def _device_type(cfg: EngineConfig) -> str:
    if cfg.device == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return "cuda" if cfg.device.startswith("cuda") else "cpu"
