"""The CLI's one error path and its start-up helpers, without starting a service."""

from __future__ import annotations

import logging
import socket
from pathlib import Path

import pytest

from kvmesh.cli.main import main
from kvmesh.cli.startup import StartupLogs, missing_extra, one_line, reserve_port
from kvmesh.common.config import ConfigError, resolve
from kvmesh.common.errors import FailedPrecondition
from kvmesh.coordinator.config import CoordinatorConfig
from kvmesh.rpc.server import ServerSettings
from kvmesh.storage.config import StorageConfig


@pytest.mark.parametrize(
    ("module", "extra"),
    [("redis", "redis"), ("boto3", "s3"), ("botocore.config", "s3"), ("nats.aio", "nats")],
)
def test_a_missing_optional_package_names_its_extra(module: str, extra: str) -> None:
    exc = ModuleNotFoundError(f"No module named {module!r}", name=module)
    reason = one_line(exc)
    assert reason == missing_extra(exc)
    assert reason is not None
    assert f"pip install 'kvmesh[{extra}]'" in reason
    assert module.partition(".")[0] in reason


def test_a_bug_is_not_turned_into_one_line() -> None:
    assert one_line(ModuleNotFoundError("No module named 'numpyy'", name="numpyy")) is None
    assert one_line(KeyError("x")) is None
    assert one_line(FailedPrecondition("in use")) == "in use"
    assert one_line(PermissionError(13, "Permission denied", "/x")) == "/x: Permission denied"


def test_environment_values_are_reported_under_their_variable() -> None:
    with pytest.raises(ConfigError, match=r"^environment variable KVMESH_COORDINATOR_PORT: "):
        resolve(CoordinatorConfig, "coordinator", environ={"KVMESH_COORDINATOR_PORT": "abc"})
    with pytest.raises(ConfigError, match=r"^--port: cannot read 'x' as an integer$"):
        resolve(CoordinatorConfig, "coordinator", flags={"port": "x"}, environ={})


def test_yaml_values_are_reported_under_the_file(tmp_path: Path) -> None:
    config = tmp_path / "k.yaml"
    config.write_text("storage:\n  l1_size_bytes: lots\n")
    with pytest.raises(ConfigError, match=rf"^config file {config}: l1_size_bytes: not a size"):
        resolve(StorageConfig, "storage", yaml_path=config, environ={})


def test_bad_l2_lists_the_shorthands() -> None:
    with pytest.raises(ConfigError, match=r"unknown L2 adapter type 'memcached'.*disk, none"):
        resolve(StorageConfig, "storage", flags={"l2": ['{"type": "memcached"}']}, environ={})


def test_reserved_port_is_the_one_the_settings_name() -> None:
    settings, sock = reserve_port(ServerSettings(port=0))
    assert sock is not None
    try:
        assert settings.port == sock.getsockname()[1] > 0
        # Nobody else is handed that port while it is reserved...
        with socket.socket() as other, pytest.raises(OSError, match="in use"):
            other.bind(("127.0.0.1", settings.port))
    finally:
        sock.close()
    # ...and a fixed port is left alone.
    assert reserve_port(ServerSettings(port=1234)) == (ServerSettings(port=1234), None)


def test_startup_logs_are_held_then_written_or_dropped(
    capsys: pytest.CaptureFixture[str],
) -> None:
    root = logging.getLogger()
    handler = logging.StreamHandler()
    root.addHandler(handler)
    level = root.level
    root.setLevel(logging.INFO)
    try:
        held = StartupLogs()
        logging.getLogger("t").info("before failure")
        held.drop()
        assert "before failure" not in capsys.readouterr().err
        held = StartupLogs()
        logging.getLogger("t").info("before success")
        assert "before success" not in capsys.readouterr().err
        held.release()
        assert "before success" in capsys.readouterr().err
        assert root.handlers[-1] is handler
    finally:
        root.removeHandler(handler)
        root.setLevel(level)


def test_bench_name_may_follow_its_options(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["bench", "--json", "lookup", "--help"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.startswith("usage: kvmesh bench lookup")
