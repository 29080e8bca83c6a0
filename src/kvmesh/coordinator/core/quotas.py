"""Per-salt L2 quotas: operator intent, saved as metadata (docs/coordinator.md, "Quotas").

As in LMCache 0.5.6 the default quota is explicit: None (the boot state)
exempts salts without a quota, 0 arms allowlist eviction, > 0 is a per-salt
budget. :class:`~.eviction.FleetEvictionController` reads the effective limit
of each salt when it plans.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

from kvmesh.common.errors import InvalidArgument
from kvmesh.common.keys import validate_cache_salt

from .persistence import PersistenceType


class QuotaManager:
    """Per-salt L2 byte limits plus an explicit default (None = unquota'd salts exempt)."""

    name = "quotas"
    persistence_type = PersistenceType.METADATA

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._limits: dict[str, int] = {}
        self._default: int | None = None

    def set_quota(self, cache_salt: str, limit_bytes: int) -> None:
        """Set ``cache_salt``'s limit; 0 is allowed (evict everything, still listed)."""
        validate_cache_salt(cache_salt)
        if limit_bytes < 0:
            raise InvalidArgument("quota limit must be >= 0 bytes", field="limit_bytes")
        with self._lock:
            self._limits[cache_salt] = int(limit_bytes)

    def delete_quota(self, cache_salt: str) -> bool:
        """Remove ``cache_salt``'s limit; False when it had none."""
        with self._lock:
            return self._limits.pop(cache_salt, None) is not None

    def get_limit_bytes(self, cache_salt: str) -> int:
        """Explicit limit of ``cache_salt`` (0 when it has none)."""
        with self._lock:
            return self._limits.get(cache_salt, 0)

    def has_quota(self, cache_salt: str) -> bool:
        """True when ``cache_salt`` has an explicit limit."""
        with self._lock:
            return cache_salt in self._limits

    def effective_limit_bytes(self, cache_salt: str) -> int | None:
        """The explicit limit, else the default; None means exempt."""
        with self._lock:
            return self._limits.get(cache_salt, self._default)

    def list_quotas(self) -> dict[str, int]:
        """Every explicit limit."""
        with self._lock:
            return dict(self._limits)

    def set_default_limit_bytes(self, limit_bytes: int | None) -> None:
        """Set the default for salts without a quota (None = exempt)."""
        if limit_bytes is not None and limit_bytes < 0:
            raise InvalidArgument("default quota must be >= 0 bytes or unset", field="limit_bytes")
        with self._lock:
            self._default = None if limit_bytes is None else int(limit_bytes)

    def get_default_limit_bytes(self) -> int | None:
        """The default limit (None = unquota'd salts are exempt)."""
        with self._lock:
            return self._default

    def capture(self) -> dict[str, object]:
        """``{"limits": {salt: bytes}, "default_limit_bytes": int | None}``."""
        with self._lock:
            return {"limits": dict(self._limits), "default_limit_bytes": self._default}

    def restore(self, state: object) -> None:
        """Replace the quotas with a capture."""
        if not isinstance(state, Mapping):
            raise TypeError("quotas state must be a mapping")
        limits = state.get("limits", {})
        default = state.get("default_limit_bytes")
        if not isinstance(limits, Mapping) or not all(
            isinstance(k, str) and isinstance(v, int) and v >= 0 for k, v in limits.items()
        ):
            raise ValueError("quotas state has malformed limits")
        if default is not None and (not isinstance(default, int) or default < 0):
            raise ValueError("quotas state has a malformed default")
        with self._lock:
            self._limits = dict(limits)
            self._default = default
