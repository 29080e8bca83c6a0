"""Helpers to run real kvmesh servers from synchronous tests.

``ServerThread`` runs an asyncio loop on a background thread; servers
created there listen on free loopback ports and are stopped when the
context exits. Tests then talk to them with the real typed clients over
real sockets.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry

from kvmesh.rpc.server import Server, ServerSettings, ServiceApp, create_server
from tests.support.waiting import wait_until

T = TypeVar("T")
REPO_ROOT = Path(__file__).resolve().parents[2]


class ServerThread:
    """An event loop on its own thread, hosting servers for a test."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.servers: list[Server] = []

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 60.0) -> T:
        """Run a coroutine on the loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def start(self, settings: ServerSettings, factory: Callable[[Any], ServiceApp]) -> Server:
        """Create, bind and start a server whose app is ``factory(settings)``."""

        async def _start() -> Server:
            app = factory(settings)
            server = create_server(settings, app, registry=CollectorRegistry())
            await server.start()
            return server

        server = self.run(_start())
        self.servers.append(server)
        return server

    def stop(self, server: Server, grace: float = 0.5) -> None:
        """Stop one server."""
        self.run(server.stop(grace))
        if server in self.servers:
            self.servers.remove(server)

    def close(self) -> None:
        """Stop every server and the loop."""
        for server in list(reversed(self.servers)):
            with suppress(Exception):
                self.stop(server)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        self.loop.close()


@contextmanager
def server_thread() -> Iterator[ServerThread]:
    """A ServerThread that is always closed."""
    thread = ServerThread()
    try:
        yield thread
    finally:
        thread.close()


def no_thread_left_since(before: set[threading.Thread]) -> None:
    """Fail unless every thread started after ``before`` was taken has ended (waits up to 10 s)."""

    def extra() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t not in before and t.is_alive()]

    try:
        wait_until(lambda: not extra(), timeout=10.0)
    except AssertionError:
        raise AssertionError(f"threads still running: {[t.name for t in extra()]}") from None


def kvmesh_cli(
    *args: str, timeout: float = 60.0, **kwargs: Any
) -> subprocess.CompletedProcess[str]:
    """Run ``kvmesh ARGS`` in a subprocess with this interpreter; returns the completed process."""
    return subprocess.run(
        [sys.executable, "-m", "kvmesh.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO_ROOT,
        check=False,
        **kwargs,
    )


def spawn_cli(*args: str, **kwargs: Any) -> subprocess.Popen[str]:
    """Start ``kvmesh ARGS`` in the background."""
    return subprocess.Popen(
        [sys.executable, "-m", "kvmesh.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO_ROOT,
        **kwargs,
    )
