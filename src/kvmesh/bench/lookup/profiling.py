"""Where a profiled lookup's time goes: cProfile stats grouped by part of the stack."""

from __future__ import annotations

import pstats
from typing import Any

# Builtins that are waiting, not work (the loops' epoll, a blocked lock).
_IDLE = ("method 'poll' of 'select.epoll'", "method 'acquire' of '_thread.lock'")
# Builtins that are start-up (imports), not requests.
_STARTUP = ("compile", "marshal.loads", "_imp.create_dynamic", "builtins.exec", "__build_class__")


def _category(filename: str, func: str) -> str:
    """Which part of the stack a profiled function belongs to."""
    if filename == "~":
        if any(marker in func for marker in _IDLE):
            return "idle"
        if any(marker in func for marker in _STARTUP):
            return "startup"
        # Compiled code: gRPC's Cython layer and core (run from the loop's callbacks),
        # protobuf (upb), numpy, blake3 and the interpreter's builtins.
        return "compiled (grpc cython/core, protobuf, numpy, builtins)"
    if "importlib" in filename:
        return "startup"
    if "/asyncio/" in filename or filename.endswith("selectors.py"):
        return "asyncio"
    if "/grpc/" in filename:
        # The blocking client's own time in _blocking is its wait for the reply.
        return "idle" if func == "_blocking" else "grpc (python layer)"
    if "/kvmesh/" in filename:
        return "kvmesh"
    return "other python"


def _short(filename: str) -> str:
    for marker in ("site-packages/", "/work/main/", "lib/python3"):
        if marker in filename:
            return filename.split(marker, 1)[1]
    return filename


def profile_summary(stats: pstats.Stats, top: int, per: int) -> dict[str, Any]:
    """Busy time by part of the stack (µs per lookup) and the top kvmesh functions."""
    raw: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
    busy: dict[str, float] = {}
    ours: list[tuple[float, float, int, str]] = []
    for (filename, line, func), (_cc, calls, tottime, cumtime, _callers) in raw.items():
        category = _category(filename, func)
        busy[category] = busy.get(category, 0.0) + tottime
        if category == "kvmesh":
            ours.append((tottime, cumtime, calls, f"{_short(filename)}:{line}({func})"))
    for skipped in ("idle", "startup"):
        busy.pop(skipped, None)
    ours.sort(reverse=True)
    return {
        "busy_us_per_lookup": {
            k: round(v / per * 1e6, 1) for k, v in sorted(busy.items(), key=lambda kv: -kv[1])
        },
        "top_kvmesh_functions": [
            {
                "function": name,
                "calls": calls,
                "own_us_per_lookup": round(own / per * 1e6, 1),
                "cum_us_per_lookup": round(cum / per * 1e6, 1),
            }
            for own, cum, calls, name in ours[:top]
        ],
    }
