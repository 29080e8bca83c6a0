"""``python -m kvmesh.cli``: the same as the ``kvmesh`` command."""

import sys

from kvmesh.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
