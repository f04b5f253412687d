"""DSA's prefill on the GPU (issue 17's W3): one full layer's attention for a chunk of a long
prompt at GLM-5's shape, part by part, each against its own bound, beside the dense MLA that
`--dsa dense` runs instead.

W3 takes in 32,768-token prompts a chunk at a time, and its serial roofline is mostly prefill
(42.7 of 47.0 s at concurrency 128, benchmarks/results/gpu_bc677c8). A chunk of C tokens
after P cached positions, token t seeing e(t) <= P + C positions, costs per full layer:

    indexer scores   sum_t e(t) x 32 heads x 128 x 2 FLOPs; the keys each 4-token tile loads
    top-k            the radix select over the [C, P + C] scores (and torch.topk over the int64
                     sort keys it replaced, timed for comparison)
    sparse MLA       sum_t min(e(t), 2,048) x 64 heads x 2 x (576 + 512) FLOPs (absorbed)
    dense MLA        sum_t e(t) x 64 heads x 2 x (192 + 64 + 256) FLOPs, plus the context's
                     up-projection (P + C) x 512 x 64 x (192 + 256) x 2 (the up-projected form
                     `--dsa dense` runs for a row whose context passes 512: mla_prefill_ref)

Each part's bound is max(bytes / 4.27 TB/s, FLOPs / 787 TFLOP/s) (ANCHORS.md's H200 copy rate
and bf16 dense peak; another GPU's own where the roofline has them); the sparse MLA and dense
MLA bounds count FLOPs only (their reads are a few MB of latents, and the queries). Timed with
triton.testing.do_bench, eager (a prefill step is not a CUDA graph). First checked, on a small
step of exact integer data: the selection equal to `indexer_topk_ref`'s, the sparse MLA within
2^-6 of `dsa_attention_ref`. On the GPU the sparse MLA is timed by decode_gluon_ws's sparse
form (sparse_mla_ws_ms) and by decode_gluon's kernel (sparse_mla_gluon_ms): decode_gluon.ws_sparse's
A/B. The top-k in its row and chunks forms with topk_triton.GATHER on as topk_row_gather_ms and
topk_chunks_gather_ms (each first checked equal to the default's selection). The dense MLA
also with its pieces through the memory-efficient kernel and through cuDNN's
(up_projected.PIECE_KERNEL: dense_mla_{efficient,cudnn}_ms, each with its largest difference
from the default relative to the output's largest value, dense_mla_{...}_error; a kernel that
raises is recorded as dense_mla_{...}_ms: "error: ..."). A served prefill's pieces come in
shapes never seen before (each row's lengths), and cuDNN builds a graph per shape: `pieces`
times each kernel's first call at fresh shapes against its repeat (piece_first_call), and
`--pieces` times only the kernels, at the pieces a long row makes (piece_sweep).

    python -m benchmarks.kernels.mla.kernels_dsa_prefill --out DIR
    python -m benchmarks.kernels.mla.kernels_dsa_prefill --out DIR --pieces  # kernels only
    python -m benchmarks.kernels.mla.kernels_dsa_prefill --out DIR --smoke   # tiny, CPU interpreter
"""

from __future__ import annotations

import argparse
import functools
import json
import os

import torch

from benchmarks.kernels.kernel_runs import (
    SMOKE_HELP,
    Timer,
    device_ceilings,
    make_timer,
    record,
    run_device,
)
from benchmarks.kernels.mla.kernels_dsa import (
    key_bytes,
    make_step,
    time_score_key_tiles,
)
from moeserve.kernels.attention.dsa import indexer_triton as dsa_triton
from moeserve.kernels.attention.dsa import sparse_triton as dsa_sparse_triton
from moeserve.kernels.attention.dsa import topk_triton
from moeserve.kernels.attention.dsa.reference import dsa_attention_ref, indexer_topk_ref
from moeserve.kernels.attention.mla import up_projected
from moeserve.kernels.attention.mla.reference import mla_prefill_ref

