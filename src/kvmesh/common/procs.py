"""Whether a process still runs: how owners of shared files are told from dead ones."""

from __future__ import annotations

import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)


def pid_alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie counts as dead: it will never clean up)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process, but alive
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except (OSError, IndexError):
        return not Path("/proc/self").exists()  # no procfs: trust kill(0)
