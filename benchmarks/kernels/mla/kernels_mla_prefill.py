"""MLA prefill rows, both forms, on the same steps (issue 16): which form of layers/mla.py's
prefill attention is faster at which lengths, to set `AUTO_ABSORBED_MAX_CONTEXT`.

One MLA layer of a preset (random weights, the Triton MLA backend), one step per case: prompts
of `query` tokens after `prefix` cached tokens each (blocks scattered over the pool), beside
`decodes` decode rows at W1's contexts. Each case runs the layer's attention (`_dense`: the
absorption products, the attention, the up-projection, the gathers and scatters each form
needs; not the projections before or after it, which both forms share) in each form:

    mha       every prefill row up-projected through kv_b_proj (mla_prefill_ref over SDPA)
    absorbed  every row over the latent cache (the Triton kernel), W_UK / W_UV around it

FLOPs of the prefill rows per head (L kv_lora_rank, R rope, n queries over c = prefix + n keys,
causal: n (c - n) + n (n + 1) / 2 query-key pairs):

    mha       pairs x 2 (nope + R + v)  +  c x 2 L (nope + v)     (the up-projection)
    absorbed  pairs x 2 (2L + R)        +  n x 2 L (nope + v)     (W_UK and W_UV)

Both forms' outputs are compared first (the largest error relative to the output's scale);
timed with triton.testing.do_bench. Writes kernels_mla_prefill.json to --out after each case.

    python -m benchmarks.kernels.mla.kernels_mla_prefill --out DIR [--presets glm-4.7-flash ...]
    python -m benchmarks.kernels.mla.kernels_mla_prefill --out DIR --tiles 32,32,8,2 64,32,8,3
        # the absorbed form at each prefill TileConfig too (rows a program, keys a step,
        # warps, stages)
    python -m benchmarks.kernels.mla.kernels_mla_prefill --out DIR --gluon
        # the absorbed form's prefill rows through mla/prefill_gluon.py too (sm90)
    python -m benchmarks.kernels.mla.kernels_mla_prefill --out DIR --fresh-varlen
        # "auto" with every fresh prompt's rows in one varlen flash launch (fresh_varlen_ms)
    python -m benchmarks.kernels.mla.kernels_mla_prefill --out DIR --long [--chunk-bytes N]
        # LONG_CASES instead; --chunk-bytes: mla/up_projected.py's CHUNK_BYTES (the context's
        # chunks in the mha form; a large one up-projects a context at once)
    python -m benchmarks.kernels.mla.kernels_mla_prefill --out DIR --smoke   # CPU interpreter

Each form's first call also records its peak allocated bytes above the step's (`*_peak_mib`,
CUDA).
"""

from __future__ import annotations

import argparse
import functools
import os

import numpy as np
import torch

from benchmarks.kernels.kernel_runs import SMOKE_HELP, Timer, make_timer, record, run_device
from benchmarks.kernels.mla.kernels_mla import parse_tile
from moeserve.kernels.attention.metadata import AttentionMetadata, build_attention_metadata
from moeserve.layers.mla import FRESH_VARLEN_MIN_TOKENS, MLAttention
from moeserve.model_config import ModelConfig
from moeserve.presets import load_preset

DENSE_TFLOPS = 787.0  # ANCHORS.md: the H200's bf16 dense peak
PRESETS = ("glm-4.7-flash", "glm-5", "deepseek-v3")
FORMS = ("mha", "absorbed")
# (name, prompts, query tokens each, prefix tokens each, decode rows beside them)
CASES = (("w1_mixed", 64, 128, 0, 1024), ("fresh_64x128", 64, 128, 0, 0),
         ("fresh_16x512", 16, 512, 0, 0), ("fresh_4x2048", 4, 2048, 0, 0),
         ("fresh_1x8192", 1, 8192, 0, 0), ("chunk_8x256_after_2048", 8, 256, 2048, 0),
         ("chunk_4x512_after_3584", 4, 512, 3584, 0),
         ("chunk_1x2048_after_6144", 1, 2048, 6144, 0),
         # fresh prompts of FRESH_VARLEN_MIN_TOKENS and more beside decode rows: the step
         # splits into an absorbed and a varlen part (W1's mixed step so split ran 1.85x the
         # absorbed time at GLM-4.7-Flash, gpu_7c427c9/call1)
         ("mixed_4x512_with_1024_decodes", 4, 512, 0, 1024),
         ("mixed_1x2048_with_1024_decodes", 1, 2048, 0, 1024))
# --long: a token budget's chunk at the end of long contexts (the memory plan profiles the
# last: 8,192 tokens at glm-4.7-flash's 202,752), where "auto" up-projects
LONG_CASES = (("chunk_1x8192_after_24576", 1, 8192, 24576, 0),
              ("chunk_1x8192_after_57344", 1, 8192, 57344, 0),
              ("chunk_1x8192_after_194560", 1, 8192, 194560, 0))
