"""The DSA indexer's scoring on the GPU: query tiles (issue 17) against one token a program.

Shape: GLM-5's lightning indexer (32 heads x 128, bf16 keys, blocks of 64 scattered over one
pool, index_topk 2048). Each case is first checked on integer-valued data (every score exact,
so any summation order selects alike): `indexer_topk_triton` equal to `indexer_topk_ref`, and
the one-token scoring's sort keys equal to the tiles' (`index_score_chunks(block_q=1)`, the
pre-tile kernel's work: every key tile loaded once per token). Then, on random data, timed with
triton.testing.do_bench: the scoring launches alone, tiled and one token a program, and the
whole op (scoring + torch.topk). Reports ms, the key bytes each scoring reads (a program loads
its visible key tiles whole: ceil(kv / BLOCK_N) * BLOCK_N * D * 2 B per tile or token) and the
achieved rate of those bytes. Decode-only steps run one token a program either way (listed as
the baseline). Writes kernels_dsa.json to --out.

    python -m benchmarks.kernels_dsa --out DIR
    python -m benchmarks.kernels_dsa --out DIR --smoke   # tiny shapes, CPU interpreter
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable

import numpy as np
import torch

# neither imports triton (the kernels do on first use, after --smoke set the interpreter)
from moeserve.kernels.attention import dsa_triton
from moeserve.kernels.attention.dsa import indexer_topk_ref
from moeserve.kernels.attention.metadata import AttentionMetadata, build_attention_metadata

HEADS, DIM, BLOCK, TOPK = 32, 128, 64, 2048
CASES = (  # (name, computed tokens per row, new tokens per row)
    ("chunk_64_after_8k", [8128], [64]),
    ("chunk_512_after_8k", [8192], [512]),
    ("fresh_2048", [0], [2048]),
    ("4x512_after_4k", [4096] * 4, [512] * 4),
    ("32_decodes_8k_and_chunk_256_after_4k", [8191] * 32 + [4096], [1] * 32 + [256]),
    ("decode_32x8k", [8191] * 32, [1] * 32),
)
SMOKE = (("chunk_17_after_40", [40], [17]), ("2_decodes_and_chunk_9", [30, 5, 0], [1, 1, 9]))


def make_step(computed: list[int], scheduled: list[int], block: int, device: str,
              dtype: torch.dtype, integers: bool, seed: int = 0) -> tuple:
    """(q [T, H, D], w [T, H] fp32, index cache, metadata) over shuffled blocks."""
    rng = np.random.default_rng(seed)
    need = [-(-(c + s) // block) for c, s in zip(computed, scheduled)]
    free = rng.permutation(np.arange(1, sum(need) + 2)).tolist()
    tables = [[free.pop() for _ in range(n)] for n in need]
    meta = build_attention_metadata(computed, scheduled, tables, block, device)
    gen = torch.Generator(device=device).manual_seed(seed)
    shape_q, shape_c = (meta.num_tokens, HEADS, DIM), (sum(need) + 2, block, DIM)
    if integers:
        q = torch.randint(-2, 3, shape_q, generator=gen, device=device).to(dtype)
        cache = torch.randint(-2, 3, shape_c, generator=gen, device=device).to(dtype)
        w = torch.randint(-2, 3, shape_q[:2], generator=gen, device=device) * 0.25
    else:
        q = torch.randn(shape_q, generator=gen, device=device).to(dtype)
        cache = torch.randn(shape_c, generator=gen, device=device).to(dtype)
        w = torch.randn(shape_q[:2], generator=gen, device=device) * HEADS ** -0.5
    return q, w.float(), cache, meta


def key_bytes(meta: AttentionMetadata, block_q: int, block_n: int) -> int:
    """Key bytes the scoring loads: each tile of block_q consecutive tokens of a row (1: each
    token) loads its last token's visible key tiles whole."""
    pos, seq = meta.positions.cpu().numpy(), meta.seq_lens_np
    rows, starts = meta.token_to_req_np, np.cumsum(meta.query_lens_np) - meta.query_lens_np
    last = (np.arange(len(pos)) - starts[rows]) % block_q == block_q - 1
    last |= np.r_[rows[1:] != rows[:-1], True]  # a row's last token ends its tile
    visible = np.minimum(pos[last] + 1, seq[rows[last]])
    return int((-(-visible // block_n) * block_n).sum()) * DIM * 2


def run_case(name: str, computed: list[int], scheduled: list[int], device: str,
             timer: Callable[[Callable[[], object]], float]) -> dict:
    dtype, scale = (torch.bfloat16, DIM ** -0.5) if device == "cuda" else (torch.float32, 0.1)
    block, topk = (BLOCK, TOPK) if device == "cuda" else (16, 8)
    q, w, cache, meta = make_step(computed, scheduled, block, device, dtype, integers=True)
    got, _ = dsa_triton.indexer_topk_triton(q, w, cache, meta, 0.25, topk)
    want, _ = indexer_topk_ref(q, w, cache, meta, 0.25, topk)
    assert torch.equal(got, want), f"{name}: the tiled selection differs from the reference"
    tiled = [k for _, _, k in dsa_triton.index_score_chunks(q, w, cache, meta, 0.25)]
    single = [k for _, _, k in dsa_triton.index_score_chunks(q, w, cache, meta, 0.25, 1)]
    assert all(torch.equal(a, b) for a, b in zip(tiled, single)), f"{name}: keys differ"
    q, w, cache, meta = make_step(computed, scheduled, block, device, dtype, integers=False)
    decode = bool((meta.query_lens_np == 1).all())
    block_q = 1 if decode else dsa_triton.index_block_q(HEADS)
    block_n = dsa_triton.index_block_n(DIM)

    def scores(bq: int | None) -> Callable[[], object]:
        return lambda: [k for _, _, k in dsa_triton.index_score_chunks(q, w, cache, meta,
                                                                        scale, bq)]

    row: dict = {"case": name, "rows": len(computed), "tokens": meta.num_tokens,
                 "max_seq_len": meta.max_seq_len, "block_q": block_q}
    for label, bq in (("tiled", None), ("one_token", 1)):
        ms = timer(scores(bq))
        nbytes = key_bytes(meta, block_q if bq is None else 1, block_n)
        row[label] = {"score_ms": round(ms, 4), "key_mib": round(nbytes / 2 ** 20, 2),
                      "key_gb_per_s": round(nbytes / ms / 1e6, 1)}
    row["topk_op_ms"] = round(timer(lambda: dsa_triton.indexer_topk_triton(
        q, w, cache, meta, scale, topk)), 4)
    row["score_speedup"] = round(row["one_token"]["score_ms"] / row["tiled"]["score_ms"], 2)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory for kernels_dsa.json")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes on the CPU through Triton's interpreter (no timing)")
    args = parser.parse_args()
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernels import triton
        device, cases = "cpu", SMOKE

        def timer(fn: Callable[[], object]) -> float:
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e3
    else:
        if not torch.cuda.is_available():
            raise SystemExit("kernels_dsa needs a CUDA GPU (or --smoke)")
        import triton.testing

        device, cases = "cuda", CASES

        def timer(fn: Callable[[], object]) -> float:
            return float(triton.testing.do_bench(fn, warmup=25, rep=100))

    from benchmarks.w1_offline import environment

    os.makedirs(args.out, exist_ok=True)
    result: dict = {"environment": environment(), "shape": {
        "heads": HEADS, "dim": DIM, "block_size": BLOCK, "topk": TOPK}, "cases": []}
    path = os.path.join(args.out, "kernels_dsa.json")
    for name, computed, scheduled in cases:
        row = run_case(name, computed, scheduled, device, timer)
        result["cases"].append(row)
        print(json.dumps(row))
        with open(path, "w") as f:  # after each case: a run cut short keeps what it measured
            json.dump(result, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
