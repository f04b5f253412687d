"""The absorbed MLA decode kernel (kernels/attention/mla/) on the GPU against its bound
(issue 16): max(read bound, FLOP bound), per case.

Shape: DeepSeek / GLM latent (kv_lora_rank L 512 + rope R 64 = 576 values a cached token, bf16:
1,152 bytes a token a layer), the query heads of GLM-4.7-Flash (20), GLM-5 (64) and
DeepSeek-V3 (128). Each case is one decode step of `batch` rows at the given context (every
row's keys in blocks scattered over one pool, as a long-running server's are), or W1's:
contexts drawn from 129..256 (128 prompt tokens, up to 128 generated; mean about 192).

    read bound   = batch x context x 1,152 B / 4.27 TB/s           (the latent cache, once)
    FLOP bound   = 2 x heads x (576 + 512) x batch x context / 787 TFLOP/s
                   (the score dot over L + R, the value dot over L)
    bound        = max of the two; pct_of_bound = 100 x bound / measured

Each case is first checked against `mla_attention_ref` on its first rows (a small step with
the same heads and contexts), then timed with triton.testing.do_bench (--l2-flush read: the
same with an L2 flush that reads, kernel_runs.read_flushed_bench): the whole op (decode
kernel, and the split reduce when the context is split). Writes kernels_mla.json to --out
after each case (a run cut short keeps what it measured).

    python -m benchmarks.kernels.mla.kernels_mla --out DIR [--heads 20 64 128] [--block-size 16]
    python -m benchmarks.kernels.mla.kernels_mla --out DIR --smoke   # tiny shapes, CPU interpreter
    python -m benchmarks.kernels.mla.kernels_mla --out DIR --tiles 16,64,4,2 32,32,8,2
        # each case at each tile
    python -m benchmarks.kernels.mla.kernels_mla --out DIR --few-rows   # 4-128 rows instead
    python -m benchmarks.kernels.mla.kernels_mla --out DIR --crossover   # 384-1,536 keys instead
    python -m benchmarks.kernels.mla.kernels_mla --out DIR --forms split flat gluon gluon-overlap
        # each case in each decode form (absorbed_triton's split, decode_flat_triton's flat,
        # decode_gluon's wgmma kernel, without and with its overlap: its keys a tile and
        # stages from --tiles' BN and S; gluon-swapped, decode_gluon_swapped's (keys as
        # wgmma's M), at most 32 heads; gluon-ws, decode_gluon_ws's (warp-specialized: one
        # warpgroup the scores, the other half of P V; gluon-ws2: two P V warpgroups, O's
        # halves, beside a scores warpgroup doing no P V); a "-vec" suffix on a Gluon form: with
        # decode_gluon.vector_stores, the outputs stored in 16-byte vectors)
"""

from __future__ import annotations

import argparse
import dataclasses
import os

import numpy as np
import torch

from benchmarks.kernels.kernel_runs import (
    L2_FLUSHES,
    SMOKE_HELP,
    Timer,
    device_ceilings,
    make_timer,
    record,
    run_device,
)
from moeserve.kernels.attention import metadata
from moeserve.kernels.attention.metadata import AttentionMetadata, build_attention_metadata

# neither imports triton (the kernels do on first use, after --smoke set the interpreter)
from moeserve.kernels.attention.mla import absorbed_triton as mla_triton
from moeserve.kernels.attention.mla import decode_gluon, decode_gluon_swapped, reduce_triton
from moeserve.kernels.attention.mla.decode_gluon_swapped import SWAPPED_HEADS
from moeserve.kernels.attention.mla.reference import mla_attention_ref
from moeserve.kernels.attention.paged import FP8_CACHE_DTYPES, to_cache_dtype

LATENT, ROPE = 512, 64  # kv_lora_rank, qk_rope_head_dim (DeepSeek-V3, GLM-4.7-Flash, GLM-5)
SCALE = (128 + 64) ** -0.5  # (qk_nope_head_dim + qk_rope_head_dim) ** -0.5
# ANCHORS.md: the H200's copy rate, bf16 dense peak; main() takes its GPU's (device_ceilings)
COPY_TBPS, DENSE_TFLOPS = 4.27, 787.0
HEADS = (20, 64, 128)
# (name, batch, context): a fixed context, or "w1" (contexts drawn from 129..256)
CASES = tuple((f"b{b}_ctx{c}", b, c) for b in (256, 1024, 2048) for c in (1024, 4096)) + (
    ("w1_b1024", 1024, "w1"), ("w1_b2048", 2048, "w1"))
