"""The Triton DSA kernels (kernels/attention/dsa/indexer_triton.py) against the torch references of
kernels/attention/dsa/reference.py.

Indexer top-k: exactly the reference's positions in its order (the top-k by score, ties to the
lowest position, in ascending position order, -1 after them for a short context) and the same
boundary-tie count, for pure decode, prefill from 0, chunks after a prefix and mixed steps,
contexts shorter than, equal to and longer than topk, block sizes 16 and 6; on random data and
on data with forced ties (ReLU zero on every head, with all-negative weights putting those zeros
at the top; duplicated keys; integer-valued data whose scores are exact and tie in bulk). Sparse
MLA: dsa_attention_ref's output within 1e-5 (fp32) or 3e-3 (fp16), with -1 padding, holes, a
first tile of nothing and a token with no position (zeros, where the reference's softmax over
nothing gives NaN).

CPU through Triton's interpreter (tests/conftest.py sets it; fp32 and fp16, tiny dims); the GPU
cases at GLM-5's shapes are test_dsa_triton_gpu.py's.
"""

from __future__ import annotations

import random
import subprocess
import sys
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from moeserve.kernels.attention.dsa import indexer_triton as dsa_triton
from moeserve.kernels.attention.dsa.indexer_triton import indexer_topk_triton
from moeserve.kernels.attention.dsa.reference import dsa_attention_ref, indexer_topk_ref
from moeserve.kernels.attention.dsa.sparse_triton import dsa_attention_triton
from moeserve.kernels.attention.metadata import AttentionMetadata, build_attention_metadata
from moeserve.kernels.attention.mla.absorbed_triton import mla_attention_triton
from moeserve.kernels.attention.mla.reference import mla_attention_ref
from moeserve.kernels.registry import DSA_BACKENDS, dsa_backend_for

HEADS, DIM, TOPK = 8, 16, 8
L, R = 32, 16
TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}
STEPS = {  # (computed, scheduled): contexts below, at and above TOPK in each
    "decode": ([20, 3, 7, 40], [1, 1, 1, 1]),
    "prefill": ([0, 0, 0], [5, 8, 30]),
    "chunk_after_prefix": ([3, 33], [9, 17]),
    "mixed": ([20, 0, 7, 33, 2], [1, 17, 1, 9, 1]),
}


