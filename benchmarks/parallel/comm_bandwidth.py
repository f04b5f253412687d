"""The collectives' bandwidth on this machine (issue 20: measured before the multi-GPU
benchmarks, so that the rooflines use the machine's rate, not docs/parallel.md's assumed 360
GB/s): all-reduce, all-gather and all-to-all over W ranks, at powers-of-four sizes and at the
messages the served models send.

One process a rank (torch.multiprocessing, spawn; NCCL on GPUs, gloo on CPU), every process
with the NVLink-multicast guard (parallel/env.py). Each op and size: `--warmup` untimed calls,
then `--iters` timed back to back (CUDA events on the GPU, the host clock on CPU), the time the
slowest rank's. Reported as nccl-tests does:

    algbw = size / time          size: the tensor each rank holds (all-gather: its output)
    busbw = algbw x factor       all-reduce 2 (W - 1) / W (a ring sends and receives that),
                                 all-gather and all-to-all (W - 1) / W

The model messages: the all-reduce after each attention and MoE layer, S = rows x hidden x 2
bytes (bf16), for each preset of `--models` at `--rows` decode rows; each row of the report
gives the time at that size and the step's share (2 S a layer, every layer, and the embedding's).

    python -m benchmarks.parallel.comm_bandwidth --out DIR [--world 8]      # every GPU by default
    python -m benchmarks.parallel.comm_bandwidth --out DIR --cpu --world 2  # gloo (tests, no GPU)
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moeserve.parallel.env import free_port, guard_multicast

OPS = ("all_reduce", "all_gather", "all_to_all")
SIZES_MIB = (0.0625, 0.25, 1, 4, 16, 64, 256)
MODELS, ROWS = ("qwen3-30b-a3b", "glm-5", "deepseek-v3"), (256, 1024, 2048)


def bus_factor(op: str, world: int) -> float:
    """busbw / algbw for `op` over `world` ranks (the module doc)."""
    if op == "all_reduce":
        return 2 * (world - 1) / world
    if op in ("all_gather", "all_to_all"):
        return (world - 1) / world
    raise ValueError(f"unknown collective {op!r} (known: {', '.join(OPS)})")


def model_messages(models: list[str], rows: list[int]) -> list[dict[str, Any]]:
    """The per-layer all-reduce of each model at each row count: its bytes and the step's
    count of them (2 a layer, and the embedding's)."""
    from moeserve.config import load_model_config

    out = []
    for name in models:
        mc = load_model_config(name)[0]
        for n in rows:
            out.append({"model": name, "rows": n, "bytes": n * mc.hidden_size * 2,
                        "per_step": 2 * mc.num_layers + 1})
    return out


def _run_op(op: str, nbytes: int, world: int, device: torch.device, dtype: torch.dtype,
            warmup: int, iters: int) -> float:
    """Seconds one call of `op` on a tensor of nbytes takes, the slowest rank's."""
    elems = max(world, nbytes // torch.empty((), dtype=dtype).element_size())
    elems -= elems % world  # all-gather's output and all-to-all split into W equal parts
    if op == "all_gather":
        out = torch.empty(elems, dtype=dtype, device=device)
        inp = torch.ones(elems // world, dtype=dtype, device=device)

        def call() -> None:
            dist.all_gather_into_tensor(out, inp)
    elif op == "all_to_all":
        inp = torch.ones(elems, dtype=dtype, device=device)
        out = torch.empty_like(inp)

        def call() -> None:
            dist.all_to_all_single(out, inp)
    else:
        buf = torch.ones(elems, dtype=dtype, device=device)

        def call() -> None:
            dist.all_reduce(buf)
    for _ in range(warmup):
        call()
    dist.barrier()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            call()
        end.record()
        end.synchronize()
        seconds = start.elapsed_time(end) / 1e3 / iters
    else:
        t = time.perf_counter()
        for _ in range(iters):
            call()
        seconds = (time.perf_counter() - t) / iters
    slowest = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return float(slowest.item())


def _rank(rank: int, world: int, port: int, cfg: dict[str, Any]) -> None:
    """One rank: join, run every op at every size, rank 0 writes the JSON."""
    guard_multicast()
    cuda = not cfg["cpu"]
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world)
    device = torch.device(f"cuda:{rank}" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    try:
        sizes = sorted({int(m * 2 ** 20) for m in cfg["sizes_mib"]}
                       | {m["bytes"] for m in cfg["messages"]})
        rows = []
        for op in cfg["ops"]:
            for nbytes in sizes:
                s = _run_op(op, nbytes, world, device, dtype, cfg["warmup"], cfg["iters"])
                algbw = nbytes / s / 1e9
                rows.append({"op": op, "bytes": nbytes, "us": round(s * 1e6, 2),
                             "algbw_gb_s": round(algbw, 2),
                             "busbw_gb_s": round(algbw * bus_factor(op, world), 2)})
                if rank == 0:
                    print(json.dumps(rows[-1]), flush=True)
        if rank == 0:
            _write(cfg, world, rows, str(dtype))
    finally:
        dist.destroy_process_group()


def _write(cfg: dict[str, Any], world: int, rows: list[dict], dtype: str) -> None:
    """The JSON: every op's rows, and each model message's all-reduce time and step share."""
    from benchmarks.engine.w1_offline import environment

    reduce = {r["bytes"]: r for r in rows if r["op"] == "all_reduce"}
    messages = []
    for m in cfg["messages"]:
        r = reduce.get(m["bytes"])
        if r is not None:
            messages.append({**m, "all_reduce_us": r["us"], "busbw_gb_s": r["busbw_gb_s"],
                             "step_ms": round(r["us"] * m["per_step"] / 1e3, 3)})
    result = {"environment": environment(), "world": world, "dtype": dtype,
              "config": {k: v for k, v in cfg.items() if k != "messages"},
              "collectives": rows, "model_messages": messages}
    os.makedirs(cfg["out"], exist_ok=True)
    path = os.path.join(cfg["out"], "comm_bandwidth.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory for comm_bandwidth.json")
    parser.add_argument("--world", type=int, default=None,
                        help="ranks (default: every GPU; 2 with --cpu)")
    parser.add_argument("--cpu", action="store_true", help="gloo on CPU (no GPU needed)")
    parser.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS))
    parser.add_argument("--sizes-mib", type=float, nargs="+", default=list(SIZES_MIB))
    parser.add_argument("--models", nargs="*", default=list(MODELS),
                        help="presets whose per-layer all-reduce is measured at --rows")
    parser.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args(argv)
    world = args.world or (2 if args.cpu else torch.cuda.device_count())
    if world < 2:
        raise SystemExit(f"comm_bandwidth needs at least 2 ranks, got {world} (--world, or "
                         "--cpu for gloo)")
    if not args.cpu and world > torch.cuda.device_count():
        raise SystemExit(f"--world {world}: this machine has {torch.cuda.device_count()} GPUs")
    cfg = {**vars(args), "world": world, "messages": model_messages(args.models, args.rows)}
    mp.start_processes(_rank, args=(world, free_port(), cfg), nprocs=world, join=True,
                       start_method="spawn")


if __name__ == "__main__":
    main()
