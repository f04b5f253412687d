"""DSA's radix top-k (attention/dsa/topk_triton.py, issue 17) against a torch reference of its
contract, exactly: each token's topk largest scores among its first end(t) positions, ties to
the lowest position, returned in ascending position order with -1 after; a context of at most
topk selects all of it.

The scores are built to reach each part of the select: random fp32 (the top digit decides),
values one ulp apart (the low 10-bit digit decides), few distinct values (ties at the threshold
spread over several chunks, taken lowest first across chunk boundaries), negative and zero
scores (-0.0 and +0.0 are one score), and garbage past each token's end (never read). Chunks of
16 and 64 positions make rows span several programs (the write's offsets, the ties' ranks);
2,048 is the default. Then the whole indexer with small chunks, against `indexer_topk_ref`.
Every test runs in each of radix_topk's forms ("row": a program a token, the chunk its step;
"chunks": programs over (token, chunk); "coop": the chunks form's passes in one launch, the
chunk its step, one program a token on CPU, several on the GPU; "bisect": a program a token,
its row in registers, the chunk unused), by the `form` fixture, as the module's default;
"auto" picks by the token count and the rows' length.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from moeserve.kernels.attention.dsa import topk_triton
from moeserve.kernels.attention.dsa.indexer_triton import indexer_topk_triton
from moeserve.kernels.attention.dsa.reference import indexer_topk_ref
from moeserve.kernels.attention.dsa.topk_triton import radix_topk
from tests.kernels.attention.test_dsa_triton import DIM, STEPS, TOPK, make_step

GARBAGE = 7777  # what out holds before a call: the top-k writes every place


@pytest.fixture(autouse=True, params=("row", "chunks", "coop", "bisect", "row+gather",
                                      "chunks+gather", "coop+gather"))
def form(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each test in each form, set as the default (the indexer's calls take it too); "+gather"
    with topk_triton.GATHER (the last two levels over the gathered scores of the threshold's
    16-bit bin)."""
    form, _, gather = request.param.partition("+")
    monkeypatch.setattr(topk_triton, "FORM", form)
    monkeypatch.setattr(topk_triton, "GATHER", bool(gather))
    return form


def ord_of(scores: torch.Tensor) -> torch.Tensor:
    """fp32 -> the int32 of the same order (the score kernel's): -0.0 made +0.0, then the
    magnitude bits flipped for negatives."""
    bits = torch.where(scores == 0, 0.0, scores).float().view(torch.int32)
    return torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


def test_scores_fp32_inverts_the_ord() -> None:
    """indexer_triton.scores_fp32: the ords back to their fp32 scores (-0.0 as +0.0), so a
    check of two scorings' values measures floats, not ord distances."""
    from moeserve.kernels.attention.dsa.indexer_triton import scores_fp32

    scores = torch.tensor([1.5, -2.25, 0.0, -0.0, -1e-30, 1e-30, 3e38, -3e38])
    back = scores_fp32(ord_of(scores))
    assert torch.equal(back, torch.where(scores == 0, 0.0, scores))
    assert not torch.signbit(back[3])
    assert torch.equal(ord_of(scores).argsort(stable=True), back.argsort(stable=True))


def want_topk(scores: torch.Tensor, ends: list[int], topk: int) -> tuple[torch.Tensor, int]:
    """The contract in torch: (positions [n, topk], tokens with a tie at the boundary)."""
    out = torch.full((len(ends), topk), -1, dtype=torch.int32)
    ties = 0
    for i, end in enumerate(ends):
        row = torch.where(scores[i, :end] == 0, 0.0, scores[i, :end])
        order = torch.sort(row, descending=True, stable=True)  # ties: lowest position first
        take = order.indices[:topk].sort().values
        out[i, :len(take)] = take.to(torch.int32)
        ties += int(end > topk and order.values[topk - 1] == order.values[topk])
    return out, ties


def rows_meta(ends: list[int]) -> SimpleNamespace:
    """What radix_topk reads of the metadata: token i is the last token of row i, at position
    end - 1 (a decode), its row's seq_len end; an end of 0 is a padding token."""
    n = len(ends)
    return SimpleNamespace(positions=torch.tensor([max(e - 1, 0) for e in ends]),
                           seq_lens=torch.tensor(ends, dtype=torch.int32),
                           token_to_req=torch.arange(n))


def run(scores: torch.Tensor, ends: list[int], topk: int, chunk: int | None) -> None:
    """radix_topk over `scores` (garbage written past each end) equals want_topk, ties too."""
    keys = ord_of(scores)
    for i, end in enumerate(ends):  # never read: the largest scores there
        keys[i, end:] = 0x7F000000
    out = torch.full((len(ends), topk), GARBAGE, dtype=torch.int32)  # every place written
    ties = radix_topk(keys, rows_meta(ends), 0, topk, out,
                      chunk=chunk, count_boundary_ties=True)
    want, want_ties = want_topk(scores, ends, topk)
    assert torch.equal(out, want), (out, want)
    assert ties == want_ties


