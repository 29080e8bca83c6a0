"""A range of an engine's layers: what one part of a load by layers copies (docs/vllm.md,
"Loads by layer")."""

from __future__ import annotations

from typing import Any

from kvmesh.common.errors import InvalidArgument


def check_layer_range(num_layers: int, start: int, end: int, field: str = "layers") -> None:
    """Raise :class:`InvalidArgument` unless ``0 <= start < end <= num_layers``."""
    if not 0 <= start < end <= num_layers:
        raise InvalidArgument(
            f"layer range [{start}, {end}) is not a non-empty range of the engine's "
            f"{num_layers} layers",
            field=field,
        )


def from_request(request: Any) -> tuple[int, int] | None:
    """A retrieve request's ``layers`` as ``(start, end)``, or None when it names none."""
    if not request.HasField("layers"):
        return None
    return request.layers.start, request.layers.end
