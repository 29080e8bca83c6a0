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

import pytest  # noqa: E402

# `kvmesh up` writes a fleet file that `kvmesh status`/`demo` and the benchmarks'
# --gateway read by default: give every test process its own registry and one fixed
# file, so fleets of other runs on the host, and of tests running at the same time
# on other xdist workers, are never picked up (tests of the registry itself unset
# KVMESH_FLEET_FILE). Set here, in each process, not inherited: xdist's workers
# start with the controller's environment, and one file shared by every worker let a
# benchmark on one worker take the gateway of a fleet another worker's test was
# about to kill.
_fleet_dir = tempfile.mkdtemp(prefix="kvmesh-tests-")
atexit.register(shutil.rmtree, _fleet_dir, True)
os.environ["KVMESH_FLEET_FILE"] = os.path.join(_fleet_dir, "fleet.json")
os.environ["KVMESH_FLEET_DIR"] = os.path.join(_fleet_dir, "fleets")


#: The modules that take the suite's time (real fleets, real vLLM), heaviest
#: group first. scripts/test runs the suite with ``--dist loadscope
#: --no-loadscope-reorder``: whole modules go to workers in collection order, so
#: these start first and the end of the run is quick unit modules spread over
#: every worker. (With xdist's default ``load``, the first worker got the first
#: 312 tests, every e2e test among them, and ran alone for the last 5 of 6.5
#: minutes.)
HEAVY_FIRST = (
    "tests/e2e/with_vllm/",
    "tests/e2e/",
    "tests/integration/p2p/",
    "tests/integration/cli/",
    "tests/integration/coordinator/",
)


def _module(item: pytest.Item) -> str:
    return item.nodeid.split("::", 1)[0]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Heavy modules first, real-vLLM modules taking turns with the other heavy ones.

    Each real-vLLM module starts one to three vLLM servers: four of them at
    once on two cores (what the first four modules would be otherwise) made
    each take several times longer than alone, past a test's timeout.
    """

    def rank(module: str) -> int:
        return next(
            (i for i, prefix in enumerate(HEAVY_FIRST) if module.startswith(prefix)),
            len(HEAVY_FIRST),
        )

    modules = sorted(dict.fromkeys(_module(item) for item in items), key=rank)
    vllm = [m for m in modules if rank(m) == 0]
    heavy = [m for m in modules if 0 < rank(m) < len(HEAVY_FIRST)]
    order: list[str] = []
    for i in range(max(len(vllm), len(heavy))):
        order += vllm[i : i + 1] + heavy[i : i + 1]
    order += [m for m in modules if rank(m) == len(HEAVY_FIRST)]
    position = {m: i for i, m in enumerate(order)}
    # Stable: each module keeps its tests together and in order.
    items.sort(key=lambda item: position[_module(item)])
