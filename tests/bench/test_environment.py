"""benchmarks' environment record (benchmarks/engine/w1_offline.environment): with the commit,
device and versions, the MOESERVE_ switches the process ran with, so a result of an A/B or an
experiment switch says which side it is."""

from __future__ import annotations

import pytest

from benchmarks.engine.w1_offline import environment


def test_the_record_names_the_switches_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOESERVE_MLA_VECTOR_STORES", "0")
    monkeypatch.delenv("MOESERVE_DSA_SLOT_ROWS", raising=False)
    env = environment()
    assert env["moeserve_env"]["MOESERVE_MLA_VECTOR_STORES"] == "0"
    assert "MOESERVE_DSA_SLOT_ROWS" not in env["moeserve_env"]
    assert {"git_commit", "device", "torch", "triton", "python"} <= set(env)