ENDS = [0, 1, 7, 8, 9, 16, 17, 63, 64, 65, 150, 200]


@pytest.mark.parametrize("chunk", [16, 64, 2048, None])  # None: the form's default
@pytest.mark.parametrize("topk", [1, 8, 37])
def test_random_scores(chunk: int | None, topk: int) -> None:
    gen = torch.Generator().manual_seed(topk * (chunk or 3))
    scores = torch.randn(len(ENDS), 200, generator=gen) * 3
    run(scores, ENDS, topk, chunk)


@pytest.mark.parametrize("chunk", [16, 64])
def test_scores_one_ulp_apart(chunk: int) -> None:
    """Every score within a few ulps of 1.5 (or of -1.5): the top two digits tie for all of
    them and the low 10 bits choose."""
    gen = torch.Generator().manual_seed(1)
    base = torch.tensor(1.5).view(torch.int32)
    ulps = torch.randint(0, 700, (4, 180), generator=gen, dtype=torch.int32)
    scores = (base + ulps).view(torch.float32)
    scores[2:] = -scores[2:]
    run(scores, [180, 150, 180, 97], 8, chunk)
    run(scores, [180, 150, 180, 97], 60, chunk)


@pytest.mark.parametrize("chunk", [16, 64])
@pytest.mark.parametrize("topk", [5, 8, 40])
def test_ties_at_the_threshold_span_chunks(chunk: int, topk: int) -> None:
    """Four distinct values (0 as both -0.0 and +0.0): the threshold's equal scores lie in
    several chunks; the lowest positions among them are taken, across chunk boundaries."""
    gen = torch.Generator().manual_seed(topk + chunk)
    values = torch.tensor([-0.0, 0.0, 0.5, 1.0, -2.0])
    scores = values[torch.randint(0, 5, (len(ENDS), 200), generator=gen)]
    run(scores, ENDS, topk, chunk)


@pytest.mark.parametrize("chunk", [16, 2048])
def test_all_equal_takes_the_first_positions(chunk: int) -> None:
    scores = torch.full((3, 100), 0.25)
    scores[1] = float("-inf")
    run(scores, [100, 60, 9], 8, chunk)
    out = torch.full((1, 8), GARBAGE, dtype=torch.int32)
    radix_topk(ord_of(scores[:1]), rows_meta([100]), 0, 8, out, chunk=chunk)
    assert out.tolist() == [list(range(8))]


def threshold_bin_count(scores: torch.Tensor, topk: int) -> int:
    """How many of a row's scores share the topk-th largest's top 16 bits of u (ord with its
    sign bit flipped): what GATHER places, where at most topk."""
    u = ord_of(scores).to(torch.int64) ^ 0x80000000  # as unsigned
    kth = torch.sort(scores, descending=True).values[topk - 1]
    top16 = u >> 16
    return int((top16 == (int(ord_of(kth.reshape(1))[0]) ^ 0x80000000) >> 16).sum())


