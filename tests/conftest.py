"""Shared test configuration.

Fixtures that start real backend processes (redis-server, nats-server, an
S3-compatible server) live in tests/support/servers.py. When KVMESH_REQUIRE_SERVICES=1
(set by CI), a missing server binary fails the test instead of skipping it.
"""

pytest_plugins = ["tests.support.servers"]
