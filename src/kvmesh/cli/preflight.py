"""``kvmesh up`` checks every service's settings before it starts any process.

Each service resolves its settings the way its own process will (flags,
``KVMESH_*`` variables, the ``--config`` file), so a bad one is one line from
``up`` (exit 2) instead of a child that dies during start-up.
"""

from __future__ import annotations

import os
from typing import Any

from kvmesh.common.config import ConfigError, resolve


def check_settings(options: Any) -> None:
    """Raise ConfigError (or a missing extra's ImportError) for what would fail a service.

    ``options``: the :class:`kvmesh.cli.fleet.FleetOptions` of the fleet to start.
    """
    from kvmesh.coordinator.config import CoordinatorConfig
    from kvmesh.gateway.config import GatewayConfig
    from kvmesh.node.config import NodeConfig
    from kvmesh.storage.config import StorageConfig

    common: dict[str, Any] = {"port": 0, "log_level": options.log_level}
    storage = {**common, "l2": options.l2 or None, "l1_size_bytes": options.l1_size_bytes}
    checks: list[tuple[Any, str, dict[str, Any]]] = [(CoordinatorConfig, "coordinator", common)]
    if options.colocated:
        checks.append((NodeConfig, "node", storage))
    else:
        checks += [(StorageConfig, "storage", storage), (GatewayConfig, "gateway", common)]
    for cls, service, flags in checks:
        resolve(cls, service, flags=flags, yaml_path=options.config)
    need = options.nodes * options.l1_size_bytes
    st = os.statvfs("/dev/shm")
    free = st.f_bavail * st.f_frsize
    if need > free:
        raise ConfigError(
            f"--l1-size {options.l1_size_bytes} x {options.nodes} node(s) is larger than the "
            f"free space of /dev/shm ({free / 1024**3:.1f} GiB); lower --l1-size or --nodes"
        )
