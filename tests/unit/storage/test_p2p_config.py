"""The storage node's P2P settings: the advertised address and the P2P bounds."""

from __future__ import annotations

import pytest

from kvmesh.common.config import ConfigError
from kvmesh.storage.config import StorageConfig, split_advertise_address


@pytest.mark.parametrize(
    ("address", "want"),
    [
        ("10.0.0.5:8301", ("10.0.0.5", 8301)),
        ("node-a.example", ("node-a.example", None)),
        ("[fd00::1]:9000", ("fd00::1", 9000)),
        ("fd00::1", ("fd00::1", None)),
        ("host:abc", ("host", -1)),
    ],
)
def test_advertise_addresses_split_into_host_and_port(
    address: str, want: tuple[str, int | None]
) -> None:
    assert split_advertise_address(address) == want


def test_a_wildcard_listener_with_a_coordinator_needs_an_advertised_address() -> None:
    base = {"host": "0.0.0.0", "coordinator_target": "127.0.0.1:8300"}
    with pytest.raises(ConfigError, match="needs --advertise-address"):
        StorageConfig(**base).validate()
    StorageConfig(**base, advertise_address="10.0.0.5").validate()
    StorageConfig(**base, p2p=False).validate()
    StorageConfig(host="0.0.0.0").validate()  # no coordinator: no peers to advertise to


@pytest.mark.parametrize("address", ["0.0.0.0:8301", "host:0", "host:70000", "a b:1", ":80"])
def test_unusable_advertised_addresses_are_refused(address: str) -> None:
    with pytest.raises(ConfigError, match="advertise_address"):
        StorageConfig(advertise_address=address).validate()


@pytest.mark.parametrize(
    "fields",
    [
        {"p2p_lookup_timeout": 0},
        {"p2p_load_timeout": -1},
        {"p2p_lease_ttl": 0},
        {"p2p_frame_bytes": 1024},
        {"p2p_frame_bytes": 32 * 1024**2},
        {"p2p_max_in_flight": 0},
        {"p2p_membership_refresh": -0.1},
        {"p2p_membership_refresh": 1.0},
    ],
)
def test_p2p_bounds_are_checked(fields: dict[str, float]) -> None:
    with pytest.raises(ConfigError, match="p2p_"):
        StorageConfig(**fields).validate()  # type: ignore[arg-type]


def test_p2p_defaults_match_lmcache_timeouts() -> None:
    config = StorageConfig()
    assert (config.p2p, config.p2p_lookup_timeout, config.p2p_load_timeout) == (True, 30.0, 30.0)
    config.validate()
