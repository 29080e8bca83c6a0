"""The vLLM runner never leaves an engine process behind.

A real engine takes most of a minute to start; these tests stand a plain
Python process, in a session of its own as the runner starts vLLM, in for it.
The runner's reading of real vLLM output is covered by tests/e2e/with_vllm.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvmesh.engine.vllm import runner
from tests.support.processes import alive
from tests.support.waiting import wait_until

#: A parent that starts a child in its group and sleeps: vLLM's worker and its engine core.
_PARENT = (
    "import subprocess, sys, time\n"
    "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
    "print(child.pid, flush=True)\n"
    "time.sleep(120)\n"
)


def _engine(tmp_path: Path) -> tuple[subprocess.Popen[str], int, Path]:
    spec = tmp_path / "spec.json"
    spec.write_text("{}")
    proc = subprocess.Popen(
        [sys.executable, "-c", _PARENT, str(spec)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert proc.stdout is not None
    child = int(proc.stdout.readline())
    return proc, child, spec


def test_an_interrupted_wait_kills_the_engine_and_its_children(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    proc, child, spec = _engine(tmp_path)

    def interrupted(*args: Any, **kwargs: Any) -> Any:
        raise SystemExit(143)  # what SIGTERM becomes in a benchmark (common/sigterm.py)

    monkeypatch.setattr(proc, "communicate", interrupted)
    with pytest.raises(SystemExit):
        runner.results_and_log(proc, timeout_s=60)
    assert proc.poll() is not None
    wait_until(lambda: not alive(child))
    assert not spec.exists()


def test_an_engine_past_its_limit_is_killed_and_named(tmp_path: Path) -> None:
    proc, child, spec = _engine(tmp_path)
    with pytest.raises(runner.EngineRunError, match="vLLM ran past 1 s"):
        runner.results_and_log(proc, timeout_s=1)
    assert proc.poll() is not None
    wait_until(lambda: not alive(child))
    assert not spec.exists()