@pytest.mark.parametrize("chunk", [16, 64])
@pytest.mark.parametrize("cluster", [25, 45, 70])
def test_the_threshold_in_a_bin_of_ulps(chunk: int, cluster: int) -> None:
    """30 scores above a cluster of scores a few ulps from 1.5 (one 16-bit bin: the last two
    digits choose), the rest below, topk 40 of 200: the threshold lies in the cluster. With
    GATHER a cluster of 25 (<= topk) is gathered in every form; one of 45 by the chunks form
    (its room: max(topk, 200 / GATHER_SHARE) = 50) and read from the row by the others; one
    of 70 read from the row in every form. Exact each way."""
    assert max(40, 200 // topk_triton.GATHER_SHARE) == 50
    gen = torch.Generator().manual_seed(cluster + chunk)
    rows = []
    for _ in range(3):
        ulps = torch.randperm(900, generator=gen)[:cluster].to(torch.int32)
        near = (torch.tensor(1.5).view(torch.int32) + ulps).view(torch.float32)
        high = 2.0 + torch.rand(30, generator=gen) * 5
        low = torch.rand(200 - 30 - cluster, generator=gen) * 2 - 1
        row = torch.cat([high, near, low])
        rows.append(row[torch.randperm(200, generator=gen)])
    scores = torch.stack(rows)
    assert all(threshold_bin_count(row, 40) == cluster for row in scores)
    run(scores, [200, 200, 200], 40, chunk)


def test_context_within_topk_selects_it_all_without_scores() -> None:
    """S <= topk: only the write runs (whole contexts, ascending); and a padding token (end
    0) selects nothing."""
    scores = torch.randn(3, 6)
    run(scores, [6, 2, 0], 8, 16)


def test_tokens_from_an_offset_and_a_chunk_past_the_context() -> None:
    """t0 > 0 reads tokens t0 .. of the metadata; scores wider than every context (a graph's
    bound): chunks past each end are read by no one."""
    gen = torch.Generator().manual_seed(3)
    ends = [30, 90, 12, 77]
    scores = torch.randn(4, 256, generator=gen)
    keys = ord_of(scores)
    out = torch.full((2, 8), GARBAGE, dtype=torch.int32)
    radix_topk(keys[2:].contiguous(), rows_meta(ends), 2, 8, out, chunk=16)
    assert torch.equal(out, want_topk(scores[2:], ends[2:], 8)[0])


def test_a_context_past_the_scores_is_cut_to_them() -> None:
    """A token whose context runs past the scores' row (a graph bound a context outgrew: a
    bug elsewhere) selects within the row; nothing is read past it."""
    gen = torch.Generator().manual_seed(5)
    scores = torch.randn(2, 100, generator=gen)
    out = torch.full((2, 8), GARBAGE, dtype=torch.int32)
    radix_topk(ord_of(scores), rows_meta([300, 50]), 0, 8, out, chunk=16)
    assert torch.equal(out, want_topk(scores, [100, 50], 8)[0])


def test_bad_chunk_and_form() -> None:
    args = (torch.zeros(1, 4, dtype=torch.int32), rows_meta([4]), 0, 2,
            torch.full((1, 2), -1, dtype=torch.int32))
    with pytest.raises(ValueError, match="chunk must be a power of two >= 16, got 24"):
        radix_topk(*args, chunk=24)
    with pytest.raises(ValueError, match="form 'rows' not in"):
        radix_topk(*args, form="rows")


def test_auto_takes_bisect_over_short_rows_and_coop_to_coop_max(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """"auto" by the tokens' count and the rows' length: bisect below
    CHUNKS_GATHER_MIN_TOKENS over rows of at most BISECT_MAX_KEYS, else coop up to
    COOP_MAX_TOKENS, else chunks with GATHER (its gather launch)."""
    kern = topk_triton._kernels()
    launched: list[str] = []

    class Spy:
        def __init__(self, name: str, fn) -> None:
            self.name, self.fn = name, fn

        def __getitem__(self, grid):
            launched.append(self.name)
            return self.fn[grid]
    monkeypatch.setattr(kern, "row", Spy("row", kern.row))
    from moeserve.kernels.attention.dsa import (
        topk_bisect_triton,
        topk_chunks_triton,
        topk_coop_triton,
    )

    chunks = topk_chunks_triton._kernels()
    monkeypatch.setattr(chunks, "write", Spy("write", chunks.write))
    monkeypatch.setattr(chunks, "gather", Spy("gather", chunks.gather))
    coop = topk_coop_triton._kernels()
    monkeypatch.setattr(coop, "coop", Spy("coop", coop.coop))
    bisect = topk_bisect_triton._kernels()
    monkeypatch.setattr(bisect, "bisect", Spy("bisect", bisect.bisect))
    monkeypatch.setattr(topk_triton, "COOP_MAX_TOKENS", 1)
    monkeypatch.setattr(topk_triton, "CHUNKS_GATHER_MIN_TOKENS", 4)
    monkeypatch.setattr(topk_triton, "BISECT_MAX_KEYS", 40)
    monkeypatch.setattr(topk_triton, "GATHER", False)
    gen = torch.Generator().manual_seed(9)
    for ends, keys, form in (([40, 30], 40, "bisect"), ([40, 30, 25], 40, "bisect"),
                             ([40, 30, 25], 48, "chunks_gather"), ([40], 48, "coop"),
                             ([40, 30, 25, 36], 40, "chunks_gather")):
        launched.clear()
        scores = torch.randn(len(ends), keys, generator=gen)
        out = torch.full((len(ends), 8), GARBAGE, dtype=torch.int32)
        radix_topk(ord_of(scores), rows_meta(ends), 0, 8, out, chunk=16, form="auto")
        assert torch.equal(out, want_topk(scores, ends, 8)[0])
        want = {"chunks_gather": ["gather", "write"]}.get(form, [form])
        assert launched == want, launched


def test_auto_form_keeps_coop_within_a_token_an_sm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(topk_triton, "num_sms", lambda device: 132)
    monkeypatch.setattr(topk_triton, "COOP_MAX_TOKENS", 200)
    cuda = torch.device("cuda", 0)
    short, long = topk_triton.BISECT_MAX_KEYS, topk_triton.BISECT_MAX_KEYS + 1
    assert topk_triton.auto_form(132, long, cuda) == ("coop", False)
    # past the SMs: never refused mid-step
    assert topk_triton.auto_form(133, long, cuda) == ("chunks", True)
    assert topk_triton.auto_form(1, short, cuda) == ("bisect", False)
    assert topk_triton.auto_form(topk_triton.CHUNKS_GATHER_MIN_TOKENS - 1, short,
                                 cuda) == ("bisect", False)
    assert topk_triton.auto_form(topk_triton.CHUNKS_GATHER_MIN_TOKENS, short,
                                 cuda) == ("chunks", True)
    assert topk_triton.auto_form(150, long, torch.device("cpu")) == ("coop", False)
    monkeypatch.setattr(topk_triton, "COOP_MAX_TOKENS", 0)  # the default: never
    assert topk_triton.auto_form(1, long, cuda) == ("chunks", True)


def test_coop_programs_fill_the_sms_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The coop form's programs a token: as many as the SMs hold at once (all resident, so no
    barrier waits on a program that cannot run), each at least a step of positions; one on
    CPU; refused where the tokens alone outnumber the places."""
    from moeserve.kernels.attention.dsa import topk_coop_triton

    monkeypatch.setattr(topk_coop_triton, "num_sms", lambda device: 132)
    cuda = torch.device("cuda", 0)
    programs = topk_coop_triton.programs
    assert programs(32, 8192, 2048, cuda) == 4  # 128 programs
    assert programs(32, 65536, 2048, cuda) == 4  # 16,384 positions each
    assert programs(6, 20000, 64, cuda) == 22
    assert programs(2, 1000, 2048, cuda) == 1  # a step holds the whole row
    assert programs(132, 65536, 2048, cuda) == 1
    assert programs(500, 65536, 2048, torch.device("cpu")) == 1
    assert programs(32, 65536, 2048, cuda, per_sm=3) == 12  # 396 places
    assert programs(200, 65536, 2048, cuda, per_sm=3) == 1
    with pytest.raises(ValueError, match=r"133 tokens, at most 132 \(1 a streaming"):
        programs(133, 8192, 2048, cuda)
    # an SM's places from the compiled kernel's registers and shared memory (sm90's file)
    props = SimpleNamespace(regs_per_multiprocessor=65536, max_threads_per_multi_processor=2048,
                            shared_memory_per_multiprocessor=233472)
    resident = topk_coop_triton.resident_per_sm
    assert resident(80, 1024, props) == 3  # 8 warps x 2,560 registers: 3 of 65,536
    assert resident(32, 1024, props) == topk_coop_triton.MAX_PROGRAMS_PER_SM  # 8 would fit
    assert resident(80, 100_000, props) == 2  # shared memory for two
    assert resident(255, 1024, props) == 1  # 8 x 8,192 registers: one
    assert resident(80, 1024, SimpleNamespace()) == 3  # sm90's figures where torch lacks them


@pytest.mark.parametrize("name", list(STEPS))
def test_indexer_with_small_chunks_equals_the_reference(name: str) -> None:
    """The whole indexer (scores, then the radix select over 16-position chunks) against
    indexer_topk_ref, exactly, with the boundary ties."""
    step = make_step(*STEPS[name], 16, seed=5)
    args = (step.q, step.w, step.cache, step.meta, DIM ** -0.5, TOPK)
    got, ties = indexer_topk_triton(*args, count_boundary_ties=True, topk_chunk=16)
    want, want_ties = indexer_topk_ref(*args, count_boundary_ties=True)
    assert torch.equal(got, want) and ties == want_ties


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("chunk", [64, 2048, None])  # None: the form's default
def test_on_the_gpu(chunk: int | None, form: str) -> None:
    """Long rows on CUDA (atomics and histograms for real): 2,048 of 20,000 positions (16,000
    in the bisect form) with heavy ties, and random."""
    gen = torch.Generator().manual_seed(chunk or 3)
    width = 16000 if form == "bisect" else 20000  # the bisect form's rows: 16,384 at most
    ends = [width, 2048, 2049, 5000, 0, width - 1, 4096, 4097, 12000]
    for scores in (torch.randn(len(ends), width, generator=gen),
                   torch.randint(0, 7, (len(ends), width), generator=gen).float() * 0.5):
        keys = ord_of(scores).cuda()
        out = torch.full((len(ends), 2048), GARBAGE, dtype=torch.int32, device="cuda")
        meta = rows_meta(ends)
        meta = SimpleNamespace(**{k: v.cuda() for k, v in vars(meta).items()})
        ties = radix_topk(keys, meta, 0, 2048, out, chunk=chunk, count_boundary_ties=True)
        want, want_ties = want_topk(scores, ends, 2048)
        assert torch.equal(out.cpu(), want) and ties == want_ties