# ANCHORS.md: the H200's copy rate and bf16 dense peak; main() takes its GPU's (device_ceilings)
COPY_TBPS, PEAK_TFLOPS = 4.27, 787.0
# (name, cached positions P, chunk tokens C): W3's last chunk of a 32k prompt, its first, and a
# short chunk after a long prefix
CASES = (("w3_chunk_8192_after_24576", 24576, 8192), ("w3_chunk_8192_after_0", 0, 8192),
         ("chunk_1024_after_31744", 31744, 1024))
SMOKE = (("smoke_17_after_40", 40, 17),)
# GLM-5: the indexer's 32 x 128 (kernels_dsa's make_step), the MLA's heads and widths
SHAPE = {"cuda": dict(block=64, topk=2048, heads=64, latent=512, rope=64, nope=192, v=256),
         "cpu": dict(block=16, topk=8, heads=4, latent=32, rope=16, nope=16, v=16)}


def ends(meta) -> torch.Tensor:
    """Positions each token sees: min(position + 1, its row's seq_len)."""
    return torch.minimum(meta.positions + 1, meta.seq_lens[meta.token_to_req].long())


def bound_ms(nbytes: float, flops: float) -> float:
    return max(nbytes / (COPY_TBPS * 1e12), flops / (PEAK_TFLOPS * 1e12)) * 1e3


def check(device: str, dtype: torch.dtype, s: dict) -> float:
    """A small step of integer data: the selection equals the reference's, and the sparse MLA
    is within 2^-6 of its reference (relative to the largest output); returns that error."""
    prefix, chunk = (300, 64) if device == "cuda" else (40, 17)
    q, w, index_cache, meta = make_step([prefix], [chunk], s["block"], device, dtype,
                                        integers=True, seed=7)
    got, _ = dsa_triton.indexer_topk_triton(q, w, index_cache, meta, 0.25, s["topk"])
    want, _ = indexer_topk_ref(q, w, index_cache, meta, 0.25, s["topk"])
    assert torch.equal(got, want), "the selection differs from the reference"
    gen = torch.Generator(device=device).manual_seed(8)
    width = s["latent"] + s["rope"]
    q_lat = torch.randn(meta.num_tokens, s["heads"], width, generator=gen, device=device)
    latent = torch.randn(index_cache.shape[0], s["block"], width, generator=gen, device=device)
    q_lat, latent = q_lat.to(dtype), latent.to(dtype)
    out = dsa_sparse_triton.dsa_attention_triton(q_lat, latent, meta, got, width ** -0.5,
                                                 s["latent"], packed=True).float()
    ref = dsa_attention_ref(q_lat.float(), latent.float(), meta, got, width ** -0.5,
                            s["latent"]).float()
    err = float((out - ref).abs().max() / ref.abs().max().clamp(min=1e-30))
    assert err <= 2 ** -6, f"sparse MLA: {err:.3g} from the reference"
    return err


def time_sparse_ws_prefill(name: str, args: tuple, timer: Timer) -> dict:
    """The chunk's sparse MLA with decode_gluon.ws_sparse on (decode_gluon_ws's sparse form,
    one P V warpgroup) and off (decode_gluon's kernel), the second checked against the first:
    sparse_mla_ws_ms, sparse_mla_gluon_ms."""
    from moeserve.kernels.attention.mla import decode_gluon

    run = functools.partial(dsa_sparse_triton.dsa_attention_triton, *args, packed=True)
    was = decode_gluon.ws_sparse
    row: dict = {}
    try:
        decode_gluon.ws_sparse = True
        base = run().float()
        row["sparse_mla_ws_ms"] = timer(run)
        decode_gluon.ws_sparse = False
        err = float((run().float() - base).abs().max() / base.abs().max())
        assert err <= 2 ** -6, f"{name}: sparse MLA by decode_gluon against _ws: {err:.3g}"
        row["sparse_mla_gluon_ms"] = timer(run)
        return row
    finally:
        decode_gluon.ws_sparse = was