SMOKE_CASES = (("mixed", 2, 6, 0, 3), ("chunk", 2, 5, 9, 0))
# the smoke run's layer: the first preset's fields, narrowed (the interpreter is slow)
SMOKE_DIMS = {"num_attention_heads": 2, "num_key_value_heads": 2, "q_lora_rank": 16,
              "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 16,
              "v_head_dim": 16, "qk_head_dim": 32, "head_dim": 16, "hidden_size": 32}


def layer_for(preset: str, device: str, dtype: torch.dtype, smoke: bool = False
              ) -> MLAttention:
    """Layer 0's attention of the preset, random weights (the scale of a trained model's)."""
    hf = {**load_preset(preset), **(SMOKE_DIMS if smoke else {})}
    config = ModelConfig.from_hf(hf)
    if config.mla is None:
        raise SystemExit(f"{preset}: not an MLA model")
    from moeserve.kernels.attention.mla.absorbed_triton import mla_attention_triton

    layer = MLAttention(0, config, mla_attention_triton, dtype, device)
    if device == "meta":  # the shapes only
        return layer
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, device=device) * p.shape[-1] ** -0.5)
    return layer


def make_step(layer: MLAttention, case: tuple, block: int, device: str, dtype: torch.dtype,
              seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """(q_nope, q_rope, metadata) of the case's step, the cache filled and bound to the
    layer: the decode rows first (as the scheduler plans them), then the prompts."""
    _, prompts, query, prefix, decodes = case
    rng = np.random.default_rng(seed)
    dec_ctx = rng.integers(129, 257, decodes).tolist()  # W1's contexts
    computed = [c - 1 for c in dec_ctx] + [prefix] * prompts
    scheduled = [1] * decodes + [query] * prompts
    need = [-(-(c + s) // block) for c, s in zip(computed, scheduled, strict=True)]
    free = rng.permutation(np.arange(1, sum(need) + 1))  # block 0: the null block
    bounds = np.cumsum([0, *need])
    tables = [free[bounds[i]:bounds[i + 1]].tolist() for i in range(len(need))]
    meta = build_attention_metadata(computed, scheduled, tables, block, device)
    gen = torch.Generator(device=device).manual_seed(seed)
    width = layer.kv_lora_rank + layer.rope_dim
    layer.kv_cache = torch.randn(sum(need) + 1, block, width, generator=gen,
                                 device=device).to(dtype)
    t, heads = int(sum(scheduled)), layer.num_heads
    q_nope = torch.randn(t, heads, layer.nope, generator=gen, device=device).to(dtype)
    q_rope = torch.randn(t, heads, layer.rope_dim, generator=gen, device=device).to(dtype)
    return q_nope, q_rope, meta


def prefill_flops(layer: MLAttention, prompts: int, query: int, prefix: int) -> dict:
    """FLOPs of the case's prefill rows in each form (module doc)."""
    n, c = query, prefix + query
    pairs = n * prefix + n * (n + 1) // 2
    L, R, nope, v = layer.kv_lora_rank, layer.rope_dim, layer.nope, layer.v_dim
    proj = 2 * L * (nope + v)
    per_head = {"mha": pairs * 2 * (nope + R + v) + c * proj,
                "absorbed": pairs * 2 * (2 * L + R) + n * proj}
    return {form: prompts * layer.num_heads * f for form, f in per_head.items()}


def peak_mib(fn) -> tuple:
    """(fn(), the peak bytes it allocated above those held before it, MiB: None off CUDA)."""
    if not torch.cuda.is_available():
        return fn(), None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    return out, round((torch.cuda.max_memory_allocated() - base) / 2 ** 20, 1)


def run_case(preset: str, layer: MLAttention, case: tuple, block: int, device: str,
             dtype: torch.dtype, timer: Timer, tiles: tuple = (), gluon: bool = False,
             fresh: bool = False) -> dict:
    """One case: both forms checked against each other, then each timed (and the absorbed
    form at each of `tiles`, prefill TileConfigs; gluon: its prefill rows in Gluon too;
    fresh: "auto" with the fresh prompts' varlen form)."""
    name, prompts, query, prefix, decodes = case
    q_nope, q_rope, meta = make_step(layer, case, block, device, dtype)
    outs, ms, peak = {}, {}, {}
    for form in FORMS:
        layer.prefill_form = form
        with torch.no_grad():
            outs[form], peak[form] = peak_mib(lambda: layer._dense(q_nope, q_rope, meta))
            outs[form] = outs[form].float()
            ms[form] = timer(lambda: layer._dense(q_nope, q_rope, meta))
    if fresh:  # fresh prompts' rows in one varlen launch (mla/up_projected.attend_fresh_rows)
        # every fresh row, not only from FRESH_VARLEN_MIN_TOKENS: the launch's own time
        layer.prefill_form, layer.fresh_varlen, layer.fresh_min_tokens = "auto", True, 2
        with torch.no_grad():
            outs["fresh_varlen"], peak["fresh_varlen"] = peak_mib(
                lambda: layer._dense(q_nope, q_rope, meta))
            outs["fresh_varlen"] = outs["fresh_varlen"].float()
            ms["fresh_varlen"] = timer(lambda: layer._dense(q_nope, q_rope, meta))
        layer.fresh_min_tokens = FRESH_VARLEN_MIN_TOKENS
    layer.prefill_form = "absorbed"
    by_tile, backend = {}, layer.backend
    if gluon:  # the absorbed prefill rows through mla/prefill_gluon.py
        layer.backend = functools.partial(backend, prefill_gluon=True)
        with torch.no_grad():
            outs["absorbed_gluon"] = layer._dense(q_nope, q_rope, meta).float()
            ms["absorbed_gluon"] = timer(lambda: layer._dense(q_nope, q_rope, meta))
    for cfg in tiles:
        layer.backend = functools.partial(backend, prefill_config=cfg)
        with torch.no_grad():
            by_tile[",".join(map(str, (cfg.block_m, cfg.block_n, cfg.num_warps,
                                       cfg.num_stages)))] = round(
                timer(lambda: layer._dense(q_nope, q_rope, meta)), 4)
    layer.backend = backend
    want = outs["mha"]
    bound = 1e-4 if dtype == torch.float32 else 2 ** -5
    for form in outs:
        err = float((outs[form] - want).abs().max() / want.abs().max().clamp(min=1e-30))
        if not err <= bound:
            raise SystemExit(f"{preset} {name}: {form} differs from mha by {err:.3g} of the "
                             f"output scale (bound {bound:g})")
    err = float((outs["absorbed"] - want).abs().max() / want.abs().max().clamp(min=1e-30))
    flops = prefill_flops(layer, prompts, query, prefix)
    faster = min(FORMS, key=ms.get)
    return {"preset": preset, "case": name, "heads": layer.num_heads, "prompts": prompts,
            "query": query, "prefix": prefix, "decodes": decodes, "check_error": err,
            **{f"{form}_ms": round(ms[form], 4) for form in FORMS},
            **{f"{form}_peak_mib": peak[form] for form in FORMS if peak[form] is not None},
            **{f"{form}_prefill_gflop": round(flops[form] / 1e9, 2) for form in FORMS},
            "faster": faster, "absorbed_speedup": round(ms["mha"] / ms["absorbed"], 3),
            "absorbed_tiles_ms": by_tile,
            **({"absorbed_gluon_ms": round(ms["absorbed_gluon"], 4)} if gluon else {}),
            **({"fresh_varlen_ms": round(ms["fresh_varlen"], 4),
                "fresh_varlen_peak_mib": peak["fresh_varlen"]} if fresh else {})}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory for kernels_mla_prefill.json")
    parser.add_argument("--presets", nargs="+", default=list(PRESETS))
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--tiles", nargs="+", default=[], metavar="BM,BN,W,S",
                        help="prefill TileConfigs to time the absorbed form at as well")
    parser.add_argument("--gluon", action="store_true",
                        help="the absorbed form's prefill rows through mla/prefill_gluon.py "
                             "too (sm90): absorbed_gluon_ms")
    parser.add_argument("--fresh-varlen", action="store_true",
                        help='"auto" with fresh prompts up-projected in one varlen launch too '
                             "(layers/mla.py's fresh_varlen): fresh_varlen_ms")
    parser.add_argument("--long", action="store_true",
                        help="LONG_CASES: 8,192 tokens at the end of 32k-202k contexts")
    parser.add_argument("--chunk-bytes", type=int, default=None,
                        help="mla/up_projected.py's CHUNK_BYTES for the mha form")
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = parser.parse_args()
    device = run_device(args.smoke, "kernels_mla_prefill")
    if args.chunk_bytes is not None:
        from moeserve.kernels.attention.mla import up_projected

        up_projected.CHUNK_BYTES = args.chunk_bytes
    dtype, cases, block = ((torch.float32, SMOKE_CASES, 4) if args.smoke
                           else (torch.bfloat16, LONG_CASES if args.long else CASES,
                                 args.block_size))
    timer = make_timer(args.smoke, warmup_ms=10, rep_ms=50)
    from benchmarks.engine.w1_offline import environment

    os.makedirs(args.out, exist_ok=True)
    result: dict = {"environment": environment(),
                    "config": {**vars(args), "dtype": str(dtype), "block": block,
                               "cases": [list(c) for c in cases],
                               "timer": "one eager call (smoke)" if args.smoke
                               else "triton.testing.do_bench, warmup 10 ms, rep 50 ms"},
                    "cases": []}
    path = os.path.join(args.out, "kernels_mla_prefill.json")
    tiles = tuple(parse_tile(t) for t in args.tiles)
    for preset in args.presets:
        layer = layer_for(preset, device, dtype, args.smoke)
        for case in cases:
            record(result, "cases", run_case(preset, layer, case, block, device, dtype, timer,
                                             tiles, args.gluon, args.fresh_varlen), path,
                   device)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