# --few-rows: steps of few rows (latency-bound serving, long contexts), where "auto" once took
# the flat decode
FEW_ROW_CASES = (("b4_ctx16384", 4, 16384), ("b32_ctx4096", 32, 4096),
                 ("b64_ctx8192", 64, 8192), ("b128_ctx2048", 128, 2048))
# --crossover: contexts between W1's and 1k, where decode_gluon_ws overtakes decode_gluon
# (decode_gluon.WS_SHORT_CONTEXT: the decode graphs' bound between them)
CROSSOVER_CASES = tuple((f"b{b}_ctx{c}", b, c) for b in (256, 1024, 2048)
                        for c in (384, 512, 768, 1536))
SMOKE_CASES = (("b3_ctx40", 3, 40), ("w1_b4", 4, "w1"))
CHECK_ROWS = 8  # rows of the small step each case is checked on
GLUON_FORMS = ("gluon", "gluon-overlap", "gluon-swapped", "gluon-ws", "gluon-ws2")


def contexts(batch: int, context: int | str, seed: int = 0) -> list[int]:
    """Each row's context (its cached tokens, this step's one included)."""
    if context == "w1":
        return np.random.default_rng(seed).integers(129, 257, batch).tolist()
    return [int(context)] * batch


def make_step(ctx: list[int], heads: int, latent: int, rope: int, block: int, device: str,
              dtype: torch.dtype, seed: int = 0, cache_dtype: torch.dtype | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """(q [B, H, L + R], latent cache [blocks, block, L + R], metadata) for one decode step:
    each row's blocks drawn without replacement from a shuffled pool (block 0, the null
    block, never). cache_dtype: the cache's type when not q's (float8 e4m3, the engine's
    kv_cache_dtype="fp8")."""
    rng = np.random.default_rng(seed)
    need = [-(-c // block) for c in ctx]
    free = rng.permutation(np.arange(1, sum(need) + 1))
    bounds = np.cumsum([0, *need])
    tables = [free[bounds[i]:bounds[i + 1]].tolist() for i in range(len(ctx))]
    meta = build_attention_metadata([c - 1 for c in ctx], [1] * len(ctx), tables, block, device)
    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(len(ctx), heads, latent + rope, generator=gen, device=device).to(dtype)
    cache = to_cache_dtype(torch.randn(sum(need) + 1, block, latent + rope, generator=gen,
                                       device=device).to(dtype), cache_dtype or dtype)
    return q, cache, meta


def bounds(ctx: list[int], heads: int, latent: int, rope: int, itemsize: int) -> dict:
    """The case's read and FLOP bounds in ms (module doc)."""
    tokens = sum(ctx)
    read_ms = tokens * (latent + rope) * itemsize / (COPY_TBPS * 1e12) * 1e3
    flops = 2 * heads * (latent + rope + latent) * tokens
    flop_ms = flops / (DENSE_TFLOPS * 1e12) * 1e3
    return {"read_bound_ms": read_ms, "flop_bound_ms": flop_ms, "flops": flops,
            "bound_ms": max(read_ms, flop_ms),
            "bound": "memory" if read_ms >= flop_ms else "compute"}


def check(ctx: list[int], heads: int, latent: int, rope: int, block: int, device: str,
          dtype: torch.dtype, cfg: mla_triton.TileConfig, form: str,
          cache_dtype: torch.dtype | None = None) -> float:
    """The kernel against `mla_attention_ref` on a small step of this case's first rows: the
    largest error relative to the output's scale (raises past the dtype's bound)."""
    q, cache, meta = make_step(ctx[:CHECK_ROWS], heads, latent, rope, block, device, dtype, 1,
                               cache_dtype)
    got = decode_op(q, cache, meta, latent, cfg, form)().float()
    want = mla_attention_ref(q.float(), cache.float(), meta, SCALE, latent).float()
    err = float((got - want).abs().max() / want.abs().max().clamp(min=1e-30))
    bound = 1e-5 if dtype == torch.float32 else 2 ** -6
    if not err <= bound:
        raise SystemExit(f"MLA decode ({form}, {cfg}) differs from the reference: {err:.3g} of the "
                         f"output scale (bound {bound:g})")
    return err


# decode_gluon.decode_kernel's names -> this benchmark's form for the kernel a served step runs
SERVED_GLUON = {"swapped": "gluon-swapped", "ws": "gluon-ws", "gluon": "gluon"}
# form suffixes: (suffix, decode_gluon's module switch, its value while timed)
SWITCHES = (("-vec", "vector_stores", True), ("-lf", "longest_first", True),
            ("-so", "longest_first", False))


def decode_op(q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, latent: int,
              cfg: mla_triton.TileConfig | None, form: str):
    """The decode step as a call: mla_attention_triton in `form`, or ("gluon", "gluon-overlap")
    decode_gluon at cfg's keys a tile and stages, or its swapped variant ("-vec": with
    decode_gluon.vector_stores; "-lf" / "-so": decode_gluon.longest_first on / off, rows
    longest context first / in step order). "auto": what a
    served step runs, mla_attention_triton's own pick (on sm90 decode_gluon.decode_gluon's
    dispatch: the swapped kernel to 32 heads, the warp-specialized one past 1,024 keys) when
    cfg is None; a Triton tile given to "auto" forces absorbed_triton's split or flat kernel
    (as every "auto" row measured before session 57)."""
    for suffix, switch, value in SWITCHES:
        if form.endswith(suffix):
            return _switched(decode_op(q, cache, meta, latent, cfg, form.removesuffix(suffix)),
                             switch, value)
    if not form.startswith("gluon"):
        return lambda: mla_triton.mla_attention_triton(q, cache, meta, SCALE, latent,
                                                       decode_config=cfg, decode_form=form)

    def gluon() -> torch.Tensor:
        out = q.new_empty(*q.shape[:2], latent)
        # the kernels called directly take decode_gluon.decode_gluon's row order
        rows = metadata.longest_first(meta, None) if decode_gluon.longest_first else None
        if form == "gluon-swapped":  # decode_gluon_swapped.py, its own tile
            from moeserve.kernels.attention.mla.decode_gluon_swapped import decode_swapped
            decode_swapped(q, cache, meta, SCALE, latent, out, rows, meta.num_reqs,
                           meta.max_seq_len)
            return out
        if form.startswith("gluon-ws"):  # decode_gluon_ws.py, its own tile
            from moeserve.kernels.attention.mla import decode_gluon_ws as ws
            was, ws.two_pv = ws.two_pv, form == "gluon-ws2"
            try:
                ws.decode_ws(q, cache, meta, SCALE, latent, out, rows, meta.num_reqs,
                             meta.max_seq_len)
            finally:
                ws.two_pv = was
            return out
        decode_gluon.decode_gluon(q, cache, meta, SCALE, latent, out, None, meta.num_reqs,
                                  meta.max_seq_len, block_n=cfg.block_n,
                                  stages=cfg.num_stages, overlap=form == "gluon-overlap")
        return out
    return gluon


def _switched(call, switch: str, value: bool):
    """call with decode_gluon's module switch `switch` set to `value` (restored after)."""
    def on() -> torch.Tensor:
        was = getattr(decode_gluon, switch)
        setattr(decode_gluon, switch, value)
        try:
            return call()
        finally:
            setattr(decode_gluon, switch, was)
    return on


def run_case(name: str, batch: int, context: int | str, heads: int, shape: dict,
             device: str, dtype: torch.dtype, timer: Timer,
             tiles: list[mla_triton.TileConfig | None], forms: list[str],
             cache_dtype: torch.dtype | None = None) -> list[dict]:
    """One case, one step built, timed at each decode form and tile (None: the default);
    cache_dtype: the latent cache's type when not the queries' (its bytes set the bound)."""
    latent, rope, block = shape["latent"], shape["rope"], shape["block_size"]
    ctx = contexts(batch, context)
    q, cache, meta = make_step(ctx, heads, latent, rope, block, device, dtype, 0, cache_dtype)
    b = bounds(ctx, heads, latent, rope, cache.element_size())
    rows = []
    for named, tile in [(f, t) for f in forms for t in tiles]:
        form, suffix = named, ""  # the kernel; `named` times it (SWITCHES': decode_op)
        while strip := next((s for s, _, _ in SWITCHES if form.endswith(s)), None):
            form, suffix = form.removesuffix(strip), strip + suffix
        served = form == "auto"  # timed as served; the form it maps to for the record
        if served:  # the kernel a served step runs (decode_gluon's own dispatch on sm90)
            form = mla_triton.auto_decode_form(heads, batch,
                                               decode_gluon.supports(q, cache, latent))
            if form == "gluon" and tile is None:
                form = SERVED_GLUON[decode_gluon.decode_kernel(q, cache, latent,
                                                               meta.max_seq_len)]
        if (form == "flat" and heads > mla_triton.FLAT_MAX_HEADS) or (
                form == "gluon-swapped" and heads > SWAPPED_HEADS):
            continue
        cfg = tile or mla_triton.default_config("decode", latent, dtype, heads)
        if form.startswith("gluon"):
            block_n, stages = decode_gluon.tile(tile and tile.block_n, tile and tile.num_stages,
                                                form == "gluon-overlap")
            cfg = mla_triton.TileConfig(decode_gluon.BLOCK_H, block_n, decode_gluon.NUM_WARPS,
                                        stages)
            if form == "gluon-swapped":  # its one tile: 32 heads, 64 keys, its key stages
                if tile is not None:
                    continue
                cfg = mla_triton.TileConfig(SWAPPED_HEADS, 64, decode_gluon.NUM_WARPS,
                                            decode_gluon_swapped.key_stages())
            if form.startswith("gluon-ws"):  # its one tile: 64 heads, 64 keys, 4 + 4 warps
                if tile is not None:
                    continue
                cfg = mla_triton.TileConfig(64, 64, 8, 2)
            if form == "gluon-overlap" and stages < 3:  # its stage count
                continue
        head_tiles = 1 if form == "flat" else mla_triton.head_tiles(heads, cfg.block_m)[0]
        timed = ("auto" if served else form) + suffix
        op_cfg = None if served and tile is None else cfg  # None: the launcher's own pick
        err = check(ctx, heads, latent, rope, block, device, dtype, op_cfg, timed, cache_dtype)
        waves = (decode_gluon.DECODE_WAVES if form.startswith("gluon")
                 else reduce_triton.DECODE_WAVES)
        if form == "gluon-swapped":  # two programs an SM with one key stage
            waves *= decode_gluon_swapped.programs_per_sm()
        splits = (None if form == "flat"
                  else mla_triton.decode_num_splits(batch, head_tiles, meta.max_seq_len,
                                                    q.device, waves=waves))
        ms = timer(decode_op(q, cache, meta, latent, op_cfg, timed))
        rows.append({
            "case": name, "form": timed, "kernel": form, "heads": heads, "batch": batch,
            "context": context,
            "mean_context": round(float(np.mean(ctx)), 1), "splits": splits,
            "head_tiles": head_tiles, "tile": dataclasses.asdict(cfg),
            "check_error": err, "ms": round(ms, 4),
            **{k: round(v, 4) if isinstance(v, float) else v for k, v in b.items()},
            "pct_of_bound": round(100 * b["bound_ms"] / ms, 1),
            "tflops": round(b["flops"] / (ms * 1e-3) / 1e12, 1),
            "cache_gb_per_s": round(sum(ctx) * (latent + rope) * cache.element_size()
                                    / ms / 1e6, 1)})
    return rows


def parse_tile(text: str) -> mla_triton.TileConfig:
    """'32,32,8,2' -> TileConfig(block_m 32, block_n 32, num_warps 8, num_stages 2); a fifth
    integer is the register cap (maxnreg)."""
    parts = text.split(",")
    if len(parts) not in (4, 5) or not all(p.strip().isdigit() for p in parts):
        raise SystemExit(f"--tiles: {text!r} is not BM,BN,W,S[,MAXNREG] (four or five "
                         "integers)")
    try:
        return mla_triton.TileConfig(*(int(p) for p in parts))
    except ValueError as exc:
        raise SystemExit(f"--tiles: {text!r}: {exc}") from None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory for kernels_mla.json")
    parser.add_argument("--heads", type=int, nargs="+", default=list(HEADS))
    parser.add_argument("--block-size", type=int, default=16,
                        help="tokens a KV block (the engine's default: 16)")
    parser.add_argument("--tiles", nargs="+", default=None, metavar="BM,BN,W,S",
                        help="decode TileConfigs to time each case at (heads a program, keys "
                             "an iteration, warps, stages); default: the kernel's default")
    parser.add_argument("--forms", nargs="+", default=["auto"],
                        choices=list(dict.fromkeys((*mla_triton.DECODE_FORMS, *GLUON_FORMS,
                                                    *(f"{f}-vec" for f in GLUON_FORMS),
                                                    *(f"{f}{s}" for s in ("-lf", "-so")
                                                      for f in ("auto", *GLUON_FORMS))))),
                        help="decode forms to time (split, flat; auto: the launcher's pick; "
                             "flat skips heads past its FLAT_MAX_HEADS; gluon, gluon-overlap: "
                             "decode_gluon, gluon-swapped: decode_gluon_swapped (at most 32 "
                             "heads), sm90 only; a '-vec' suffix on a Gluon form: with "
                             "16-byte output stores; '-lf' / '-so' on auto or a Gluon form: "
                             "rows launched longest context first / in step order)")
    parser.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto",
                        help="the latent cache's type: the queries' (auto) or float8 e4m3 (the "
                             "engine's kv_cache_dtype=fp8; the read bound counts its bytes)")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--few-rows", action="store_true",
                       help="time FEW_ROW_CASES (4-128 rows of 2k-16k keys) instead of CASES")
    which.add_argument("--crossover", action="store_true",
                       help="time CROSSOVER_CASES (256-2,048 rows of 384-1,536 keys) instead "
                            "of CASES")
    parser.add_argument("--l2-flush", choices=L2_FLUSHES, default="zero",
                        help="how the timer empties the L2 before each call (kernel_runs: "
                             "zero, do_bench's, leaves dirty lines the call writes back; read: "
                             "a served step's clean L2)")
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = parser.parse_args()
    device = run_device(args.smoke, "kernels_mla")
    global COPY_TBPS, DENSE_TFLOPS
    ceilings = device_ceilings(device)
    COPY_TBPS, DENSE_TFLOPS = ceilings.bytes_per_s / 1e12, ceilings.flops_per_s / 1e12
    if args.smoke:
        dtype, cases = torch.float32, SMOKE_CASES
        shape = {"latent": 32, "rope": 16, "block_size": 8}
        heads = [min(h, 4) for h in args.heads[:1]]
    else:
        dtype = torch.bfloat16
        cases = (FEW_ROW_CASES if args.few_rows else CROSSOVER_CASES if args.crossover
                 else CASES)
        shape = {"latent": LATENT, "rope": ROPE, "block_size": args.block_size}
        heads = args.heads
    timer = make_timer(args.smoke, warmup_ms=10, rep_ms=50, flush=args.l2_flush)
    from benchmarks.engine.w1_offline import environment

    os.makedirs(args.out, exist_ok=True)
    result: dict = {"environment": environment(),
                    "config": {**vars(args), **shape, "dtype": str(dtype), "scale": SCALE,
                               "ceilings": ceilings.name, "copy_tbps": COPY_TBPS,
                               "dense_tflops": DENSE_TFLOPS,
                               "timer": "one eager call (smoke)" if args.smoke
                               else f"mean after an L2 flush by {args.l2_flush} "
                                    "(kernel_runs.make_timer), warmup 10 ms, rep 50 ms"},
                    "cases": []}
    path = os.path.join(args.out, "kernels_mla.json")
    tiles = [parse_tile(t) for t in args.tiles] if args.tiles else [None]
    cache_dtype = FP8_CACHE_DTYPES[0] if args.kv_cache_dtype == "fp8" else None
    for h in heads:
        for name, batch, context in cases:
            for row in run_case(name, batch, context, h, shape, device, dtype, timer,
                                tiles, args.forms, cache_dtype):
                record(result, "cases", row, path, device)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