def run_case(name: str, prefix: int, chunk: int, device: str, timer: Timer) -> dict:
    cuda = device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    s = SHAPE[device]
    err = check(device, dtype, s)
    q_i, w, index_cache, meta = make_step([prefix], [chunk], s["block"], device, dtype,
                                          integers=False)
    scale_i = q_i.shape[-1] ** -0.5
    gen = torch.Generator(device=device).manual_seed(9)
    width, heads = s["latent"] + s["rope"], s["heads"]
    q_lat = torch.randn(chunk, heads, width, generator=gen, device=device).to(dtype)
    latent = torch.randn(index_cache.shape[0], s["block"], width, generator=gen,
                         device=device).to(dtype)
    q_up = torch.randn(chunk, heads, s["nope"] + s["rope"], generator=gen,
                       device=device).to(dtype)
    kv_b = (torch.randn(heads * (s["nope"] + s["v"]), s["latent"], generator=gen,
                        device=device) * s["latent"] ** -0.5).to(dtype)

    positions, _ = dsa_triton.indexer_topk_triton(q_i, w, index_cache, meta, scale_i, s["topk"])
    scores = torch.cat([c for _, _, c in dsa_triton.index_score_chunks(q_i, w, index_cache, meta,
                                                                        scale_i)])
    keys = (scores.long() << 32) | ((1 << 31) - 1 - torch.arange(scores.shape[1], device=device))
    selected = torch.empty(chunk, s["topk"], dtype=torch.int32, device=device)
    k = min(s["topk"], scores.shape[1])
    row: dict = {"case": name, "prefix": prefix, "chunk": chunk, "check_error": err}
    row["indexer_ms"] = timer(lambda: dsa_triton.indexer_topk_triton(
        q_i, w, index_cache, meta, scale_i, s["topk"]))
    row["score_ms"] = timer(lambda: [c for _, _, c in dsa_triton.index_score_chunks(
        q_i, w, index_cache, meta, scale_i)])
    if cuda:  # indexer_triton's score_key_tiles switch (kernels_dsa's)
        row |= time_score_key_tiles(name, (q_i, w, index_cache, meta, scale_i), scores, timer)
    row["topk_ms"] = timer(lambda: topk_triton.radix_topk(scores, meta, 0, s["topk"], selected))
    row["topk_chunks_ms"] = timer(lambda: topk_triton.radix_topk(
        scores, meta, 0, s["topk"], selected, form="chunks"))
    row["topk_row_ms"] = timer(lambda: topk_triton.radix_topk(
        scores, meta, 0, s["topk"], selected, form="row"))
    row["topk_torch_ms"] = timer(lambda: torch.topk(keys, k, dim=1))
    gathered = torch.empty_like(selected)  # topk_triton.GATHER's A/B, row and chunks forms
    topk_triton.radix_topk(scores, meta, 0, s["topk"], selected)
    was, topk_triton.GATHER = topk_triton.GATHER, True
    try:
        for form in ("row", "chunks"):
            topk_triton.radix_topk(scores, meta, 0, s["topk"], gathered, form=form)
            assert torch.equal(gathered, selected), f"{name}: the {form} top-k with GATHER"
            row[f"topk_{form}_gather_ms"] = timer(lambda f=form: topk_triton.radix_topk(
                scores, meta, 0, s["topk"], gathered, form=f))
    finally:
        topk_triton.GATHER = was
    row["sparse_mla_ms"] = timer(lambda: dsa_sparse_triton.dsa_attention_triton(
        q_lat, latent, meta, positions, width ** -0.5, s["latent"], packed=True))
    if cuda:  # decode_gluon.ws_sparse's A/B: the same launch by each kernel
        row |= time_sparse_ws_prefill(name, (q_lat, latent, meta, positions, width ** -0.5,
                                             s["latent"]), timer)
    def dense() -> torch.Tensor:
        return mla_prefill_ref(q_up, latent, meta, (s["nope"] + s["rope"]) ** -0.5, kv_b,
                               s["nope"], s["v"])
    row["dense_mla_ms"] = timer(dense)
    if cuda:  # up_projected.PIECE_KERNEL's A/B: the pieces through the other kernels
        base = dense().float()
        was = up_projected.PIECE_KERNEL
        for kernel in up_projected.PIECE_KERNELS:
            if kernel == was:
                continue
            up_projected.PIECE_KERNEL = kernel
            try:
                got = dense().float()
                row[f"dense_mla_{kernel}_error"] = float(
                    (got - base).abs().max() / base.abs().max())
                row[f"dense_mla_{kernel}_ms"] = timer(dense)
            except RuntimeError as e:  # a kernel that refuses the shapes
                row[f"dense_mla_{kernel}_ms"] = f"error: {str(e)[:200]}"
            finally:
                up_projected.PIECE_KERNEL = was
    seen = ends(meta).double()
    index_flops = float(seen.sum()) * q_i.shape[1] * q_i.shape[2] * 2
    sparse_flops = float(seen.clamp(max=s["topk"]).sum()) * heads * 2 * (width + s["latent"])
    dense_flops = (float(seen.sum()) * heads * 2 * (s["nope"] + s["rope"] + s["v"])
                   + (prefix + chunk) * s["latent"] * heads * (s["nope"] + s["v"]) * 2)
    bounds = {"indexer": bound_ms(key_bytes(meta, dsa_triton.index_block_q(q_i.shape[1]),
                                            dsa_triton.index_block_n(q_i.shape[2])),
                                  index_flops),
              "sparse_mla": bound_ms(0, sparse_flops), "dense_mla": bound_ms(0, dense_flops)}
    dsa_ms = row["indexer_ms"] + row["sparse_mla_ms"]
    row = {key: round(v, 4) if isinstance(v, float) and not key.endswith("error") else v
           for key, v in row.items()}
    row.update({f"{part}_bound_ms": round(b, 4) for part, b in bounds.items()})
    row.update({"indexer_pct": round(100 * bounds["indexer"] / row["indexer_ms"], 1),
                "sparse_mla_pct": round(100 * bounds["sparse_mla"] / row["sparse_mla_ms"], 1),
                "dense_mla_pct": round(100 * bounds["dense_mla"] / row["dense_mla_ms"], 1),
                "dsa_ms": round(dsa_ms, 4),
                "speedup_vs_dense": round(row["dense_mla_ms"] / dsa_ms, 2),
                "flops_predicted_speedup": round(
                    dense_flops / (index_flops + sparse_flops), 2)})
    return row


