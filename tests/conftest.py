"""Shared test configuration.

Fixtures that start real backend processes (redis-server, nats-server, an
S3-compatible server) live in tests/support/servers.py. When KVMESH_REQUIRE_SERVICES=1
(set by CI), a missing server binary fails the test instead of skipping it.
"""

pytest_plugins = ["tests.support.servers"]

import atexit  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

# `kvmesh up` writes a fleet file that `kvmesh status`/`demo` read by default: give
# this test run its own, so fleets of other runs on the host are never picked up.
if "KVMESH_FLEET_FILE" not in os.environ:
    _fleet_dir = tempfile.mkdtemp(prefix="kvmesh-tests-")
    atexit.register(shutil.rmtree, _fleet_dir, True)
    os.environ["KVMESH_FLEET_FILE"] = os.path.join(_fleet_dir, "fleet.json")
