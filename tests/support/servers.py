"""Pytest fixtures that run real backend servers on free loopback ports.

Each server is a real child process (redis-server, a moto S3 server,
nats-server) wrapped in a :class:`ServerProcess` handle::

    handle.host, handle.port, handle.url     # where to connect
    handle.kill()                            # SIGKILL and reap (a crash)
    handle.stop()                            # SIGTERM, then SIGKILL after 5 s
    handle.start() / handle.restart()        # (re)start on the same port
    handle.pause() / handle.resume()         # SIGSTOP / SIGCONT (a hung server)
    handle.running

Fixtures:

- ``redis_server``  — a session-wide redis-server (``--save "" --appendonly no``);
  function scoped wrapper that restarts it if an earlier test killed it.
- ``s3_server``     — a session-wide moto S3 server (``python -m moto.server``);
  ``handle.url`` is the endpoint URL.
- ``nats_server``   — a session-wide ``nats-server -js`` with its store in a temp dir;
  ``handle.url`` is ``nats://127.0.0.1:PORT``.
- ``redis_server_factory`` / ``s3_server_factory`` / ``nats_server_factory`` — call
  to get a dedicated server (for kill/restart tests, so the shared one is never
  disturbed); stopped at the end of the test.

A missing binary skips the test, unless ``KVMESH_REQUIRE_SERVICES=1`` (CI),
which fails it. Readiness is polled with a deadline, never a fixed sleep.
Children are started through ``setpriv --pdeathsig KILL`` so they die with the
test process even if it is killed.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.support.ports import free_port

READY_TIMEOUT_S = 20.0
_START_ATTEMPTS = 3


def _missing(what: str) -> None:
    """Skip, or fail under KVMESH_REQUIRE_SERVICES=1, because a service cannot run."""
    if os.environ.get("KVMESH_REQUIRE_SERVICES") == "1":
        pytest.fail(f"{what} (KVMESH_REQUIRE_SERVICES=1 requires it)", pytrace=False)
    pytest.skip(what, allow_module_level=True)


def require_vllm() -> None:
    """Skip, or fail under KVMESH_REQUIRE_SERVICES=1, while vLLM is not installed."""
    if importlib.util.find_spec("vllm") is None:
        _missing("vLLM is not installed (pip install 'kvmesh[vllm]')")


# setpriv (util-linux) sets PR_SET_PDEATHSIG and execs the server, so no server
# outlives a killed test run. A preexec_fn would do the same from Python, but
# running Python between fork and exec is unsafe while gRPC threads exist.
_SETPRIV = shutil.which("setpriv")


def _die_with_parent(command: list[str]) -> list[str]:
    if _SETPRIV is None or not sys.platform.startswith("linux"):
        return command
    return [_SETPRIV, "--pdeathsig", "KILL", "--", *command]


class ServerStartError(RuntimeError):
    """The server process exited or never became ready."""


class ServerProcess:
    """A server child process on a fixed loopback port; restartable on that port."""

    def __init__(
        self,
        name: str,
        command: Callable[[int], list[str]],
        ready: Callable[[ServerProcess], bool],
        scheme: str,
        workdir: Path,
        port: int | None = None,
    ) -> None:
        self.name = name
        self.host = "127.0.0.1"
        self.port = port or free_port()
        self._command = command
        self._ready = ready
        self._scheme = scheme
        self.workdir = workdir
        self.log_path = workdir / f"{name}.log"
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """``<scheme>://127.0.0.1:<port>``."""
        return f"{self._scheme}://{self.host}:{self.port}"

    @property
    def address(self) -> tuple[str, int]:
        """``(host, port)``."""
        return self.host, self.port

    @property
    def pid(self) -> int | None:
        """Process id while started."""
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        """True while the process is alive."""
        return self._proc is not None and self._proc.poll() is None

    def log_tail(self, limit: int = 2000) -> str:
        """The end of the server's log, for failure messages."""
        try:
            return self.log_path.read_text(errors="replace")[-limit:]
        except OSError:
            return ""

    def start(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Start the server on ``self.port`` and wait until it answers."""
        if self.running:
            return
        with self.log_path.open("ab") as log:
            self._proc = subprocess.Popen(
                _die_with_parent(self._command(self.port)),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.workdir,
            )
        deadline = time.monotonic() + timeout_s
        pause = 0.01
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise ServerStartError(
                    f"{self.name} exited with {self._proc.returncode}:\n{self.log_tail()}"
                )
            if self._ready(self):
                return
            time.sleep(pause)  # polling interval, bounded by the deadline above
            pause = min(pause * 2, 0.2)
        self.kill()
        raise ServerStartError(f"{self.name} not ready within {timeout_s} s:\n{self.log_tail()}")

    def kill(self) -> None:
        """SIGKILL the server and reap it (a crash: nothing is flushed)."""
        if self._proc is None:
            return
        if self._proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self._proc.send_signal(signal.SIGCONT)  # a paused process must wake to die
            self._proc.kill()
        self._proc.wait(timeout=10)
        self._proc = None

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it does not exit within 5 s."""
        if self._proc is None:
            return
        if self._proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self._proc.send_signal(signal.SIGCONT)
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(timeout=10)
        self._proc = None

    def restart(self) -> None:
        """Kill (if running) and start again on the same port."""
        self.kill()
        self.start()

    def pause(self) -> None:
        """SIGSTOP: the port stays open but nothing answers (a hung server)."""
        if self._proc is not None:
            self._proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT after :meth:`pause`."""
        if self._proc is not None:
            self._proc.send_signal(signal.SIGCONT)


def _start_on_free_port(make: Callable[[int | None], ServerProcess]) -> ServerProcess:
    """Start a server; retry on a new port when another process grabbed the chosen one."""
    error: ServerStartError | None = None
    for _ in range(_START_ATTEMPTS):
        server = make(None)
        try:
            server.start()
        except ServerStartError as exc:
            error = exc
            server.kill()
            continue
        return server
    raise error or ServerStartError("could not start")


def _tcp_exchange(server: ServerProcess, payload: bytes, expect: bytes) -> bool:
    try:
        with socket.create_connection(server.address, timeout=1.0) as sock:
            if payload:
                sock.sendall(payload)
            data = b""
            while len(data) < len(expect):
                chunk = sock.recv(4096)
                if not chunk:
                    return False
                data += chunk
            return data.startswith(expect)
    except OSError:
        return False


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as response:
            return bool(200 <= response.status < 300)
    except (OSError, urllib.error.URLError):
        return False


# -- redis -----------------------------------------------------------------------------------


def redis_binary() -> str | None:
    """redis-server (or valkey-server), overridable with KVMESH_REDIS_SERVER."""
    override = os.environ.get("KVMESH_REDIS_SERVER")
    if override:
        return shutil.which(override)
    return shutil.which("redis-server") or shutil.which("valkey-server")


def make_redis_server(workdir: Path, port: int | None = None) -> ServerProcess:
    """A redis-server handle (not started) with persistence off."""
    binary = redis_binary()
    if binary is None:
        raise FileNotFoundError("redis-server")

    def command(p: int) -> list[str]:
        return [
            binary,
            "--port", str(p),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", str(workdir),
            "--daemonize", "no",
        ]  # fmt: skip

    return ServerProcess(
        "redis",
        command,
        lambda s: _tcp_exchange(s, b"PING\r\n", b"+PONG"),
        "redis",
        workdir,
        port,
    )


# -- S3 (moto) -------------------------------------------------------------------------------


def moto_available() -> bool:
    """True when moto's server mode (flask, werkzeug) can be imported."""
    return all(importlib.util.find_spec(m) is not None for m in ("moto", "flask", "werkzeug"))


def make_s3_server(workdir: Path, port: int | None = None) -> ServerProcess:
    """A moto S3 server handle (not started); state lives in its memory only."""
    if not moto_available():
        raise FileNotFoundError("moto[server]")

    def command(p: int) -> list[str]:
        return [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(p)]

    return ServerProcess(
        "s3", command, lambda s: _http_ok(f"{s.url}/moto-api/"), "http", workdir, port
    )


# -- NATS ------------------------------------------------------------------------------------


def nats_binary() -> str | None:
    """nats-server, overridable with KVMESH_NATS_SERVER."""
    return shutil.which(os.environ.get("KVMESH_NATS_SERVER", "nats-server"))


def _nats_ready(server: ServerProcess) -> bool:
    # The client port sends INFO at once; JetStream must also be up, which the
    # INFO line reports.
    try:
        with socket.create_connection(server.address, timeout=1.0) as sock:
            line = b""
            while not line.endswith(b"\r\n"):
                chunk = sock.recv(4096)
                if not chunk:
                    return False
                line += chunk
    except OSError:
        return False
    if not line.startswith(b"INFO "):
        return False
    try:
        info = json.loads(line[5:].strip())
    except ValueError:
        return False
    return bool(info.get("jetstream"))


def make_nats_server(workdir: Path, port: int | None = None) -> ServerProcess:
    """A nats-server handle (not started) with JetStream storing under ``workdir``."""
    binary = nats_binary()
    if binary is None:
        raise FileNotFoundError("nats-server")
    store = workdir / "jetstream"
    store.mkdir(exist_ok=True)

    def command(p: int) -> list[str]:
        return [binary, "-js", "-a", "127.0.0.1", "-p", str(p), "-sd", str(store)]

    return ServerProcess("nats", command, _nats_ready, "nats", workdir, port)


# -- fixtures --------------------------------------------------------------------------------

_MAKERS: dict[str, Callable[[Path, int | None], ServerProcess]] = {
    "redis": make_redis_server,
    "s3": make_s3_server,
    "nats": make_nats_server,
}


def _launch(kind: str, workdir: Path) -> ServerProcess:
    try:
        return _start_on_free_port(lambda port: _MAKERS[kind](workdir, port))
    except FileNotFoundError as exc:
        _missing(f"{exc.args[0]} is not installed")
        raise  # unreachable: _missing raises


@contextlib.contextmanager
def _session_server(kind: str) -> Iterator[ServerProcess]:
    workdir = Path(tempfile.mkdtemp(prefix=f"kvmesh-{kind}-"))
    server: ServerProcess | None = None
    try:
        server = _launch(kind, workdir)
        yield server
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def _ensure_running(server: ServerProcess) -> ServerProcess:
    # A test may kill the shared server on purpose; the next one gets it back.
    if not server.running:
        server.start()
    return server


@pytest.fixture(scope="session")
def _redis_session() -> Iterator[ServerProcess]:
    with _session_server("redis") as server:
        yield server


@pytest.fixture
def redis_server(_redis_session: ServerProcess) -> ServerProcess:
    """A running redis-server shared by the session; ``.host``, ``.port``, ``.url``."""
    return _ensure_running(_redis_session)


@pytest.fixture(scope="session")
def _s3_session() -> Iterator[ServerProcess]:
    with _session_server("s3") as server:
        yield server


@pytest.fixture
def s3_server(_s3_session: ServerProcess) -> ServerProcess:
    """A running moto S3 server shared by the session; ``.url`` is the endpoint URL."""
    return _ensure_running(_s3_session)


@pytest.fixture(scope="session")
def _nats_session() -> Iterator[ServerProcess]:
    with _session_server("nats") as server:
        yield server


@pytest.fixture
def nats_server(_nats_session: ServerProcess) -> ServerProcess:
    """A running ``nats-server -js`` shared by the session; ``.url`` is ``nats://...``."""
    return _ensure_running(_nats_session)


def _factory(kind: str, tmp_path: Path) -> Iterator[Callable[[], ServerProcess]]:
    started: list[ServerProcess] = []

    def start() -> ServerProcess:
        workdir = tmp_path / f"{kind}-{len(started)}"
        workdir.mkdir()
        server = _launch(kind, workdir)
        started.append(server)
        return server

    try:
        yield start
    finally:
        for server in started:
            server.stop()


@pytest.fixture
def redis_server_factory(tmp_path: Path) -> Iterator[Callable[[], ServerProcess]]:
    """Call to start a dedicated redis-server for this test (kill/restart at will)."""
    yield from _factory("redis", tmp_path)


@pytest.fixture
def s3_server_factory(tmp_path: Path) -> Iterator[Callable[[], ServerProcess]]:
    """Call to start a dedicated moto S3 server for this test."""
    yield from _factory("s3", tmp_path)


@pytest.fixture
def nats_server_factory(tmp_path: Path) -> Iterator[Callable[[], ServerProcess]]:
    """Call to start a dedicated nats-server for this test (restarts keep its store)."""
    yield from _factory("nats", tmp_path)
