"""``python -m kvmesh.bench.route [--json]``."""

from . import main

main()
