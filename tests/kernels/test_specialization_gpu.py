"""GPU: the Triton kernels compile once per tile config, not once per step shape.

Triton compiles a new variant of a kernel when an int argument changes between "multiple of
16", "equal to 1" and neither, or a pointer's 16-byte alignment changes. Serving calls the
kernels with a new row count and block-table width at every step, and a compile costs seconds:
on the H200 7.6 s of a 31 s W1 run went to compiling new variants mid-run. The kernels exempt
those arguments (`do_not_specialize`); these tests call each kernel at many step shapes and
count its compiled variants. The counts are per process, so each test counts the variants its
own calls add.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moeserve.kernels.attention import paged_triton as paged_attention_triton
from moeserve.kernels.attention.mla import absorbed_triton as mla_triton
from moeserve.kernels.attention.mla import decode_flat_triton
from moeserve.kernels.attention.mla import reduce_triton as mla_reduce_triton
from moeserve.kernels.attention.mla.absorbed_triton import mla_attention_triton
from moeserve.kernels.attention.paged_triton import paged_attention_triton as run_attention
from moeserve.kernels.moe import align as moe_align
from moeserve.kernels.moe import fused_triton as moe_triton
from moeserve.kernels.moe.fused_triton import moe_triton as run_moe
from moeserve.kernels.norm_rope import rmsnorm_triton
from moeserve.kernels.norm_rope.rmsnorm_triton import rms_norm_triton
from tests.kernels.attention.test_mla_triton import gpu_case
from tests.kernels.attention.test_paged_attention_triton import gpu_step

pytestmark = pytest.mark.gpu


def variants(jit_fn: object) -> int:
    """Compiled variants of a Triton JITFunction, over every device it ran on."""
    caches = getattr(jit_fn, "device_caches", None)
    if caches is None:
        pytest.fail("this Triton's JITFunction has no device_caches: update variants()")
    return sum(len(entry[0]) for entry in caches.values())


def test_paged_attention_compiles_once_across_batch_shapes() -> None:
    kern = paged_attention_triton._kernels()
    rng = np.random.default_rng(0)
    counts = []
    for batch, num_prefill in [(7, 1), (16, 2), (33, 3), (100, 1), (129, 4), (250, 5)]:
        computed = rng.integers(1, 250, batch).tolist() + [0] * num_prefill
        scheduled = [1] * batch + rng.integers(5, 130, num_prefill).tolist()
        step = gpu_step(computed, scheduled, seed=batch)
        run_attention(step.q, step.kv_cache, step.meta, step.scale)
        torch.cuda.synchronize()
        counts.append((variants(kern.decode), variants(kern.prefill)))
    assert counts[0][0] >= 1 and counts[0][1] >= 1
    assert counts == [counts[0]] * len(counts), counts


def test_mla_attention_compiles_once_across_batch_shapes() -> None:
    """Mixed steps (decode rows by index, prefill tiles) and pure decode steps, each decode
    form: split-K (its reduce) and flat (its combine). At these row counts "auto" would take
    flat only, so each form is asked for by name; the prefill rows through the Triton kernel
    (on sm90 in bf16 they would take prefill_gluon.py, whose kernel this does not count)."""
    kern, flat = mla_triton._kernels(), decode_flat_triton._kernels()
    rng = np.random.default_rng(0)
    counts = []
    for batch, num_prefill in [(7, 1), (16, 2), (33, 3), (100, 1), (129, 4)]:
        computed = [599] + rng.integers(1, 600, batch - 1).tolist()  # 3 context partitions
        prefill = rng.integers(5, 130, num_prefill).tolist()
        for case in (gpu_case(computed + [0] * num_prefill, [1] * batch + prefill, 16,
                              seed=batch),
                     gpu_case(computed, [1] * batch, 16, seed=batch)):
            for form in ("split", "flat"):
                mla_attention_triton(case.q_lat, case.latent_cache, case.meta, case.scale,
                                     case.L, decode_form=form, prefill_gluon=False)
        torch.cuda.synchronize()
        counts.append((variants(kern.decode), variants(mla_reduce_triton._kernels().decode_reduce),
                       variants(kern.prefill), variants(flat.decode), variants(flat.combine)))
    assert min(counts[0]) >= 1, counts
    assert counts == [counts[0]] * len(counts), counts


@pytest.mark.parametrize("num_heads", [20, 64])
def test_mla_gluon_compiles_once_across_batch_shapes(num_heads: int) -> None:
    """The sm90 defaults (bf16): decode_gluon's kernel (64 heads' decode; every prefill, its
    PREFILL form), decode_gluon_swapped's (20 heads' decode) and the splits' reduce. A first
    pass of step shapes compiles what each kind of launch needs (split or not, mixed or pure
    decode); a second pass over other row counts of the same kinds compiles nothing more. The
    contexts stay under decode_gluon.WS_SHORT_CONTEXT, so decode_gluon_ws takes none."""
    from moeserve.kernels.attention.mla import decode_gluon, decode_gluon_swapped

    if not decode_gluon.supports_cache(torch.empty(1, 1, 576, device="cuda",
                                                   dtype=torch.bfloat16), 512):
        pytest.skip("the Gluon MLA kernels need an sm90 GPU")

    def compiled() -> tuple[int, ...]:
        return (variants(decode_gluon._kernels().decode),
                variants(decode_gluon_swapped._kernels().decode),
                variants(mla_reduce_triton._kernels().decode_reduce))

    rng = np.random.default_rng(1)

    def run(shapes: list[tuple[int, int]]) -> tuple[int, ...]:
        for batch, num_prefill in shapes:  # 7 to 300 rows: split (few rows) and not (many)
            computed = [599] + rng.integers(1, 600, batch - 1).tolist()
            prefill = rng.integers(5, 130, num_prefill).tolist()
            for case in (gpu_case(computed + [0] * num_prefill, [1] * batch + prefill,
                                  num_heads, seed=batch),
                         gpu_case(computed, [1] * batch, num_heads, seed=batch)):
                mla_attention_triton(case.q_lat, case.latent_cache, case.meta, case.scale,
                                     case.L)
        torch.cuda.synchronize()
        return compiled()

    first = run([(7, 1), (16, 2), (100, 1), (300, 2)])
    assert first[0] >= 1 and first[2] >= 1, first
    assert run([(9, 2), (20, 1), (90, 3), (280, 1), (8, 1)]) == first


def test_dsa_indexer_compiles_once_across_batch_shapes(monkeypatch: pytest.MonkeyPatch) -> None:
    """GLM-5's indexer (32 heads x 128, bf16, blocks of 64): decode steps (one token a program)
    and mixed steps (query tiles), some scored in chunks of tiles (the tiles sliced at odd
    offsets): at most two new variants, both compiled by the first pair of steps (none when
    the run's earlier DSA tests compiled them: the full `pytest -m gpu` on the H200). The
    radix top-k's kernels (dsa/topk_triton.py's row form, topk_chunks_triton.py's chunks
    form, topk_bisect_triton.py's bisect form: "auto"'s for these few tokens) likewise
    compile in the first pair only (the row form's one; the chunks form's six: four histogram
    levels, the count, the write; the bisect form's eight, one a register chunk count at
    each of its two warp counts, all built at its first call) whatever the tokens (past the
    SM count at 133), contexts (later steps' rows reach 2, 3 and 4 chunks of 4,096) and
    chunks."""
    from moeserve.kernels.attention.dsa import indexer_triton as dsa_triton
    from moeserve.kernels.attention.dsa import (
        topk_bisect_triton,
        topk_chunks_triton,
        topk_triton,
    )
    from tests.kernels.attention.test_dsa_triton import make_step

    kern, row_kern = dsa_triton._kernels(), topk_triton._kernels()
    chunks_kern, bisect_kern = topk_chunks_triton._kernels(), topk_bisect_triton._kernels()

    def compiled() -> tuple[int, ...]:
        return (variants(kern.index_score), variants(chunks_kern.hist),
                variants(chunks_kern.count), variants(chunks_kern.write),
                variants(row_kern.row), variants(bisect_kern.bisect))
    rng = np.random.default_rng(0)
    monkeypatch.setattr(dsa_triton, "_CHUNK_KEYS", 1 << 16)  # ~20 tokens a chunk at S ~ 3k
    start, counts = compiled(), []
    for (batch, num_prefill), longest in zip([(7, 1), (16, 2), (33, 3), (100, 1), (129, 4)],
                                             [3000, 3000, 6000, 11000, 16000]):
        computed = rng.integers(1, longest, batch).tolist()
        prefill = rng.integers(5, 130, num_prefill).tolist()
        for comp, sched in ((computed + [0] * num_prefill, [1] * batch + prefill),
                            (computed, [1] * batch)):
            step = make_step(comp, sched, 64, heads=32, dim=128, dtype=torch.bfloat16,
                             device="cuda", seed=batch)
            dsa_triton.indexer_topk_triton(step.q, step.w, step.cache, step.meta, 0.1, 2048)
        torch.cuda.synchronize()
        counts.append(tuple(now - then for now, then in zip(compiled(), start)))
    # counts[0] is 0s when an earlier test of the run compiled the variants already
    assert all(n <= most for n, most in zip(counts[0], (2, 4, 1, 1, 1, 8))), counts
    assert counts == [counts[0]] * len(counts), counts


def test_moe_compiles_once_across_token_counts() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    experts, hidden, inter, top_k = 16, 256, 128, 4
    w13 = torch.randn(experts, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16,
                      generator=gen) * 0.05
    w2 = torch.randn(experts, hidden, inter, device="cuda", dtype=torch.bfloat16,
                     generator=gen) * 0.05
    config = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 1, "num_warps": 4,
              "num_stages": 2}

    def moe_variants() -> tuple[int, ...]:
        align = moe_align._align_kernels()
        return (variants(moe_triton._kernel()), variants(align.one), variants(align.count),
                variants(align.offsets), variants(align.scatter))

    # the first two calls compile what each align path needs: the one-launch align up to
    # ONE_LAUNCH_MAX_PAIRS pairs (1 token), its three launches past them (250 tokens x 4)
    assert 250 * top_k > moe_align.ONE_LAUNCH_MAX_PAIRS >= 64 * top_k
    before, counts = None, []
    for i, tokens in enumerate((1, 250, 3, 16, 37, 64, 129, 250)):
        x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
        logits = torch.randn(tokens, experts, device="cuda", generator=gen)
        weights, ids = torch.topk(logits.softmax(-1), top_k)
        run_moe(x, w13, w2, weights.contiguous(), ids.to(torch.int32), config=config)
        torch.cuda.synchronize()
        if i == 1:
            before = moe_variants()
        elif i > 1:
            counts.append(tuple(a - b for a, b in zip(moe_variants(), before)))
    assert counts == [(0, 0, 0, 0, 0)] * len(counts), counts


def test_rms_norm_compiles_once_across_row_counts() -> None:
    weight = torch.ones(512, device="cuda", dtype=torch.bfloat16)
    counts = []
    for rows in (1, 3, 16, 17, 64, 100, 1000):  # the first call compiles what it needs
        x = torch.randn(rows, 512, device="cuda", dtype=torch.bfloat16)
        rms_norm_triton(x, weight, 1e-6, residual=torch.randn_like(x))
        torch.cuda.synchronize()
        counts.append(variants(rmsnorm_triton._kernels().rms_norm))
    assert counts == [counts[0]] * len(counts), counts


def test_routing_compiles_once_across_token_counts() -> None:
    from moeserve.kernels.routing import select_triton as routing_triton

    counts = torch.zeros(128, dtype=torch.int64, device="cuda")
    seen = []
    for tokens in (1, 3, 16, 37, 64, 129, 1000):  # the first call compiles what it needs
        logits = torch.randn(tokens, 128, device="cuda", dtype=torch.bfloat16)
        mask = torch.ones(tokens, dtype=torch.int64, device="cuda")
        routing_triton.select_experts_triton(logits, 8, True, counts=counts, count_mask=mask)
        torch.cuda.synchronize()
        seen.append(variants(routing_triton._kernels().route))
    assert seen == [seen[0]] * len(seen), seen


def test_split_decode_compiles_once_across_split_counts() -> None:
    kern = paged_attention_triton._kernels()
    seen = []
    for context in (300, 900, 3000):  # one decode row: 2, 4 and 12 context partitions
        step = gpu_step([context, 0], [1, 40], seed=context)
        run_attention(step.q, step.kv_cache, step.meta, step.scale)
        torch.cuda.synchronize()
        seen.append(variants(kern.decode_reduce))
    assert seen == [seen[0]] * len(seen) and seen[0] >= 1, seen


def test_qk_rope_kv_compiles_once_across_token_counts() -> None:
    """Positions and slots sliced at any offset of a packed buffer (as the runner's may be)."""
    from moeserve.kernels.attention import qk_rope_kv_triton
    from moeserve.layers.rope import _cos_sin_table

    heads, kv_heads, head_dim = 32, 4, 128
    cos, sin = _cos_sin_table(head_dim, 4096, 1e6, torch.device("cuda"))
    kv_cache = torch.zeros(2, 128, 16, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    weight = torch.ones(head_dim, device="cuda", dtype=torch.bfloat16)
    packed = torch.arange(2048, device="cuda").repeat(2, 1)  # [2, 2048]: positions; slots
    before, counts = None, []
    for offset, tokens in enumerate((1, 3, 16, 17, 64, 100, 1000)):
        qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, device="cuda",
                          dtype=torch.bfloat16)
        positions, slots = packed[:, offset:offset + tokens]  # [T] each, misaligned by offset
        qk_rope_kv_triton.qk_rope_kv_triton(qkv, positions, cos, sin, kv_cache, slots, heads,
                                            kv_heads, weight, weight, 1e-6)
        torch.cuda.synchronize()
        seen = variants(qk_rope_kv_triton._kernels().qk_rope_kv)
        if before is None:  # the first call compiles what it needs
            before = seen
        else:
            counts.append(seen - before)
    assert counts == [0] * len(counts), counts


def test_mla_rope_cache_compiles_once_across_token_counts() -> None:
    """DeepSeek-V3's layout (128 heads, L 512, R 64; q_lora: kv_a a view at q_part 1536 of
    in_proj's output); positions and slots sliced at any offset of a packed buffer."""
    from moeserve.kernels.attention.mla import rope_cache_triton as mla_rope_cache_triton

    heads, nope, rope_dim, rank, q_part = 128, 128, 64, 512, 1536
    angles = torch.arange(4096, device="cuda")[:, None] * torch.rand(rope_dim // 2,
                                                                     device="cuda")
    cos, sin = angles.cos(), angles.sin()  # [P, R / 2] fp32
    cache = torch.zeros(128, 16, rank + rope_dim, device="cuda", dtype=torch.bfloat16)
    weight = torch.ones(rank, device="cuda", dtype=torch.bfloat16)
    packed = torch.arange(2048, device="cuda").repeat(2, 1)  # [2, 2048]: positions; slots
    before, counts = None, []
    for offset, tokens in enumerate((1, 3, 16, 17, 64, 100, 1000)):
        a = torch.randn(tokens, q_part + rank + rope_dim, device="cuda", dtype=torch.bfloat16)
        q = torch.randn(tokens, heads, nope + rope_dim, device="cuda", dtype=torch.bfloat16)
        positions, slots = packed[:, offset:offset + tokens]  # [T] each, misaligned by offset
        mla_rope_cache_triton.mla_rope_cache_triton(a[:, q_part:], q, positions, cos, sin,
                                                    weight, 1e-6, cache, slots, True)
        torch.cuda.synchronize()
        seen = variants(mla_rope_cache_triton._kernels().mla_rope_cache)
        if before is None:  # the first call compiles what it needs
            before = seen
        else:
            counts.append(seen - before)
    assert counts == [0] * len(counts), counts
