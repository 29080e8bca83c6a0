"""Core settings (docs/coordinator.md, "Settings")."""

from __future__ import annotations

import pytest

from kvmesh.common.errors import InvalidArgument
from kvmesh.coordinator.core import CoordinatorSettings


def test_defaults_are_valid_and_match_lmcache() -> None:
    """Defaults construct; values are LMCache's where it has them."""
    s = CoordinatorSettings()
    assert (s.instance_timeout, s.health_check_interval, s.eviction_check_interval) == (
        30.0,
        10.0,
        5.0,
    )
    assert (s.eviction_ratio, s.trigger_watermark, s.chunk_size) == (0.2, 1.0, 256)
    assert (s.checkpoint_path, s.metadata_path, s.checkpoint_interval) == ("", "", 60.0)
    assert s.max_delete_batch == 10_000


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("instance_timeout", 0),
        ("health_check_interval", -1),
        ("eviction_check_interval", -0.5),
        ("eviction_ratio", 1.5),
        ("trigger_watermark", 0.0),
        ("chunk_size", 0),
        ("checkpoint_interval", -1),
        ("heartbeat_interval", 0),
        ("max_delete_batch", 10_001),
        ("token_binding_cap", -1),
        ("instance_timeout", float("nan")),
    ],
)
def test_out_of_range_values_raise_naming_the_field(field: str, value: float) -> None:
    """Instance_timeout 0, health_check_interval -1 (and friends) raise."""
    with pytest.raises(InvalidArgument) as info:
        CoordinatorSettings(**{field: value})  # type: ignore[arg-type]
    assert info.value.field == field


def test_explicit_values_are_kept() -> None:
    s = CoordinatorSettings(
        instance_timeout=3.5, health_check_interval=0, checkpoint_path="/x", eviction_ratio=1.0
    )
    assert (s.instance_timeout, s.health_check_interval, s.checkpoint_path) == (3.5, 0, "/x")
    assert s.eviction_ratio == 1.0
