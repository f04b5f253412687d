"""torch's CPU threads are an engine knob (torch_threads), and the capacity report sets them
against the usable cores: on CPU that ratio is what moves throughput (issue 13)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from moeserve import LLM
from moeserve.config import ConfigError, EngineConfig
from moeserve.engine.core import usable_cores


@pytest.fixture(autouse=True)
def _keep_threads() -> Iterator[None]:
    before = torch.get_num_threads()  # the knob is process-wide: give the suite its own back
    yield
    torch.set_num_threads(before)


def test_an_explicit_thread_count_is_set_and_reported() -> None:
    llm = LLM("tiny-moe", device="cpu", max_model_len=64, torch_threads=1)
    assert torch.get_num_threads() == 1
    report = llm.report
    assert report.engine_config.torch_threads == 1 and "torch_threads" not in report.resolved
    assert report.cpu_threads.startswith(f"1 torch threads, {usable_cores()} usable cores")
    assert "CPU threads" in report.format() and report.to_dict()["cpu_threads"]
    # the same, structured, for the doctor's cpu_threads rule
    assert (report.torch_threads, report.usable_cores) == (1, usable_cores())
    assert report.to_dict()["torch_threads"] == 1
    assert report.to_dict()["usable_cores"] == usable_cores()


def test_auto_keeps_torch_default_and_says_so() -> None:
    threads = torch.get_num_threads()
    report = LLM("tiny-moe", device="cpu", max_model_len=64).report
    assert torch.get_num_threads() == threads
    assert report.engine_config.torch_threads == threads
    assert report.resolved["torch_threads"] == "torch's default"


def test_more_threads_than_cores_is_called_out() -> None:
    report = LLM("tiny-moe", device="cpu", max_model_len=64,
                 torch_threads=usable_cores() + 1).report
    assert "more threads than cores" in report.cpu_threads


@pytest.mark.parametrize("bad", [0, -2, "many", True])
def test_a_bad_thread_count_is_refused(bad: object) -> None:
    with pytest.raises(ConfigError, match="torch_threads"):
        EngineConfig(model="tiny-moe", torch_threads=bad)  # type: ignore[arg-type]
