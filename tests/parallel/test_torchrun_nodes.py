"""Two "nodes" on one machine through torchrun (static rendezvous on 127.0.0.1, gloo): node 0's
rank serves the API and runs the engine core, node 1's rank is a headless worker; a request
through `moeserve serve` gets the single process's tokens, and stopping node 0 ends both nodes
with no process left. Each wait is for an event, bounded only against a hang."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import psutil
import pytest

from moeserve import LLM, SamplingParams
from tests.faults.serve import free_port
from tests.models.checkpoints import write_tiny_checkpoint
from tests.wait import wait_until

BIN = Path(sys.executable).parent
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]
EXIT_WAIT_S = 60


@pytest.fixture
def checkpoint(tmp_path: Path) -> str:
    return write_tiny_checkpoint("qwen3_moe", tmp_path / "ckpt")


def _node(rank: int, rdzv_port: int, http_port: int, folder: str, log: Path) -> subprocess.Popen:
    cmd = [str(BIN / "torchrun"), "--nnodes", "2", "--nproc-per-node", "1", "--node-rank",
           str(rank), "--master-addr", "127.0.0.1", "--master-port", str(rdzv_port),
           "--no-python", str(BIN / "moeserve"), "serve", "--model", folder, "--device", "cpu",
           "--dtype", "float32", "--tp", "2", "--torch-threads", "1", "--port", str(http_port),
           "--log-level", "warning"]
    with open(log, "w") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}"})


def _ready(url: str, nodes: list[subprocess.Popen]) -> bool:
    assert all(n.poll() is None for n in nodes), "a node exited during start-up"
    try:
        return httpx.get(f"{url}/ready", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def test_two_torchrun_nodes_serve_the_single_process_tokens(checkpoint: str,
                                                            tmp_path: Path) -> None:
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    expected = LLM(checkpoint, device="cpu", dtype="float32").generate([PROMPT], params)[0]
    rdzv, http = free_port(), free_port()
    url = f"http://127.0.0.1:{http}"
    nodes = [_node(r, rdzv, http, checkpoint, tmp_path / f"node{r}.log") for r in (1, 0)]
    everything: list[psutil.Process] = []
    try:
        wait_until(lambda: _ready(url, nodes), "node 0 ready", timeout_s=180)
        everything = [psutil.Process(n.pid) for n in nodes]
        everything += [c for p in list(everything) for c in p.children(recursive=True)]
        body = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
        got = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()
        assert got["choices"][0]["token_ids"] == expected.token_ids, got
        assert any("moeserve" in " ".join(p.cmdline()) and p.pid != nodes[0].pid
                   for p in psutil.Process(nodes[0].pid).children(recursive=True))
    finally:
        nodes[1].send_signal(signal.SIGTERM)  # node 0's agent (started second)
        for n in nodes:
            try:
                n.wait(EXIT_WAIT_S)
            except subprocess.TimeoutExpired:
                n.kill()
    _, alive = psutil.wait_procs(everything, timeout=EXIT_WAIT_S)
    assert not alive, f"processes left behind: {alive}"


def test_a_headless_node_started_by_moeserve(checkpoint: str, tmp_path: Path) -> None:
    """Without torchrun: node 0 `moeserve serve --tp 2 --nnodes 2`, node 1 the same with
    --node-rank 1 --headless (it spawns its rank itself); the single process's tokens, and
    stopping node 0 ends node 1 with code 0 (the engine's shutdown reaches its worker)."""
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    expected = LLM(checkpoint, device="cpu", dtype="float32").generate([PROMPT], params)[0]
    rdzv, http = free_port(), free_port()
    url = f"http://127.0.0.1:{http}"
    common = [str(BIN / "moeserve"), "serve", "--model", checkpoint, "--device", "cpu",
              "--dtype", "float32", "--tp", "2", "--nnodes", "2", "--master-addr", "127.0.0.1",
              "--master-port", str(rdzv), "--torch-threads", "1", "--log-level", "warning"]
    nodes = []
    for rank, extra in ((1, ["--headless"]), (0, ["--port", str(http)])):
        with open(tmp_path / f"node{rank}.log", "w") as out:
            nodes.append(subprocess.Popen([*common, "--node-rank", str(rank), *extra],
                                          stdout=out, stderr=subprocess.STDOUT))
    headless, serving = nodes
    try:
        wait_until(lambda: _ready(url, nodes), "node 0 ready", timeout_s=180)
        workers = psutil.Process(headless.pid).children(recursive=True)
        assert any("moeserve.parallel.worker" in " ".join(p.cmdline()) for p in workers)
        body = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
        got = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()
        assert got["choices"][0]["token_ids"] == expected.token_ids, got
    finally:
        serving.send_signal(signal.SIGTERM)
        serving.wait(EXIT_WAIT_S)
    assert headless.wait(EXIT_WAIT_S) == 0, (tmp_path / "node1.log").read_text()
    _, alive = psutil.wait_procs(workers, timeout=EXIT_WAIT_S)
    assert not alive
