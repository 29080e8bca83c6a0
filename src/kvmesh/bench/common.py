"""Pieces the benchmarks share."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class LoopThread:
    """An asyncio loop on its own thread, for servers and clients a benchmark runs in-process."""

    def __init__(self, name: str = "kvmesh-bench-loop") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 600.0) -> T:
        """Run ``coro`` on the loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        """Stop the loop and join its thread."""
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        self.loop.close()


def bench_main(
    doc: str | None,
    add_arguments: Callable[[argparse.ArgumentParser], None],
    run: Callable[[argparse.Namespace], dict[str, Any]],
    format_table: Callable[[dict[str, Any]], str],
    argv: list[str] | None = None,
) -> None:
    """``python -m kvmesh.bench.<name> [--json]``: the same options as ``kvmesh bench <name>``."""
    parser = argparse.ArgumentParser(description=(doc or "").splitlines()[0])
    add_arguments(parser)
    if not any(a.dest == "json" for a in parser._actions):
        parser.add_argument("--json", action="store_true", help="print JSON")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    result = run(args)
    print(json.dumps(result, indent=2) if args.json else format_table(result))