def piece_first_call(device: str, heads: int, width: int, v_dim: int
                     ) -> dict[str, dict[str, float]]:
    """Each up_projected.PIECE_KERNEL's first call at shapes not seen before (a causal square
    piece and a context piece of odd lengths) against the same call repeated: the per-shape
    set-up a served prefill pays (cuDNN builds a graph a shape; the flash kernel none), in
    ms, the mean of three fresh shape pairs, wall time with a sync around each call."""
    import time

    was, result = up_projected.PIECE_KERNEL, {}
    try:
        for i, kernel in enumerate(up_projected.PIECE_KERNELS):
            up_projected.PIECE_KERNEL = kernel
            first, again = [], []
            for j in range(3):
                queries = 1021 + 64 * (3 * i + j)  # fresh for every kernel and pair
                for keys, causal in ((queries, True), (4 * queries + 7, False)):
                    q = torch.randn(1, heads, queries, width, device=device,
                                    dtype=torch.bfloat16)
                    k = torch.randn(1, heads, keys, width, device=device, dtype=torch.bfloat16)
                    v = torch.randn(1, heads, keys, v_dim, device=device, dtype=torch.bfloat16)
                    for times in (first, again):
                        torch.cuda.synchronize(device)
                        t0 = time.perf_counter()
                        up_projected._attend_piece(q, k, v, width ** -0.5, causal)
                        torch.cuda.synchronize(device)
                        times.append(1e3 * (time.perf_counter() - t0))
            result[kernel] = {"first_ms": round(sum(first) / len(first), 3),
                              "repeat_ms": round(sum(again) / len(again), 3)}
    finally:
        up_projected.PIECE_KERNEL = was
    return result


