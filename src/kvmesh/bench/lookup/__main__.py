"""``python -m kvmesh.bench.lookup [--json]``."""

from . import main

main()
