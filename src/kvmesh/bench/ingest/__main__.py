"""``python -m kvmesh.bench.ingest [--json]``."""

from . import main

main()
