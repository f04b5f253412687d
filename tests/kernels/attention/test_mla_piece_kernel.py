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


def test_auto_takes_cudnn_only_for_large_pieces_of_many_heads(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(up_projected, "PIECE_KERNEL", "auto")
    monkeypatch.setattr(up_projected, "_cudnn_refused", set())
    heads, products = up_projected.CUDNN_MIN_HEADS, up_projected.CUDNN_MIN_PRODUCTS
    assert piece_kernel(_q(heads, 8192), products // 8192) == "cudnn"
    assert piece_kernel(_q(heads, 8192), products // 8192 - 1) == "flash"  # too small
    assert piece_kernel(_q(heads - 1, 8192), 1 << 20) == "flash"  # too few heads
    assert piece_kernel(_q(heads, 8192, dtype=torch.float16), 8192) == "cudnn"
    # the flash kernels' limits first, whatever the size
    assert piece_kernel(_q(heads, 8192, dtype=torch.float32), 8192) == "efficient"
    assert piece_kernel(_q(heads, 8192, width=260), 8192) == "efficient"
    assert piece_kernel(_q(heads, 8192, width=264), 8192) == "efficient"
    up_projected._cudnn_refused.add((heads, 256, torch.bfloat16))  # refused once: flash
    assert piece_kernel(_q(heads, 8192), 8192) == "flash"
    assert piece_kernel(_q(heads, 8192, dtype=torch.float16), 8192) == "cudnn"


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
