"""benchmarks/kernels/mla/kernels_dsa.py on CPU: the decode step's bounds (the issue's bytes), and
the smoke run end to end through Triton's interpreter (fp32): the scoring cases and the decode
step, each checked against the references before it is timed."""

from __future__ import annotations

import json
import math
import sys

import pytest

from benchmarks.kernels.mla import kernels_dsa
from benchmarks.kernels.mla.kernels_dsa import decode_bound_ms


def test_decode_bounds_are_the_issues_bytes() -> None:
    sparse, dense = decode_bound_ms(32, 65536, 2048, 128, 576, 2)
    assert sparse == pytest.approx(32 * (65536 * 256 + 2048 * 1152) / 4.27e12 * 1e3)
    assert dense == pytest.approx(32 * 65536 * 1152 / 4.27e12 * 1e3)
    assert dense / sparse == pytest.approx(3.95, abs=0.01)  # the issue's 3.95x at 64k
    short, _ = decode_bound_ms(1, 100, 2048, 128, 576, 2)  # a context under top-k reads it all
    assert short == pytest.approx(100 * (256 + 1152) / 4.27e12 * 1e3)


def test_smoke_run_writes_both_sections(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(sys, "argv", ["kernels_dsa", "--out", str(tmp_path), "--smoke"])
    kernels_dsa.main()
    result = json.loads((tmp_path / "kernels_dsa.json").read_text())
    assert [c["case"] for c in result["cases"]] == [n for n, *_ in kernels_dsa.SMOKE]
    decode = result["decode"]
    assert [c["case"] for c in decode] == [n for n, *_ in kernels_dsa.SMOKE_DECODE]
    assert all(c["check_error"] < 1e-5 and c["dsa_ms"] > 0 for c in decode)
    # GATHER's forms, each checked equal to the default's selection before it was timed
    assert all(set(c["topk_gather_graph_ms"]) == {"chunks", "row", "coop"}
               and c["dsa_graph_gather_ms"] > 0 and c["dsa_graph_coop_gather_ms"] > 0
               for c in decode)
    # the selected latent rows and as many contiguous ones read alone, each row sum checked
    assert all(set(c["gather_rate_tbs"]) == {"selected", "contiguous"}
               and all(ms > 0 for times in c["gather_ms"].values() for ms in times.values())
               for c in decode)
    # the step again with the scores as wide as the served graph's context bound
    assert all(c["graph_bound"] >= c["context"] and c["dsa_graph_bound_ms"] > 0 for c in decode)
    monkeypatch.setattr(sys, "argv", ["kernels_dsa", "--out", str(tmp_path), "--smoke",
                                      "--decode-only"])
    kernels_dsa.main()
    again = json.loads((tmp_path / "kernels_dsa.json").read_text())
    assert again["cases"] == [] and len(again["decode"]) == len(decode)


def test_prefill_smoke_run(tmp_path, monkeypatch) -> None:
    """kernels_dsa_prefill's smoke run: the chunk checked against the references, every part
    timed, each bound and share present."""
    from benchmarks.kernels.mla import kernels_dsa_prefill

    monkeypatch.setattr(sys, "argv", ["kernels_dsa_prefill", "--out", str(tmp_path), "--smoke"])
    kernels_dsa_prefill.main()
    result = json.loads((tmp_path / "kernels_dsa_prefill.json").read_text())
    (row,) = result["prefill"]
    assert row["case"] == kernels_dsa_prefill.SMOKE[0][0] and row["check_error"] < 1e-5
    for part in ("indexer", "score", "topk", "topk_torch", "topk_row_gather",
                 "topk_chunks_gather", "sparse_mla", "dense_mla"):
        assert row[f"{part}_ms"] > 0, part
    for part in ("indexer", "sparse_mla", "dense_mla"):
        assert row[f"{part}_bound_ms"] >= 0 and f"{part}_pct" in row


def test_prefill_flop_bound_of_w3s_last_chunk() -> None:
    """The prefill bound is ANCHORS.md's: FLOPs / 787 TFLOP/s, or bytes / 4.27 TB/s if larger."""
    from benchmarks.kernels.mla.kernels_dsa_prefill import bound_ms

    assert bound_ms(0, 787e12) == pytest.approx(1e3)
    assert bound_ms(4.27e12, 1.0) == pytest.approx(1e3)


def test_a_gpu_run_without_a_gpu_exits_naming_the_benchmark(monkeypatch) -> None:
    from benchmarks.kernels.kernel_runs import run_device

    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(SystemExit, match="kernels_dsa_prefill needs a CUDA GPU"):
        run_device(False, "kernels_dsa_prefill")


def test_flush_smoke_run_times_each_step_and_read_after_each_flush(tmp_path, monkeypatch) -> None:
    """dsa_flush's smoke run: every decode case's step and the bare reader's rows (their sums
    checked) timed once for each of kernel_runs' L2 flushes, each beside its bound."""
    from benchmarks.kernels.kernel_runs import L2_FLUSHES
    from benchmarks.kernels.mla import dsa_flush

    monkeypatch.setattr(sys, "argv", ["dsa_flush", "--out", str(tmp_path), "--smoke"])
    dsa_flush.main()
    result = json.loads((tmp_path / "dsa_flush.json").read_text())
    assert [s["case"] for s in result["steps"]] == [n for n, *_ in kernels_dsa.SMOKE_DECODE]
    for row in result["steps"]:
        assert set(row["step_ms"]) == set(row["pct_of_bound"]) == set(L2_FLUSHES)
        assert row["read_bound_ms"] > 0 and all(ms > 0 for ms in row["step_ms"].values())
        assert set(row["parts_ms"]) == {"scores", "indexer", "sparse_mla"}
        assert all(ms > 0 for ms in row["parts_ms"].values())
    (read,) = result["reads"]
    assert read["megabytes"] > 0 and set(read["tbs"]) == set(L2_FLUSHES)
    monkeypatch.setattr(sys, "argv", ["dsa_flush", "--out", str(tmp_path), "--smoke",
                                      "--cases", "decode_b32_ctx8k"])
    with pytest.raises(SystemExit):  # a case the smoke run lacks, named in the error
        dsa_flush.main()


def test_a_timer_with_an_unknown_flush_is_refused() -> None:
    from benchmarks.kernels.kernel_runs import make_timer

    with pytest.raises(ValueError, match="flush 'dirty' is not one of"):
        make_timer(True, 1, 1, flush="dirty")


@pytest.mark.gpu
def test_read_flushed_bench_times_the_call_after_each_flush() -> None:
    """On a GPU: the read-flushed timer runs fn for its estimate, warm-up and timed calls and
    returns their mean, a positive time in ms."""
    import torch

    from benchmarks.kernels.kernel_runs import read_flushed_bench

    x = torch.ones(1 << 20, device="cuda")
    calls = []

    def fn() -> None:
        calls.append(1)
        x.mul_(1.0)
    ms = read_flushed_bench(fn, warmup_ms=1, rep_ms=2)
    assert math.isfinite(ms) and ms > 0 and len(calls) >= 1 + 5 + 1 + 1
