"""``python -m kvmesh.bench.datapath [--json]``."""

from . import main

main()
