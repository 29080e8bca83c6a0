"""``kv_connector_extra_config`` → the connector's settings, with one clear error per bad key.

Imports nothing from vLLM, so the parsing is tested without an engine.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

#: Where the connector finds the gateway when the config names none: the address
#: ``kvmesh node`` and ``kvmesh gateway`` listen on by default (a test pins the two).
DEFAULT_GATEWAY = "127.0.0.1:8302"


@dataclass(frozen=True)
class VLLMSettings:
    """What an operator sets in ``kv_connector_extra_config`` (all optional)."""

    #: Gateway target: ``host:port``, ``unix:PATH`` or ``lane:PATH`` (the node's local lane).
    gateway: str = DEFAULT_GATEWAY
    #: Cache-key model name; vLLM's ``model_config.model`` when empty.
    model_name: str = ""
    #: A lookup unfinished after this long is a miss (vLLM recomputes).
    lookup_timeout_s: float = 30.0
    #: The first lookup of a request waits this long for its answer before the scheduler
    #: moves on (an L1 hit answers within it; an L2 load is polled in later steps).
    lookup_wait_ms: int = 20
    #: Deadline of every RPC to the gateway but the registration: kvmesh slow or down
    #: costs at most this.
    rpc_timeout_s: float = 5.0
    #: Deadline of the KV registration (once per worker as vLLM starts, and again if a
    #: restarted gateway forgot the engine): the node maps the KV memory for it, and at
    #: its first registration loads torch, which takes seconds on a loaded host.
    register_timeout_s: float = 30.0
    #: Threads that run the worker's retrieves and stores.
    transfer_threads: int = 2
    #: Folder of the shared-memory file vLLM's KV cache is allocated in (storage maps it).
    shm_dir: str = "/dev/shm"
    #: Keep vLLM's ``kv_load_failure_policy`` as configured even when it is "fail".
    keep_failure_policy: bool = False
    #: Level of kvmesh's own log lines in vLLM's output (DEBUG shows per-request timings).
    log_level: str = "INFO"
    #: Store a prompt once its whole prefill ran, not after each 4096-token prefill step
    #: (stores beside the next step's forward slow it down on a small CPU host).
    store_after_prefill: bool = True
    #: Seconds between heartbeats of the scheduler and each worker; the node reaps an
    #: engine silent for its ``engine_reap_seconds`` (its KV memory, its leases).
    heartbeat_s: float = 2.0
    #: Give vLLM's KV file a name in ``shm_dir`` instead of none: only for a node that
    #: cannot open vLLM's ``/proc/<pid>/fd`` (another PID namespace). A named file is
    #: removed when vLLM stops, or by the next engine if vLLM is killed.
    named_kv_file: bool = False
    #: Load a hit in parts by layers while the forward pass runs: each layer's attention
    #: waits only for its own part (docs/vllm.md, "Loads by layer"). "false": the whole
    #: load finishes before the forward pass starts; "auto": by layer on GPUs only.
    load_by_layer: str = "auto"
    #: The scheduler starts each load as soon as it allocated the blocks, and the worker's
    #: retrieve joins it (docs/vllm.md, "Loads started by the scheduler"). Taken only where
    #: it is safe: KV in host memory (CPU), one worker, whole loads. Off by default: on a
    #: 2-core host the early copy competes with vLLM's busy-polling processes and made
    #: the OpenAI server's hits slower.
    load_ahead: bool = False


_FIELDS: dict[str, type] = {
    "gateway": str,
    "model_name": str,
    "lookup_timeout_s": float,
    "lookup_wait_ms": int,
    "rpc_timeout_s": float,
    "register_timeout_s": float,
    "transfer_threads": int,
    "shm_dir": str,
    "keep_failure_policy": bool,
    "log_level": str,
    "store_after_prefill": bool,
    "heartbeat_s": float,
    "named_kv_file": bool,
    "load_by_layer": str,
    "load_ahead": bool,
}
#: Values of ``load_by_layer`` (JSON booleans are taken as "true" and "false").
LOAD_BY_LAYER = ("auto", "true", "false")
_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


class SettingsError(ValueError):
    """A bad ``kv_connector_extra_config`` entry (the message names the key and what is valid)."""


def parse_settings(extra: Mapping[str, Any] | None) -> VLLMSettings:
    """Read the connector's keys; keys may be written bare or as ``kvmesh.<key>``."""
    values: dict[str, Any] = {}
    for raw_key, value in (extra or {}).items():
        key = raw_key.removeprefix("kvmesh.")
        kind = _FIELDS.get(key)
        if kind is None:
            raise SettingsError(
                f"kv_connector_extra_config: unknown key {raw_key!r} "
                f"(valid: {', '.join(sorted(_FIELDS))})"
            )
        if key == "load_by_layer" and isinstance(value, bool):
            values[key] = "true" if value else "false"
            continue
        values[key] = _coerce(raw_key, value, kind)
    settings = VLLMSettings(**values)
    if settings.load_by_layer not in LOAD_BY_LAYER:
        raise SettingsError(
            f"kv_connector_extra_config: 'load_by_layer' must be one of "
            f"{', '.join(LOAD_BY_LAYER)}, got {settings.load_by_layer!r}"
        )
    if not settings.gateway.strip():
        raise SettingsError("kv_connector_extra_config: 'gateway' must not be empty")
    for key in ("lookup_timeout_s", "rpc_timeout_s", "register_timeout_s", "heartbeat_s"):
        number = getattr(settings, key)
        if not math.isfinite(number) or number <= 0:
            raise SettingsError(f"kv_connector_extra_config: {key!r} must be > 0, got {number}")
    if settings.log_level.upper() not in _LEVELS:
        raise SettingsError(
            f"kv_connector_extra_config: 'log_level' must be one of {', '.join(_LEVELS)}, "
            f"got {settings.log_level!r}"
        )
    if not 0 <= settings.lookup_wait_ms <= 1000:
        raise SettingsError(
            f"kv_connector_extra_config: 'lookup_wait_ms' must be in [0, 1000], "
            f"got {settings.lookup_wait_ms}"
        )
    if settings.transfer_threads < 1:
        raise SettingsError(
            f"kv_connector_extra_config: 'transfer_threads' must be >= 1, "
            f"got {settings.transfer_threads}"
        )
    return settings


def loads_by_layer(setting: str, device_type: str) -> bool:
    """Whether loads go by layer (the ``load_by_layer`` setting, docs/vllm.md, "Loads by layer").

    "auto": on GPUs, where the node's copy and the forward pass use different
    hardware. On a CPU host the forward pass waits less but runs slower beside
    the copy (both are memory-bound), and the time to first token measured no
    better (docs/performance.md, "Loads by layer"): "true" turns it on there.
    """
    if setting != "auto":
        return setting == "true"
    return device_type != "cpu"


def _coerce(key: str, value: Any, kind: type) -> Any:
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
            return value.lower() in ("true", "1")
        raise SettingsError(
            f"kv_connector_extra_config: {key!r} must be true or false, got {value!r}"
        )
    if kind is str:
        if not isinstance(value, str):
            raise SettingsError(
                f"kv_connector_extra_config: {key!r} must be a string, got {value!r}"
            )
        return value
    if isinstance(value, bool):
        raise SettingsError(f"kv_connector_extra_config: {key!r} must be a number, got {value!r}")
    try:
        return kind(value)
    except (TypeError, ValueError):
        raise SettingsError(
            f"kv_connector_extra_config: {key!r} must be {kind.__name__}, got {value!r}"
        ) from None
