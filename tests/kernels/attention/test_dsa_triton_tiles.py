"""The indexer's query tiles (attention/dsa/indexer_triton.py, issue 17): programs of BLOCK_Q
consecutive tokens of one row sharing each loaded key tile, against `indexer_topk_ref` exactly.

Prefill chunks of 1, 3, 17 and 64 tokens of one request, fresh and after a prefix that ends
mid-block and mid-key-tile; two requests of different contexts in one step (one a decode, a tile
of one); contexts shorter than topk; block tables scattered over the pool (make_step shuffles
them), block sizes 16 and 6 (blocks straddling key tiles); 5 heads (padded to 8, 16 tokens a
tile), 8 (16 a tile), 64 (2 a tile) and GLM-5's 32 x 128 (4 a tile); fp32 and fp16; the
long-step chunking in whole tiles.

Why exact equality holds: the kernel's scores equal the reference's to fp32 rounding only (the
dot's and the head sum's order are the compiler's). Integer-valued data is exact in any order:
`_integers` (ties in bulk, broken to the lowest position in both) and `_wide_integers` (scores
spread wide); each random case first checks that its data has no near-tie the rounding could
flip (`assert_far_apart`, against fp64), so its exactness is no accident of one platform's
summation order.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moeserve.kernels.attention.dsa import indexer_triton as dsa_triton
from moeserve.kernels.attention.dsa.indexer_triton import index_block_q, indexer_topk_triton
from tests.kernels.attention.test_dsa_triton import (
    DIM,
    HEADS,
    TOPK,
    Step,
    _integers,
    check_topk,
    make_step,
)

SCALE = DIM ** -0.5


def assert_far_apart(step: Step, topk: int, scale: float = SCALE, margin: float = 4.0) -> None:
    """The reference's scores against fp64, a token at a time: each token's top-k + 1 are equal
    or apart by more than their slack: `margin` times the reference's own fp32 error (its
    largest |fp32 - fp64| in the step; the kernel's sums, the same operations in another order,
    err alike) plus, for each of the two keys, what its heads whose q . k lies that close to
    the ReLU's kink could move it (another rounding may flip those); an exact tie needs no such
    head."""
    meta, flat = step.meta, step.cache.view(-1, step.cache.shape[-1])
    rows = []
    for tok, (row, p) in enumerate(zip(meta.token_to_req.tolist(), meta.positions.tolist())):
        keys = flat[torch.tensor(step.slots(row, p + 1))]  # [p + 1, D]
        dots = step.q[tok].float() @ keys.float().T * scale  # [H, p + 1]
        exact = step.q[tok].double() @ keys.double().T * scale
        score = step.w[tok] @ torch.relu(dots)  # [p + 1]
        err = (score - step.w[tok].double() @ torch.relu(exact)).abs().max()
        rows.append((dots, exact, score, float(err), float((dots - exact).abs().max())))
    err = max(r[3] for r in rows)
    dot_err = max(r[4] for r in rows)
    for tok, (_, exact, score, _, _) in enumerate(rows):
        near = exact.abs() <= margin * dot_err  # [H, p + 1]
        flip = (step.w[tok].abs().double()[:, None] * exact.abs() * near).sum(0)  # [p + 1]
        best = score.sort(descending=True)
        top, idx = best.values[:topk + 1], best.indices[:topk + 1]
        gap = (top[:-1] - top[1:]).double()
        move = flip[idx[:-1]] + flip[idx[1:]]
        bad = torch.where(gap == 0, move > 0, gap <= margin * err + move)
        assert not bad.any(), (tok, gap[bad].tolist(), move[bad].tolist(), err)


def _wide_integers(step: Step, seed: int = 9) -> None:
    """Integers in [-8, 8], weights in eighths in [-1, 1]: with scale 1/4 every score is exact
    in fp32 in any order (|q . k| <= 64 D, sums of 32nds below 2^24) and spread wide."""
    gen = torch.Generator().manual_seed(seed)
    for t in (step.q, step.cache):
        t.copy_(torch.randint(-8, 9, t.shape, generator=gen).to(t.dtype))
    step.w.copy_(torch.randint(-8, 9, step.w.shape, generator=gen) * 0.125)


def check_tiled(step: Step, topk: int = TOPK, random: bool = True) -> torch.Tensor:
    """check_topk, after checking the data has no near-tie (random data)."""
    if random:
        assert_far_apart(step, topk)
    pos, _ = check_topk(step, topk=topk)
    return pos


def tiles_of(step: Step, heads: int = HEADS) -> list[tuple[int, int]]:
    """The (first token, tokens) query tiles the step's last call scored (its meta.derived)."""
    tiles = [v[0] for k, v in step.meta.derived.items() if k[0] == "indexer_topk_triton"]
    assert len(tiles) == 1 and index_block_q(heads) > 1
    return [tuple(t) for t in tiles[0].tolist()]


