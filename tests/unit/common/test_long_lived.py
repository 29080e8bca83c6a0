"""``freeze_long_lived`` / ``freeze_more``: start-up objects out of full collections.

Run in a child interpreter: freezing is process-wide, and a pytest worker must
keep collecting what its tests leave behind.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap


def _run(code: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    return done.stdout.strip()


def test_a_service_freezes_its_start_up_and_later_one_time_loads() -> None:
    out = _run(
        """
        import gc
        from kvmesh.common import long_lived
        assert long_lived.freeze_more("before") == 0  # not a service yet: nothing
        assert gc.get_freeze_count() == 0
        started = [object() for _ in range(10)]
        tracked = [[] for _ in range(1000)]  # container objects: tracked by the collector
        frozen = long_lived.freeze_long_lived("test")
        assert frozen == gc.get_freeze_count() > 1000
        assert not any(obj is tracked[0] for obj in gc.get_objects())
        later = [[] for _ in range(500)]
        assert long_lived.freeze_more("later") >= frozen + 500
        print("ok")
        """
    )
    assert out == "ok"


def test_freeze_more_does_nothing_in_a_process_that_is_not_a_service() -> None:
    out = _run(
        """
        import gc
        from kvmesh.common import long_lived
        keep = [[] for _ in range(100)]
        print(long_lived.freeze_more("torch"), gc.get_freeze_count())
        """
    )
    assert out == "0 0"
