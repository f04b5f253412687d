"""benchmarks/parallel/comm_bandwidth.py on CPU: nccl-tests' bus factors, the models' per-layer
messages (docs/parallel.md's arithmetic), and a two-rank gloo run end to end."""

from __future__ import annotations

import json

import pytest

from benchmarks.parallel.comm_bandwidth import bus_factor, main, model_messages


def test_bus_factors_are_nccl_tests() -> None:
    assert bus_factor("all_reduce", 8) == pytest.approx(1.75)
    assert bus_factor("all_gather", 8) == bus_factor("all_to_all", 8) == pytest.approx(0.875)
    assert bus_factor("all_reduce", 2) == 1.0
    with pytest.raises(ValueError, match="unknown collective"):
        bus_factor("broadcast", 2)


def test_model_messages_follow_docs_parallel() -> None:
    (glm,) = model_messages(["glm-5"], [1024])
    assert glm["bytes"] == 1024 * 6144 * 2  # 12.58 MB, two a layer and the embedding's
    assert glm["per_step"] == 2 * 78 + 1


def test_two_gloo_ranks_write_every_op(tmp_path) -> None:
    main(["--out", str(tmp_path), "--cpu", "--world", "2", "--sizes-mib", "0.01",
          "--models", "qwen3-30b-a3b", "--rows", "4", "--iters", "2", "--warmup", "1"])
    result = json.loads((tmp_path / "comm_bandwidth.json").read_text())
    assert result["world"] == 2 and result["environment"]["torch"]
    ops = {(r["op"], r["bytes"]) for r in result["collectives"]}
    assert ops == {(op, b) for op in ("all_reduce", "all_gather", "all_to_all")
                   for b in (10485, 4 * 2048 * 2)}
    assert all(r["us"] > 0 and r["busbw_gb_s"] >= 0 for r in result["collectives"])
    (message,) = result["model_messages"]
    assert message["rows"] == 4 and message["step_ms"] > 0


def test_one_rank_is_refused() -> None:
    with pytest.raises(SystemExit, match="at least 2 ranks"):
        main(["--out", "/tmp/unused", "--cpu", "--world", "1"])