# (heads, key width, value width): GLM-5's, glm-4.7-flash's (the same widths) and DeepSeek-V3's
PIECE_SHAPES = ((64, 256, 256), (20, 256, 256), (128, 192, 128))


def piece_sweep(timer: Timer) -> list[dict]:
    """Each piece kernel's time (repeated shapes) at the pieces a long row makes: a causal
    square piece and a context piece of up_projected.chunk_tokens keys, 1,024 and 8,192
    queries, at PIECE_SHAPES; a kernel that refuses the shapes recorded as "error: ..."."""
    rows, was = [], up_projected.PIECE_KERNEL
    for heads, width, v_dim in PIECE_SHAPES:
        context = up_projected.chunk_tokens(heads, width, v_dim)
        for queries in (1024, 8192):
            for keys, causal in ((queries, True), (context, False)):
                q = torch.randn(1, heads, queries, width, device="cuda", dtype=torch.bfloat16)
                k = torch.randn(1, heads, keys, width, device="cuda", dtype=torch.bfloat16)
                v = torch.randn(1, heads, keys, v_dim, device="cuda", dtype=torch.bfloat16)
                row = {"heads": heads, "width": width, "queries": queries, "keys": keys,
                       "causal": causal}
                for kernel in up_projected.PIECE_KERNELS:
                    up_projected.PIECE_KERNEL = kernel
                    try:
                        row[f"{kernel}_ms"] = round(timer(functools.partial(
                            up_projected._attend_piece, q, k, v, width ** -0.5, causal)), 4)
                    except RuntimeError as e:
                        row[f"{kernel}_ms"] = f"error: {str(e)[:200]}"
                    finally:
                        up_projected.PIECE_KERNEL = was
                print(json.dumps(row), flush=True)
                rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory for kernels_dsa_prefill.json")
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    parser.add_argument("--pieces", action="store_true",
                        help="only the piece kernels: piece_sweep and piece_first_call (CUDA)")
    args = parser.parse_args()
    device = run_device(args.smoke, "kernels_dsa_prefill")
    global COPY_TBPS, PEAK_TFLOPS
    ceilings = device_ceilings(device)
    COPY_TBPS, PEAK_TFLOPS = ceilings.bytes_per_s / 1e12, ceilings.flops_per_s / 1e12
    cases = SMOKE if args.smoke else CASES
    timer = make_timer(args.smoke, warmup_ms=25, rep_ms=100)
    from benchmarks.engine.w1_offline import environment

    os.makedirs(args.out, exist_ok=True)
    result: dict = {"environment": environment(), "shape": SHAPE[device],
                    "ceilings": ceilings.name, "copy_tbps": COPY_TBPS,
                    "dense_tflops": PEAK_TFLOPS, "prefill": []}
    path = os.path.join(args.out, "kernels_dsa_prefill.json")
    if args.pieces:
        result["piece_sweep"] = piece_sweep(timer)
        cases = ()
    for name, prefix, chunk in cases:
        record(result, "prefill", run_case(name, prefix, chunk, device, timer), path, device)
    if device == "cuda":
        s = SHAPE[device]
        result["piece_first_call"] = piece_first_call(device, s["heads"], s["nope"] + s["rope"],
                                                      s["v"])
        print("piece_first_call", json.dumps(result["piece_first_call"]))
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
