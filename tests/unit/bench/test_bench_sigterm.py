"""SIGTERM ends a benchmark through SystemExit, but never between a service's fork and the
moment the benchmark holds it (it would outlive the run, with its shared memory)."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvmesh.bench import common
from kvmesh.common.sigterm import exit_on_sigterm


@pytest.fixture
def sigterm_exits() -> Iterator[None]:
    previous = signal.getsignal(signal.SIGTERM)
    exit_on_sigterm()
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _sigterm_myself() -> None:
    os.kill(os.getpid(), signal.SIGTERM)
    for _ in range(1000):  # Python runs the handler between these bytecodes
        pass


class _StartsThenGetsSigterm:
    """Stands in for ServiceProcess: SIGTERM lands while it is being started."""

    def __init__(self, service: str, args: list[str], workdir: Path, name: str) -> None:
        _sigterm_myself()
        self.name = name


def test_a_sigterm_during_a_start_waits_until_the_caller_owns_the_service(
    sigterm_exits: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(common, "ServiceProcess", _StartsThenGetsSigterm)
    owned: list[common.ServiceProcess] = []
    with pytest.raises(SystemExit) as exited:
        common.start_service(owned, "node", [], tmp_path, "node")
    assert exited.value.code == 128 + signal.SIGTERM
    assert [p.name for p in owned] == ["node"]  # the finally that walks owned stops it


def test_a_sigterm_elsewhere_exits_at_once(sigterm_exits: None) -> None:
    with pytest.raises(SystemExit) as exited:
        _sigterm_myself()
    assert exited.value.code == 128 + signal.SIGTERM
