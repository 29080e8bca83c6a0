"""The processes of the serving benchmark: a kvmesh node and vLLM's OpenAI server.

Both are started the way an operator starts them (the README's production
recipe): ``kvmesh node`` with a local lane, and ``python -m
vllm.entrypoints.openai.api_server`` with kvmesh's connector pointed at that
lane, or without it. Their Prometheus endpoints give the counters the
benchmark reports.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvmesh.bench import node_figures
from kvmesh.bench.common import cpu_seconds, free_port
from kvmesh.engine.vllm.worker import engine_env, transfer_config


def metrics(url: str) -> dict[str, float]:
    """A Prometheus text page: every series summed over its labels, by name ({} when the
    page cannot be read)."""
    out: dict[str, float] = {}
    for (name, _labels), value in node_figures.scrape([url]).items():
        out[name] = out.get(name, 0.0) + value
    return out


def model_shape(model: Path) -> dict[str, int]:
    """A model directory's KV shape: layers, kv heads, head size, bf16 KV bytes per token."""
    config = json.loads((model / "config.json").read_text())
    heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or config["hidden_size"] // heads)
    kv_heads = int(config.get("num_key_value_heads") or heads)
    layers = int(config["num_hidden_layers"])
    # bf16 KV: K and V, every layer.
    return {
        "layers": layers,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "kv_bytes_per_token": 2 * layers * kv_heads * head_dim * 2,
        "context": int(config.get("max_position_embeddings") or 16384),
    }


#: How long a server stopped at the end of a run may take to shut down gracefully.
STOP_GRACE_S = 60.0
#: The same for a run that is abandoned (an error, Ctrl-C, SIGTERM): vLLM's graceful
#: shutdown waits for the requests still streaming to the benchmark's client, which
#: would hold the exit up for the whole grace.
ABANDON_GRACE_S = 5.0


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

    def failure(self, chars: int = 3000) -> str:
        """The log's first error (its root cause, where vLLM names one) and the log's tail.

        A vLLM engine core that fails to start logs its traceback first and
        then more from the process that started it, so the tail alone often
        misses the cause.
        """
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return ""
        tail = text[-chars:]
        marks = (text.find("Traceback (most recent call last)"), text.find(" ERROR "))
        first = min((i for i in marks if i >= 0), default=-1)
        if first < 0 or first >= len(text) - chars:
            return tail
        start = text.rfind("\n", 0, first) + 1
        return f"{text[start : start + chars]}\n[...]\n{tail}"

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM to its process group; SIGKILL if it is still running after ``grace_s``."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


_PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the thread that started it dies (Linux)."""
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def spawn(name: str, argv: list[str], log: Path, env: dict[str, str]) -> Process:
    """Start ``argv`` in its own session (so :meth:`Process.stop` ends its children too).

    The process is sent SIGTERM should the benchmark die without stopping it
    (killed, or a crash), so no server outlives the run.
    """
    with log.open("wb") as out:
        proc = subprocess.Popen(
            argv,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_die_with_parent,  # noqa: PLW1509 (prctl only: no lock is taken)
        )
    return Process(name, proc, log)


def wait_ready(check: object, process: Process, timeout: float, what: str) -> None:
    """Wait until ``check()`` is true; raise with the log's tail if the process exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not process.alive():
            raise RuntimeError(
                f"{what} exited with {process.proc.returncode}:\n{process.failure()}"
            )
        if callable(check) and check():
            return
        time.sleep(0.2)
    raise RuntimeError(f"{what} not ready after {timeout:.0f} s:\n{process.failure()}")


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


def start_node(work: Path, l1_size: str, chunk_size: int, extra_args: Sequence[str] = ()) -> Node:
    """``kvmesh node`` with a lane in ``work``, no coordinator, L2 on local disk.

    Its event loop's lateness is sampled every 10 ms instead of 50 (about 1 % of a
    core more), so the figures show the stalls of 20 ms that a request would wait
    through (``node.loop`` in bench/node_figures.py).

    ``extra_args``: more ``kvmesh node`` options (they override the ones above).
    """
    lane = work / "node.lane"
    ready = work / "node-ready.json"
    metrics_port = free_port()
    argv = [
        sys.executable, "-m", "kvmesh.cli", "node", "--port", "0",
        "--lane-socket", str(lane), "--l1-size-bytes", l1_size,
        "--chunk-size", str(chunk_size), "--data-dir", str(work / "node-data"),
        "--metrics-port", str(metrics_port), "--ready-file", str(ready),
        "--loop-lag-interval-ms", "10", *extra_args,
    ]  # fmt: skip
    process = spawn("kvmesh node", argv, work / "node.log", dict(os.environ))
    try:
        wait_ready(ready.exists, process, 60, "kvmesh node")
    except BaseException:
        process.stop()
        raise
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


#: Seconds a process stopped before it serves has to end before it is killed.
STARTING_GRACE_S = 10.0


def launch_vllm(
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
    extra_args: Sequence[str] = (),
    connector: dict[str, str] | None = None,
) -> Server:
    """Start vLLM's OpenAI server, not waiting for it to serve (:func:`start_vllm` waits).

    Its KV cache has ``kv_blocks`` blocks, kvmesh's connector is on if
    ``gateway`` (with ``connector``'s kv_connector_extra_config keys), and
    ``extra_args`` are more options of vLLM's server.
    """
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
        argv += ["--kv-transfer-config", json.dumps(transfer_config(gateway, connector))]
    argv += extra_args
    env = {**os.environ, **engine_env(kv_cache_gib), "VLLM_CPU_OMP_THREADS_BIND": omp_bind}
    process = spawn(f"vLLM ({name})", argv, work / f"vllm-{name}.log", env)
    return Server(process, port)


def wait_serving(server: Server, timeout: float = 600.0) -> None:
    """Wait until vLLM's server answers its health check; stop it if it never does.

    A vLLM stopped while it starts may hang in its shutdown: it has
    :data:`STARTING_GRACE_S` before it is killed.
    """
    try:
        wait_ready(server.healthy, server.process, timeout, server.process.name)
    except BaseException:
        server.process.stop(STARTING_GRACE_S)
        raise


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
    connector: dict[str, str] | None = None,
) -> Server:
    """vLLM's OpenAI server with a KV cache of ``kv_blocks`` blocks (and kvmesh if ``gateway``)."""
    server = launch_vllm(
        work,
        name,
        model,
        kv_blocks=kv_blocks,
        kv_cache_gib=kv_cache_gib,
        block_size=block_size,
        max_model_len=max_model_len,
        gateway=gateway,
        omp_bind=omp_bind,
        connector=connector,
    )
    wait_serving(server, startup_timeout_s)
    return server
