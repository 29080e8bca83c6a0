"""The operator's metadata on the coordinator core: L2 quotas and pins.

:class:`OperatorMetadata` adds to :class:`~.components.CoreComponents` the
typed calls that change them; each change is saved to the metadata file
(sections ``quotas`` and ``pins``) before the call returns, so an
acknowledged change survives a restart. :class:`~.coordinator.Coordinator`
builds on it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from kvmesh.common.keys import ObjectKey

from . import tokens
from .components import CoreComponents
from .types import PinPage, PinResult


class OperatorMetadata(CoreComponents):
    """Quotas and pins, persisted on every change."""

    # -- quotas (metadata: saved before returning) ------------------------------

    def set_quota(self, cache_salt: str, limit_bytes: int) -> None:
        """Set an L2 quota for ``cache_salt`` and persist it."""
        self.quotas.set_quota(cache_salt, limit_bytes)
        self.metadata.save()

    def delete_quota(self, cache_salt: str) -> bool:
        """Remove ``cache_salt``'s quota (persisted even when absent); True if it existed."""
        existed = self.quotas.delete_quota(cache_salt)
        self.metadata.save()
        return existed

    def list_quotas(self) -> dict[str, int]:
        """Every explicit quota."""
        return self.quotas.list_quotas()

    def set_default_quota(self, limit_bytes: int | None) -> None:
        """Set the default quota (None = unquota'd salts exempt) and persist it."""
        self.quotas.set_default_limit_bytes(limit_bytes)
        self.metadata.save()

    def get_default_quota(self) -> int | None:
        """The default quota (None at boot)."""
        return self.quotas.get_default_limit_bytes()

    # -- pins ------------------------------------------------------------------

    def pin_keys(self, keys: Iterable[ObjectKey]) -> int:
        """Pin keys (one more pin each) and persist; returns the number of keys."""
        n = self.pins.pin(keys)
        self.metadata.save()
        return n

    def unpin_keys(self, keys: Iterable[ObjectKey]) -> int:
        """Remove one pin from each key and persist; returns the number of keys."""
        n = self.pins.unpin(keys)
        self.metadata.save()
        return n

    def pin_tokens(
        self,
        model_name: str,
        world_size: int,
        cache_salt: str,
        token_ids: Sequence[int] | np.ndarray,
    ) -> PinResult:
        """Pin every key of a token sequence (resolved locally).

        See docs/coordinator.md, "Token lookups".
        """
        keys, chunks = tokens.resolve_token_keys(
            self.hasher, model_name, world_size, cache_salt, token_ids
        )
        return PinResult(chunks, self.pin_keys(keys) if keys else 0)

    def unpin_tokens(
        self,
        model_name: str,
        world_size: int,
        cache_salt: str,
        token_ids: Sequence[int] | np.ndarray,
    ) -> PinResult:
        """Unpin every key of a token sequence."""
        keys, chunks = tokens.resolve_token_keys(
            self.hasher, model_name, world_size, cache_salt, token_ids
        )
        return PinResult(chunks, self.unpin_keys(keys) if keys else 0)

    def list_pins(
        self,
        cache_salt: str | None = None,
        model_name: str | None = None,
        limit: int = 1000,
        page_token: str = "",
    ) -> PinPage:
        """Pins in first-pinned order, optionally filtered by salt and model."""
        return self.pins.list_pins(cache_salt, model_name, limit, page_token)
