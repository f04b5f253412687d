"""The up-projected MLA prefill's piece kernel (mla/up_projected.piece_kernel): "auto" takes
cuDNN's only for large pieces of many heads, the flash kernels only where their dtypes and
widths are met, a kernel cuDNN refuses falls back to flash for good (auto only), and an
out-of-memory error is never swallowed. The rule reads shapes only (meta tensors on the CPU);
the fallback and cuDNN's output on the GPU."""

from __future__ import annotations

import pytest
import torch

from moeserve.kernels.attention.mla import up_projected
from moeserve.kernels.attention.mla.up_projected import piece_kernel


def _q(heads: int, queries: int, width: int = 256, dtype: torch.dtype = torch.bfloat16
       ) -> torch.Tensor:
    return torch.empty(1, heads, queries, width, dtype=dtype, device="meta")


def test_auto_takes_cudnn_only_for_large_recurring_pieces_of_many_heads(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(up_projected, "PIECE_KERNEL", "auto")
    monkeypatch.setattr(up_projected, "_cudnn_refused", set())
    heads, products = up_projected.CUDNN_MIN_HEADS, up_projected.CUDNN_MIN_PRODUCTS
    multiple = up_projected.CUDNN_SHAPE_MULTIPLE
    keys = products // 1024  # a multiple of CUDNN_SHAPE_MULTIPLE: a whole context chunk
    assert keys % multiple == 0
    assert piece_kernel(_q(heads, 1024), keys) == "cudnn"
    # queries past a multiple: still cuDNN (for their first multiple; _attend_and_fold)
    assert piece_kernel(_q(heads, 1024 + 7), keys) == "cudnn"
    assert piece_kernel(_q(heads, 1023), keys) == "flash"  # 768 whole queries: too small
    assert piece_kernel(_q(heads, multiple - 1), 1 << 30) == "flash"  # no whole multiple
    assert piece_kernel(_q(heads, 1024), keys + 1) == "flash"  # a context's last piece
    assert piece_kernel(_q(heads - 1, 8192), keys) == "flash"  # too few heads
    assert piece_kernel(_q(heads, 1024, dtype=torch.float16), keys) == "cudnn"
    # the causal span: its own keys, any length; large by its whole queries squared
    assert piece_kernel(_q(heads, 1024 + 5), 1024 + 5, causal=True) == "cudnn"
    assert piece_kernel(_q(heads, 1023), 1023, causal=True) == "flash"
    # the flash kernels' limits first, whatever the size
    assert piece_kernel(_q(heads, 8192, dtype=torch.float32), 8192) == "efficient"
    assert piece_kernel(_q(heads, 8192, width=260), 8192) == "efficient"
    assert piece_kernel(_q(heads, 8192, width=264), 8192) == "efficient"
    up_projected._cudnn_refused.add((heads, 256, torch.bfloat16))  # refused once: flash
    assert piece_kernel(_q(heads, 8192), 8192) == "flash"
    assert piece_kernel(_q(heads, 8192, dtype=torch.float16), 8192) == "cudnn"


def test_chunk_tokens_are_a_multiple_of_the_recurring_shapes() -> None:
    multiple = up_projected.CUDNN_SHAPE_MULTIPLE
    for heads, qk, v in ((64, 256, 256), (20, 256, 256), (128, 192, 128), (16, 24, 16)):
        tokens = up_projected.chunk_tokens(heads, qk, v)
        assert tokens % multiple == 0 and tokens >= up_projected.MIN_CHUNK
        assert tokens * heads * (2 * qk + v) * 2 <= max(
            up_projected.CHUNK_BYTES, up_projected.MIN_CHUNK * heads * (2 * qk + v) * 2)
    assert up_projected.chunk_tokens(64, 256, 256) == 2560  # 2,730 fit in 256 MiB


@pytest.mark.parametrize("queries", [13, 16])
@pytest.mark.parametrize("prefix", [0, 24, 21])
def test_split_pieces_give_the_whole_rows_result(monkeypatch: pytest.MonkeyPatch,
                                                 queries: int, prefix: int) -> None:
    """A row whose pieces "auto" gives to cuDNN with queries past a multiple (here of 4: 13
    queries = 12 + 1) attends its first multiple by one launch and the rest by the others,
    folded into their rows: the same result as every piece whole (on the CPU both through
    its flash SDPA, in fp32). 16 queries: no split; a prefix of 21 after chunks of 8 leaves a
    last context piece of 5 keys, not a multiple: whole, flash."""
    monkeypatch.setattr(up_projected, "CUDNN_SHAPE_MULTIPLE", 4)
    monkeypatch.setattr(up_projected, "MIN_CHUNK", 8)
    monkeypatch.setattr(up_projected, "CHUNK_BYTES", 1)
    gen = torch.Generator().manual_seed(queries + prefix)
    heads, qk, v_dim, rank, rope, block = 3, 24, 16, 32, 8, 4
    context = prefix + queries
    q = torch.randn(queries, heads, qk, generator=gen)
    cache = torch.randn(-(-context // block) + 2, block, rank + rope, generator=gen)
    table = torch.randperm(cache.shape[0], generator=gen)[:-(-context // block)].int()
    kv_b = torch.randn(heads * (qk - rope + v_dim), rank, generator=gen) * rank ** -0.5
    args = (q, cache, table, context, qk ** -0.5, kv_b, qk - rope, v_dim)
    monkeypatch.setattr(up_projected, "PIECE_KERNEL", "flash")
    want = up_projected.attend_row_in_chunks(*args)
    kernels: list[tuple[str, int, int, bool]] = []
    attend_piece = up_projected._attend_piece

    def spy(q, k, v, scale, causal, kernel=None):
        kernels.append((kernel, q.shape[2], k.shape[2], causal))
        return attend_piece(q, k, v, scale, causal, kernel)
    monkeypatch.setattr(up_projected, "_attend_piece", spy)
    monkeypatch.setattr(up_projected, "PIECE_KERNEL", "auto")
    # fp32 would take "efficient": the rule as for bf16 many heads, the CPU's flash either way
    monkeypatch.setattr(up_projected, "piece_kernel", lambda q, n, causal=False: (
        "cudnn" if causal or n % 4 == 0 else "flash"))
    got = up_projected.attend_row_in_chunks(*args)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    whole = queries - queries % 4
    context_pieces = [(("cudnn" if n % 4 == 0 else "flash"), n) for n in
                      [min(8, prefix - a) for a in range(0, prefix, 8)]]
    if whole == queries:  # no split: each piece whole
        want_kernels = [(k, queries, n, False) for k, n in context_pieces]
        want_kernels.append(("cudnn", queries, queries, True))
    else:
        want_kernels = []
        for k, n in context_pieces:
            want_kernels += ([("cudnn", whole, n, False), ("flash", queries - whole, n, False)]
                             if k == "cudnn" else [("flash", queries, n, False)])
        want_kernels += [("cudnn", whole, whole, True), ("flash", queries - whole, whole, False),
                         ("flash", queries - whole, queries - whole, True)]
    assert kernels == want_kernels


@pytest.mark.parametrize("kernel", ["flash", "cudnn"])
def test_a_named_kernel_is_taken_at_every_size(monkeypatch: pytest.MonkeyPatch,
                                               kernel: str) -> None:
    monkeypatch.setattr(up_projected, "PIECE_KERNEL", kernel)
    assert piece_kernel(_q(1, 16), 16) == kernel
    assert piece_kernel(_q(128, 8192), 8192) == kernel
    assert piece_kernel(_q(128, 8192, dtype=torch.float32), 8192) == "efficient"


def test_an_unknown_kernel_from_the_environment_is_named(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from moeserve import envs

    monkeypatch.setenv(envs.MLA_PIECE_KERNEL, "flash3")
    monkeypatch.setattr(up_projected, "PIECE_KERNEL", envs.mla_piece_kernel("auto"))
    with pytest.raises(ValueError, match="PIECE_KERNEL 'flash3' not in"):
        piece_kernel(_q(64, 16), 16)


def _piece(heads: int, queries: int, keys: int, seed: int = 0
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k = (torch.randn(1, heads, n, 256, device="cuda", generator=gen, dtype=torch.bfloat16)
            for n in (queries, keys))
    v = torch.randn(1, heads, keys, 192, device="cuda", generator=gen, dtype=torch.bfloat16)
    return q, k, v


@pytest.mark.gpu
def test_gpu_cudnn_pieces_match_flash_and_a_refusal_falls_back(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A large piece at 64 heads through cuDNN (auto) within bf16 of flash's, values narrower
    than the keys; a cuDNN that raises gives flash's bits and flash from then on; an
    out-of-memory error propagates; a named "cudnn" that raises propagates."""
    monkeypatch.setattr(up_projected, "_cudnn_refused", set())
    monkeypatch.setattr(up_projected, "CUDNN_MIN_PRODUCTS", 1 << 20)
    q, k, v = _piece(64, 1024, 1536)
    monkeypatch.setattr(up_projected, "PIECE_KERNEL", "flash")
    flash_out, flash_lse = up_projected._attend_piece(q, k, v, 0.0625, False)
    monkeypatch.setattr(up_projected, "PIECE_KERNEL", "auto")
    out, lse = up_projected._attend_piece(q, k, v, 0.0625, False)
    assert out.shape == flash_out.shape == (1, 64, 1024, 192) and lse.shape == (1, 64, 1024)
    torch.testing.assert_close(out.float(), flash_out.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, flash_lse, atol=1e-3, rtol=1e-3)
    calls = []

    def refuse(*args: object) -> None:
        calls.append(1)
        raise RuntimeError("cuDNN Frontend error: no valid execution plans")
    monkeypatch.setattr(up_projected, "_cudnn", refuse)
    out, lse = up_projected._attend_piece(q, k, v, 0.0625, False)
    assert torch.equal(out, flash_out) and torch.equal(lse, flash_lse) and calls == [1]
    up_projected._attend_piece(q, k, v, 0.0625, False)
    assert calls == [1]  # flash from then on, cuDNN not asked again
    monkeypatch.setattr(up_projected, "_cudnn_refused", set())

    def out_of_memory(*args: object) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory")
    monkeypatch.setattr(up_projected, "_cudnn", out_of_memory)
    with pytest.raises(torch.OutOfMemoryError):
        up_projected._attend_piece(q, k, v, 0.0625, False)
    monkeypatch.setattr(up_projected, "_cudnn", refuse)
    monkeypatch.setattr(up_projected, "PIECE_KERNEL", "cudnn")
    with pytest.raises(RuntimeError, match="no valid execution plans"):
        up_projected._attend_piece(q, k, v, 0.0625, False)


@pytest.mark.gpu
def test_gpu_a_split_row_matches_flash_throughout(monkeypatch: pytest.MonkeyPatch) -> None:
    """GLM-5's 64 heads (nope 192 + rope 64, v 256, latent 512): 1,061 queries after a prefix
    of a whole context chunk and 300 more keys, "auto" (cuDNN for the first 1,024 queries of
    the whole chunk and of the causal span, flash for the rest and for the 300-key piece)
    within bf16 of every piece by flash."""
    heads, nope, rope, v_dim, rank = 64, 192, 64, 256, 512
    chunk = up_projected.chunk_tokens(heads, nope + rope, v_dim)
    queries, prefix, block = 1061, chunk + 300, 64
    context = prefix + queries
    gen = torch.Generator(device="cuda").manual_seed(3)
    cache = torch.randn(-(-context // block), block, rank + rope, device="cuda", generator=gen,
                        dtype=torch.bfloat16)
    table = torch.arange(cache.shape[0], device="cuda", dtype=torch.int32).flip(0)
    q = torch.randn(queries, heads, nope + rope, device="cuda", generator=gen,
                    dtype=torch.bfloat16)
    kv_b = (torch.randn(heads * (nope + v_dim), rank, device="cuda", generator=gen)
            * rank ** -0.5).to(torch.bfloat16)
    args = (q, cache, table, context, (nope + rope) ** -0.5, kv_b, nope, v_dim)
    monkeypatch.setattr(up_projected, "PIECE_KERNEL", "flash")
    want = up_projected.attend_row_in_chunks(*args).float()
    monkeypatch.setattr(up_projected, "PIECE_KERNEL", "auto")
    monkeypatch.setattr(up_projected, "_cudnn_refused", set())
    kernels = []
    attend_piece = up_projected._attend_piece

    def spy(q, k, v, scale, causal, kernel=None):
        kernels.append((kernel, q.shape[2], k.shape[2]))
        return attend_piece(q, k, v, scale, causal, kernel)
    monkeypatch.setattr(up_projected, "_attend_piece", spy)
    got = up_projected.attend_row_in_chunks(*args).float()
    assert ("cudnn", 1024, chunk) in kernels and ("cudnn", 1024, 1024) in kernels
    assert ("flash", 37, chunk) in kernels and ("flash", queries, 300) in kernels
    assert not up_projected._cudnn_refused
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
