"""``kvmesh --version`` names the installed distribution's version."""

from __future__ import annotations

import importlib.metadata

import pytest

from kvmesh.cli.main import main


def test_version_prints_the_installed_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.strip() == f"kvmesh {importlib.metadata.version('kvmesh')}"