@pytest.mark.parametrize("block_size", [16, 6])
@pytest.mark.parametrize("computed", [0, 37])
@pytest.mark.parametrize("chunk", [1, 3, 17, 64])
def test_a_prefill_chunk_of_one_request(chunk: int, computed: int, block_size: int) -> None:
    """One request's chunk, fresh (contexts from 1, below topk, on) or after 37 positions."""
    step = make_step([computed], [chunk], block_size, seed=chunk + computed)
    pos = check_tiled(step)
    assert ((pos >= 0).sum(-1) == (step.meta.positions + 1).clamp(max=TOPK)).all()
    if chunk > 1:  # a single decode token runs the one-token path
        bq = index_block_q(HEADS)
        assert tiles_of(step) == [(t, min(bq, chunk - t)) for t in range(0, chunk, bq)]
    for force in (_integers, _wide_integers):
        step = make_step([computed], [chunk], block_size, seed=chunk + computed + 1)
        force(step)
        check_topk(step, scale=0.25)


@pytest.mark.parametrize("block_size", [16, 6])
@pytest.mark.parametrize(("computed", "scheduled", "seed"), [
    ([50, 0], [1, 17], 18),  # a decode of 51 and a fresh prefill, 1 to 17 positions
    ([5, 40], [20, 1], 21),  # a chunk after 5 (contexts 6..25) and a decode of 41
    ([70, 3, 0], [64, 1, 5], 11),  # a chunk after 70, a short decode, a prefill below topk
])
def test_two_requests_one_a_decode(computed: list[int], scheduled: list[int], seed: int,
                                   block_size: int) -> None:
    step = make_step(computed, scheduled, block_size, seed=seed)
    check_tiled(step, topk=24)  # contexts shorter and longer than topk in one step
    first = np.cumsum([0] + scheduled)
    assert all((first[b], 1) in tiles_of(step) for b in range(len(scheduled))
               if scheduled[b] == 1)  # each decode row: a tile of one
    step = make_step(computed, scheduled, block_size, seed=seed + 1)
    _integers(step)
    _, ties = check_topk(step, scale=0.25)
    assert ties > 0


@pytest.mark.parametrize("heads", [5, 64])
def test_head_counts_and_tile_heights(heads: int) -> None:
    """5 heads: padded to 8 in the dot, 16 tokens a tile; 64: 2 tokens a tile (17 = 8 x 2 + 1)."""
    assert index_block_q(heads) == {5: 16, 64: 2}[heads]
    step = make_step([9, 0], [17, 1], 6, heads=heads, seed=heads)
    check_tiled(step)
    assert len(tiles_of(step, heads)) == -(-17 // index_block_q(heads)) + 1
    step = make_step([9, 0], [17, 1], 6, heads=heads, seed=heads)
    _wide_integers(step)
    check_topk(step, scale=0.25)


@pytest.mark.parametrize(("computed", "scheduled"), [([0], [64]), ([150, 0, 40], [1, 67, 33])])
def test_glm5_indexer_shape(computed: list[int], scheduled: list[int]) -> None:
    """GLM-5's 32 heads x 128 (4 tokens a tile, 64 keys a program), blocks of 64, topk 48."""
    step = make_step(computed, scheduled, 64, heads=32, dim=128, seed=3)
    assert_far_apart(step, 48, scale=128 ** -0.5)
    check_topk(step, topk=48, scale=128 ** -0.5)
    assert len(tiles_of(step, 32)) == sum(-(-s // 4) for s in scheduled)
    _wide_integers(step)
    check_topk(step, topk=48, scale=0.25)


def test_fp16_tiles() -> None:
    step = make_step([37, 0], [64, 3], 16, dtype=torch.float16, seed=9)
    check_tiled(step, topk=16)


def test_query_tiles_and_their_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows cut into tiles from each row's first token; chunks of whole tiles within the key
    budget, or one tile when a tile alone is over it (a tile is never split)."""
    step = make_step([0, 10, 4], [40, 1, 20], 16)
    tiles, chunks = dsa_triton._query_tiles(step.meta, 16, 20, torch.device("cpu"))
    assert tiles.tolist() == [[0, 16], [16, 16], [32, 8], [40, 1], [41, 16], [57, 4]]
    assert chunks == [(0, 16, slice(0, 1)), (16, 16, slice(1, 2)), (32, 9, slice(2, 4)),
                      (41, 20, slice(4, 6))]
    _, chunks = dsa_triton._query_tiles(step.meta, 16, 5, torch.device("cpu"))
    assert [c[:2] for c in chunks] == [(0, 16), (16, 16), (32, 8), (40, 1), (41, 16), (57, 4)]
    # scored that way: S = 40 keys, 160 keys a chunk -> 4 tokens -> one tile a launch
    monkeypatch.setattr(dsa_triton, "_CHUNK_KEYS", 160)
    check_tiled(step)


def test_query_lengths_must_cover_the_tokens() -> None:
    step = make_step([0, 3], [5, 1], 16)
    step.meta.query_lens_np = step.meta.query_lens_np.copy()
    step.meta.query_lens_np[0] = 4
    with pytest.raises(ValueError, match="query lengths sum to 5, not its 6 tokens"):
        indexer_topk_triton(step.q, step.w, step.cache, step.meta, SCALE, TOPK)
