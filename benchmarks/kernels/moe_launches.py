"""The fused MoE's two launches timed apart, per tile config: would each launch want its own?

`moe_triton` runs `_fused_moe_kernel` twice with one BLOCK_M: the gated launch (x @ w13,
SiLU-mul; N = I, two accumulators) and the down launch (act @ w2, weighted; N = H, one
accumulator). Their best tiles may differ (the gated one holds twice the accumulator), which a
config's "down" tiles allow (kernels/moe/tile_configs.py) and the tuner now searches. For each
token count and BLOCK_M this times, inside CUDA graphs: the align, each launch under every
candidate (BLOCK_N, BLOCK_K, num_warps, num_stages), and the reduce over k; then it sets the
committed config's total beside the best split total. Dummy routing (random logits, top-k).
Stops at --deadline-s and writes what it has.

    python -m benchmarks.kernels.moe_launches --tokens 1024 2048 --out DIR     # GPU
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from pathlib import Path

import torch

from benchmarks.engine.w1_offline import environment
from benchmarks.kernels.kernels_moe import expert_shape, router_logits
from moeserve.kernels.moe.align import moe_align_block_size_triton
from moeserve.kernels.moe.fused_triton import _launch
from moeserve.kernels.moe.tile_configs import get_moe_config, tile_config
from moeserve.kernels.moe.timer import time_in_graph
from moeserve.kernels.routing.select import select_experts

# (BLOCK_N, BLOCK_K, num_warps, num_stages)
CANDIDATES = [(64, 64, 4, 4), (64, 128, 4, 3), (128, 64, 4, 4), (128, 64, 8, 3),
              (128, 128, 8, 3), (256, 64, 8, 3)]
COPY_TBPS = 4.27


def block_ms_for(tokens: int, experts: int, top_k: int) -> list[int]:
    per_expert = tokens * top_k / experts
    return [m for m in (32, 64, 128) if per_expert / 4 <= m <= 2 * per_expert]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="qwen3-30b-a3b")
    p.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048])
    p.add_argument("--deadline-s", type=float, default=240.0)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    t0 = time.monotonic()
    experts, hidden, inter, top_k = expert_shape(a.preset)
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13 = torch.randn(experts, 2 * inter, hidden, device="cuda", generator=gen).to(
        torch.bfloat16) * 0.02
    w2 = torch.randn(experts, hidden, inter, device="cuda", generator=gen).to(
        torch.bfloat16) * 0.02
    bound_ms = experts * 3 * hidden * inter * 2 / (COPY_TBPS * 1e12) * 1e3
    result = {"environment": environment(), "preset": a.preset, "read_bound_ms": bound_ms,
              "candidates": CANDIDATES, "tokens": {}}
    out = Path(a.out) / f"moe_launches_{a.preset}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    for tokens in a.tokens:
        x = torch.randn(tokens, hidden, device="cuda", generator=gen).to(torch.bfloat16)
        weights, ids = select_experts(router_logits("dummy", tokens, experts, seed=tokens),
                                      top_k, renormalize=True)
        pairs = tokens * top_k
        act = x.new_empty(pairs, inter)
        y = x.new_empty(pairs, hidden)
        committed = get_moe_config(experts, hidden, inter, top_k, torch.bfloat16, tokens,
                                   torch.cuda.get_device_name())
        entry: dict = {"committed": committed.config, "by_block_m": {}}
        reduce_ms = time_in_graph(functools.partial(torch.sum, y.view(tokens, top_k, hidden),
                                                    dim=1))
        entry["reduce_ms"] = reduce_ms
        for block_m in sorted(set(block_ms_for(tokens, experts, top_k))
                              | {committed.config["BLOCK_M"]}):
            sorted_ids, expert_ids, post_padded = moe_align_block_size_triton(ids, experts,
                                                                              block_m)
            align_ms = time_in_graph(functools.partial(moe_align_block_size_triton, ids,
                                                       experts, block_m))
            rows: list[dict] = []
            for n, k, warps, stages in CANDIDATES:
                if time.monotonic() - t0 > a.deadline_s:
                    entry["stopped"] = "deadline"
                    break
                cfg = tile_config(block_m, n, k, 8 if block_m > 16 else 1, warps, stages)
                row = {"config": cfg}
                for name, gated, src, dst in (("gated", True, x, act), ("down", False, act, y)):
                    launch = functools.partial(
                        _launch, src, w13 if gated else w2, dst, weights, sorted_ids,
                        expert_ids, post_padded, pairs, cfg,
                        a_row_div=top_k if gated else 1, c_row_div=1, gated=gated, atomic=False)
                    try:
                        row[f"{name}_ms"] = time_in_graph(launch)
                    except Exception as e:  # out of shared memory / registers: skip the tile
                        row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:160]}"
                rows.append(row)
            best = {}
            for name in ("gated", "down"):
                ok = [r for r in rows if f"{name}_ms" in r]
                if ok:
                    b = min(ok, key=lambda r: r[f"{name}_ms"])
                    best[name] = {"config": b["config"], "ms": b[f"{name}_ms"]}
            same = [r for r in rows if "gated_ms" in r and "down_ms" in r]
            one = min(same, key=lambda r: r["gated_ms"] + r["down_ms"]) if same else None
            split_total = (align_ms + best["gated"]["ms"] + best["down"]["ms"] + reduce_ms
                           if len(best) == 2 else None)
            one_total = (align_ms + one["gated_ms"] + one["down_ms"] + reduce_ms
                         if one else None)
            entry["by_block_m"][str(block_m)] = {
                "align_ms": align_ms, "rows": rows, "best_split": best,
                "best_shared": one, "split_total_ms": split_total, "shared_total_ms": one_total,
                "split_pct_of_read_bound": (100 * bound_ms / split_total
                                            if split_total else None)}
            print(f"tokens {tokens} BLOCK_M {block_m}: align {align_ms:.3f} ms, shared best "
                  f"{one_total and round(one_total, 4)} ms, split best "
                  f"{split_total and round(split_total, 4)} ms "
                  f"(read bound {bound_ms:.3f} ms)", flush=True)
        result["tokens"][str(tokens)] = entry
        out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
