"""The processes of the serving benchmark: a kvmesh node and vLLM's OpenAI server.

Both are started the way an operator starts them (the README's production
recipe): ``kvmesh node`` with a local lane, and ``python -m
vllm.entrypoints.openai.api_server`` with kvmesh's connector pointed at that
lane, or without it. Their Prometheus endpoints give the counters the
benchmark reports.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from kvmesh.bench.common import cpu_seconds, free_port
from kvmesh.engine.vllm.worker import engine_env, transfer_config


def metrics(url: str) -> dict[str, float]:
    """A Prometheus text page: every series summed over its labels, by name."""
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            text = resp.read().decode()
    except (urllib.error.URLError, OSError):
        return {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_part, _, value = line.rpartition(" ")
        name = name_part.split("{", 1)[0]
        try:
            out[name] = out.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return out


@dataclass
class Process:
    """A started process, its log, and how to reach it."""

    name: str
    proc: subprocess.Popen[bytes]
    log: Path

    def alive(self) -> bool:
        return self.proc.poll() is None

    def tail(self, chars: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def _spawn(name: str, argv: list[str], log: Path, env: dict[str, str]) -> Process:
    with log.open("wb") as out:
        proc = subprocess.Popen(
            argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    return Process(name, proc, log)


def _wait(check: object, process: Process, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not process.alive():
            raise RuntimeError(f"{what} exited with {process.proc.returncode}:\n{process.tail()}")
        if callable(check) and check():
            return
        time.sleep(0.2)
    raise RuntimeError(f"{what} not ready after {timeout:.0f} s:\n{process.tail()}")


@dataclass
class Node:
    """A ``kvmesh node`` process."""

    process: Process
    lane: str
    metrics_url: str

    def counters(self) -> dict[str, float]:
        return metrics(self.metrics_url)

    def cpu_seconds(self) -> float:
        return cpu_seconds(self.process.proc.pid)


def start_node(work: Path, l1_size: str, chunk_size: int) -> Node:
    """``kvmesh node`` with a lane in ``work``, no coordinator, L2 on local disk."""
    lane = work / "node.lane"
    ready = work / "node-ready.json"
    metrics_port = free_port()
    argv = [
        sys.executable, "-m", "kvmesh.cli", "node", "--port", "0",
        "--lane-socket", str(lane), "--l1-size-bytes", l1_size,
        "--chunk-size", str(chunk_size), "--data-dir", str(work / "node-data"),
        "--metrics-port", str(metrics_port), "--ready-file", str(ready),
    ]  # fmt: skip
    process = _spawn("kvmesh node", argv, work / "node.log", dict(os.environ))
    _wait(ready.exists, process, 60, "kvmesh node")
    endpoints = json.loads(ready.read_text())
    return Node(process, f"lane:{lane}", f"http://{endpoints['metrics']}/metrics")


@dataclass
class Server:
    """vLLM's OpenAI server."""

    process: Process
    port: int

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/metrics"

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                return bool(r.status == 200)
        except (urllib.error.URLError, OSError):
            return False


def start_vllm(
    work: Path,
    name: str,
    model: Path,
    *,
    kv_blocks: int,
    kv_cache_gib: int,
    block_size: int,
    max_model_len: int,
    gateway: str | None,
    omp_bind: str,
    startup_timeout_s: float = 600.0,
) -> Server:
    """vLLM's OpenAI server with a KV cache of ``kv_blocks`` blocks (and kvmesh if ``gateway``)."""
    port = free_port()
    argv = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model), "--served-model-name", "bench",
        "--host", "127.0.0.1", "--port", str(port),
        "--enforce-eager", "--max-model-len", str(max_model_len),
        "--block-size", str(block_size), "--num-gpu-blocks-override", str(kv_blocks),
        "--enable-prompt-tokens-details", "--disable-uvicorn-access-log",
    ]  # fmt: skip
    if gateway:
        argv += ["--kv-transfer-config", json.dumps(transfer_config(gateway))]
    env = {**os.environ, **engine_env(kv_cache_gib), "VLLM_CPU_OMP_THREADS_BIND": omp_bind}
    process = _spawn(f"vLLM ({name})", argv, work / f"vllm-{name}.log", env)
    server = Server(process, port)
    _wait(server.healthy, process, startup_timeout_s, f"vLLM ({name})")
    return server