@dataclass
class Step:
    meta: AttentionMetadata
    tables: list[list[int]]
    cache: torch.Tensor  # [num_blocks, block_size, D] indexer keys
    q: torch.Tensor  # [T, H, D]
    w: torch.Tensor  # [T, H] fp32

    def slots(self, row: int, num: int) -> list[int]:
        """The cache slots of row `row`'s first `num` positions."""
        bs = self.meta.block_size
        return [self.tables[row][s // bs] * bs + s % bs for s in range(num)]


def make_step(computed: list[int], scheduled: list[int], block_size: int, *,
              heads: int = HEADS, dim: int = DIM, dtype: torch.dtype = torch.float32,
              device: str = "cpu", seed: int = 0) -> Step:
    """A step's metadata over scattered blocks, random keys in every slot, random queries and
    fp32 weights (weights_proj(x) * H^-0.5's scale)."""
    rng = random.Random(seed)
    need = [-(-(c + s) // block_size) for c, s in zip(computed, scheduled)]
    num_blocks = sum(need) + 2
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(n)] for n in need]
    meta = build_attention_metadata(computed, scheduled, tables, block_size, device)
    gen = torch.Generator().manual_seed(seed)
    cache = torch.randn(num_blocks, block_size, dim, generator=gen).to(device, dtype)
    q = torch.randn(meta.num_tokens, heads, dim, generator=gen).to(device, dtype)
    w = (torch.randn(meta.num_tokens, heads, generator=gen) * heads ** -0.5).to(device)
    return Step(meta, tables, cache, q, w)


def check_topk(step: Step, topk: int = TOPK, scale: float = DIM ** -0.5) -> tuple[torch.Tensor,
                                                                                 int]:
    """Triton's selection == the reference's, exactly, and the same boundary-tie count."""
    got, ties = indexer_topk_triton(step.q, step.w, step.cache, step.meta, scale, topk,
                                    count_boundary_ties=True)
    want, want_ties = indexer_topk_ref(step.q, step.w, step.cache, step.meta, scale, topk,
                                       count_boundary_ties=True)
    assert got.dtype == torch.int32 and got.shape == (step.meta.num_tokens, topk)
    assert torch.equal(got, want)
    assert ties == want_ties
    return got, ties


# ---------------------------------------------------------------- CPU, Triton's interpreter

@pytest.mark.parametrize("block_size", [16, 6])
@pytest.mark.parametrize("name", list(STEPS))
def test_topk_equals_the_reference(block_size: int, name: str) -> None:
    pos, _ = check_topk(make_step(*STEPS[name], block_size))
    assert (pos == -1).any() and (pos[:, -1] >= 0).any()  # short and long contexts both ran


def test_topk_fp16_and_a_topk_past_every_context() -> None:
    check_topk(make_step(*STEPS["mixed"], 16, dtype=torch.float16, seed=1))
    pos, _ = check_topk(make_step(*STEPS["mixed"], 16, seed=2), topk=64)  # all of each context
    assert ((pos >= 0).sum(-1) == make_step(*STEPS["mixed"], 16).meta.positions + 1).all()


def _relu_zero(step: Step) -> None:
    """Positive queries; half of every row's keys negative: q . k < 0 on every head, so those
    scores are exactly zero; the tokens whose weights are all negative score every other key
    below zero, so their zeros tie at the top."""
    step.q.abs_()
    step.w[::2].copy_(-step.w[::2].abs())
    flat = step.cache.view(-1, step.cache.shape[-1])
    gen = torch.Generator().manual_seed(5)
    for row, seq in enumerate(step.meta.seq_lens_np.tolist()):
        slots = torch.tensor(step.slots(row, seq))
        zero = slots[torch.randperm(seq, generator=gen)[:seq // 2]]
        flat[zero] = -flat[zero].abs()


def _duplicates(step: Step) -> None:
    """Every third position of each row holds the same key as its row's position 1."""
    flat = step.cache.view(-1, step.cache.shape[-1])
    for row, seq in enumerate(step.meta.seq_lens_np.tolist()):
        slots = step.slots(row, seq)
        flat[slots[::3]] = flat[slots[1]].clone()


def _integers(step: Step, seed: int = 6) -> None:
    """Small integers (weights in quarters): every score exact in any summation order, and
    equal scores everywhere."""
    gen = torch.Generator().manual_seed(seed)
    for t in (step.q, step.cache):
        t.copy_(torch.randint(-2, 3, t.shape, generator=gen).to(t.dtype))
    step.w.copy_(torch.randint(-2, 3, step.w.shape, generator=gen) * 0.25)


@pytest.mark.parametrize("block_size", [16, 6])
@pytest.mark.parametrize("force", [_relu_zero, _duplicates, _integers])
def test_forced_ties_break_to_the_lowest_position(block_size: int, force: object) -> None:
    step = make_step(*STEPS["mixed"], block_size, seed=3)
    force(step)  # type: ignore[operator]
    _, ties = check_topk(step, scale=0.25)
    if force is not _duplicates:  # these two tie at the k-th place somewhere, by construction
        assert ties > 0


@pytest.mark.parametrize("key_tiles", [1, 3])
@pytest.mark.parametrize("name", list(STEPS))
def test_scoring_programs_walking_several_key_tiles(monkeypatch: pytest.MonkeyPatch,
                                                    key_tiles: int, name: str) -> None:
    """score_key_tiles: a scoring program over several key tiles (3: spans ending inside a
    row's context and past it) selects as the reference does, ties included."""
    monkeypatch.setattr(dsa_triton, "score_key_tiles", key_tiles)
    step = make_step(*STEPS[name], 16, seed=7)
    _integers(step)
    check_topk(step, scale=0.25)


def test_prefill_scored_in_chunks_of_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    # 42 keys a row, 100 keys a chunk: two tokens per launch
    monkeypatch.setattr(dsa_triton, "_CHUNK_KEYS", 100)
    check_topk(make_step(*STEPS["mixed"], 16, seed=4))


def test_decode_reads_no_host_lengths() -> None:
    """Only meta.max_seq_len is read on the host: placeholder host lengths (a CUDA-graph
    decode's) change nothing, and a max_seq_len below topk pads with -1."""
    step = make_step(*STEPS["decode"], 16)
    want, _ = check_topk(step)
    step.meta.seq_lens_np = step.meta.query_lens_np = np.ones(4, dtype=np.int64)
    step.meta.exact_host_lens = False
    got, _ = indexer_topk_triton(step.q, step.w, step.cache, step.meta, DIM ** -0.5, TOPK)
    assert torch.equal(got, want)
    short = make_step([2, 4], [1, 1], 16)
    pos, _ = check_topk(short)
    assert ((pos >= 0).sum(-1) == torch.tensor([3, 5])).all()


def _latents(meta: AttentionMetadata, heads: int, dtype: torch.dtype, device: str = "cpu",
             seed: int = 0, width: int = L + R) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed queries [T, H, width = L + R] and a latent cache over meta's blocks."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = int(meta.block_tables.max()) + 1
    latent = torch.randn(num_blocks, meta.block_size, width, generator=gen)
    q = torch.randn(meta.num_tokens, heads, width, generator=gen)
    return q.to(device, dtype), latent.to(device, dtype)


@pytest.mark.parametrize("block_size", [16, 6])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_sparse_attention_equals_the_reference(block_size: int, dtype: torch.dtype) -> None:
    """Over the indexer's own selection (-1 padding on the short contexts), 5 heads."""
    step = make_step(*STEPS["mixed"], block_size)
    positions, _ = indexer_topk_ref(step.q, step.w, step.cache, step.meta, 0.25, TOPK)
    q, latent = _latents(step.meta, 5, dtype)
    got = dsa_attention_triton(q, latent, step.meta, positions, 0.1, L)
    want = dsa_attention_ref(q, latent, step.meta, positions, 0.1, L)
    assert got.shape == (step.meta.num_tokens, 5, L) and got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("num_splits", [1, 3])
def test_packed_selection_stops_at_the_context(num_splits: int) -> None:
    """packed=True (what the DSA layer passes: an indexer's selection holds its valid
    positions first, at most position + 1 of them): the same bits as reading every slot; and
    the loop really stops there, since a position planted after a token's first position + 1
    slots changes the unpacked result but not the packed one."""
    step = make_step(*STEPS["mixed"], 16)
    positions, _ = indexer_topk_ref(step.q, step.w, step.cache, step.meta, 0.25, TOPK)
    q, latent = _latents(step.meta, 5, torch.float32)
    args = (q, latent, step.meta, positions)
    full = dsa_attention_triton(*args, 0.1, L, num_splits=num_splits)
    packed = dsa_attention_triton(*args, 0.1, L, num_splits=num_splits, packed=True)
    torch.testing.assert_close(packed, full, atol=0, rtol=0)
    seen = step.meta.positions.cpu() + 1
    short = int(torch.nonzero((seen > 1) & (seen < TOPK))[0])  # several keys, then -1 slots
    assert positions[short, -1] == -1
    planted = positions.clone()
    planted[short, -1] = 0  # position 0 a second time (its weight doubles), past the count
    moved = dsa_attention_triton(q, latent, step.meta, planted, 0.1, L, num_splits=num_splits)
    assert not torch.equal(moved[short], full[short])
    kept = dsa_attention_triton(q, latent, step.meta, planted, 0.1, L, num_splits=num_splits,
                                packed=True)
    torch.testing.assert_close(kept, full, atol=0, rtol=0)


def test_sparse_attention_grid_orders_give_the_same_bits(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    """Head tiles first in the grid (the default) and tokens first (past the grid's y limit,
    forced here by a limit of 0) compute the same output."""
    from moeserve.kernels.attention.mla import absorbed_triton as mla_triton

    step = make_step(*STEPS["mixed"], 16)
    positions, _ = indexer_topk_ref(step.q, step.w, step.cache, step.meta, 0.25, TOPK)
    q, latent = _latents(step.meta, 20, torch.float32)  # 20 heads: two head tiles
    tiles_first = dsa_attention_triton(q, latent, step.meta, positions, 0.1, L)
    monkeypatch.setattr(mla_triton, "MAX_GRID_Y", 0)
    tokens_first = dsa_attention_triton(q, latent, step.meta, positions, 0.1, L)
    torch.testing.assert_close(tiles_first, tokens_first, atol=0, rtol=0)


def _holey_selection(step: Step, topk: int, seed: int) -> torch.Tensor:
    """[T, topk] int32: each token's visible positions (at most topk) in random order at
    random slots, -1 in the others."""
    gen = torch.Generator().manual_seed(seed)
    pos = torch.full((step.meta.num_tokens, topk), -1, dtype=torch.int32)
    for tok, p in enumerate(step.meta.positions.tolist()):
        pick = torch.randperm(p + 1, generator=gen)[:topk]
        pos[tok, torch.randperm(topk, generator=gen)[:len(pick)]] = pick.int()
    return pos


def test_sparse_attention_skips_holes_and_writes_zeros_for_nothing() -> None:
    """topk 40 (two and a half tiles of 16), 20 heads (two tiles of 10): positions in random
    order with -1 holes, the first tile of one token all -1, and a token with none selected,
    which gets zeros (the reference: NaN, a softmax over nothing)."""
    step = make_step(*STEPS["mixed"], 6)
    pos = _holey_selection(step, 40, seed=7)
    pos[1] = -1  # position 0 of a fresh prefill: its one key past the 1st tile of 16
    pos[1, 20] = 0
    pos[2] = -1
    q, latent = _latents(step.meta, 20, torch.float32)
    got = dsa_attention_triton(q, latent, step.meta, pos, 0.1, L)
    want = dsa_attention_ref(q, latent, step.meta, pos, 0.1, L)
    assert want[2].isnan().all() and torch.equal(got[2], torch.zeros_like(got[2]))
    keep = torch.arange(step.meta.num_tokens) != 2
    torch.testing.assert_close(got[keep], want[keep], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_splits", [1, 2, 3, 64])
def test_sparse_attention_split_selection_is_the_same(num_splits: int) -> None:
    """The selection cut into partitions (programs of their own, combined by mla_triton's
    reduce), with holes and a token of none: the unsplit result (zeros for that token), and
    the default split count over few tokens is more than one."""
    from moeserve.kernels.attention.mla import absorbed_triton as mla_triton

    step = make_step(*STEPS["mixed"], 6)
    pos = _holey_selection(step, 40, seed=8)
    pos[2] = -1
    q, latent = _latents(step.meta, 20, torch.float32)
    want = dsa_attention_triton(q, latent, step.meta, pos, 0.1, L, num_splits=1)
    got = dsa_attention_triton(q, latent, step.meta, pos, 0.1, L, num_splits=num_splits)
    assert torch.equal(got[2], torch.zeros_like(got[2]))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # few tokens: the default splits
    assert mla_triton.decode_num_splits(4, 1, 2048, torch.device("cpu")) > 1
    with pytest.raises(ValueError, match="num_splits must be in 1..64"):
        dsa_attention_triton(q, latent, step.meta, pos, 0.1, L, num_splits=65)


def test_sparse_attention_over_every_position_is_the_dense_mla() -> None:
    step = make_step(*STEPS["chunk_after_prefix"], 16)
    every, _ = indexer_topk_ref(step.q, step.w, step.cache, step.meta, 0.25, 64)
    q, latent = _latents(step.meta, 4, torch.float32)
    got = dsa_attention_triton(q, latent, step.meta, every, 0.1, L)
    torch.testing.assert_close(got, mla_attention_ref(q, latent, step.meta, 0.1, L),
                               atol=1e-5, rtol=1e-5)


def test_empty_step() -> None:
    meta = build_attention_metadata([], [], [], 4, "cpu")
    pos, ties = indexer_topk_triton(torch.randn(0, 8, 16), torch.randn(0, 8),
                                    torch.zeros(2, 4, 16), meta, 0.25, TOPK)
    assert pos.shape == (0, TOPK) and ties == 0
    out = dsa_attention_triton(torch.randn(0, 4, L + R), torch.zeros(2, 4, L + R), meta,
                               torch.zeros(0, TOPK, dtype=torch.int32), 0.1, L)
    assert out.shape == (0, 4, L)


@pytest.mark.parametrize(("change", "message"), [
    (lambda s: setattr(s, "w", s.w.half()), "weights must be fp32"),
    (lambda s: setattr(s, "w", s.w[:, :4]), r"weights must be \[T, H\]"),
    (lambda s: setattr(s, "cache", s.cache.half()), "index_cache dtype"),
    (lambda s: (setattr(s, "q", s.q[..., :12]),
                setattr(s, "cache", s.cache[..., :12].contiguous())),
     "index head dim 12 must be a power of two"),
    (lambda s: (setattr(s, "q", s.q.bfloat16()), setattr(s, "cache", s.cache.bfloat16())),
     "bf16 is not supported on CPU"),
    (lambda s: setattr(s.meta, "block_size", 8), "meta.block_size 8"),
    (lambda s: setattr(s.meta, "positions", s.meta.positions.int()), "meta.positions"),
    (lambda s: setattr(s, "q", s.q[:2]), "q has 2 tokens, meta 6"),
])
def test_indexer_bad_input_is_named(change: object, message: str) -> None:
    step = make_step([3, 0], [1, 5], 4)
    change(step)  # type: ignore[operator]
    with pytest.raises(ValueError, match=f"indexer_topk_triton: {message}"):
        indexer_topk_triton(step.q, step.w, step.cache, step.meta, 0.25, TOPK)


@pytest.mark.parametrize(("change", "message"), [
    (lambda a: a.update(pos=a["pos"].long()), "positions must be int32"),
    (lambda a: a.update(pos=a["pos"][:3]), r"positions must be \[T, topk\] with T = 6"),
    (lambda a: a.update(latent=a["latent"].half()), "latent_cache dtype"),
    (lambda a: a.update(rank=24), "kv_lora_rank 24 must be a power of two"),
    (lambda a: a.update(q=a["q"][..., :40], latent=a["latent"][..., :40].contiguous()),
     r"rope dims R = 40 - 32 = 8"),
])
def test_attention_bad_input_is_named(change: object, message: str) -> None:
    step = make_step([3, 0], [1, 5], 4)
    q, latent = _latents(step.meta, 4, torch.float32)
    args = {"q": q, "latent": latent, "pos": torch.zeros(6, TOPK, dtype=torch.int32), "rank": L}
    change(args)  # type: ignore[operator]
    with pytest.raises(ValueError, match=f"dsa_attention_triton: {message}"):
        dsa_attention_triton(args["q"], args["latent"], step.meta, args["pos"], 0.1,
                             args["rank"])


def test_cpu_tensors_need_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    step = make_step([3], [1], 4)
    with pytest.raises(ValueError, match="CPU tensors need Triton's interpreter"):
        indexer_topk_triton(step.q, step.w, step.cache, step.meta, 0.25, TOPK)


def test_the_triton_mla_backend_takes_the_triton_dsa_ops() -> None:
    assert dsa_backend_for(mla_attention_triton) is DSA_BACKENDS["triton"]
    assert dsa_backend_for(mla_attention_ref) is DSA_BACKENDS["torch"]
    assert dsa_backend_for(lambda *a: None) is DSA_BACKENDS["torch"]  # a test's own function
    assert DSA_BACKENDS["triton"] == (indexer_topk_triton, dsa_attention_triton)


def test_import_does_not_import_triton() -> None:
    code = ("import sys, moeserve.kernels.attention.dsa.indexer_triton; "
            "assert 'triton' not in sys.modules, 'triton imported'")
    result = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stderr
