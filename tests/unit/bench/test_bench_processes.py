"""What a benchmark says when a process it started fails: the root cause, not only the tail."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvmesh.bench.common import ServiceProcess, service_deaths_named, start_service
from kvmesh.bench.route.fleet import UNIX_PATH_MAX, event_endpoints
from kvmesh.bench.serve.servers import Process, spawn, wait_ready


def _process(tmp_path: Path, text: str) -> Process:
    log = tmp_path / "server.log"
    log.write_text(text)
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return Process("server", proc, log)


def test_failure_names_the_first_traceback_and_the_tail(tmp_path: Path) -> None:
    cause = (
        "Traceback (most recent call last):\n  ...\nzmq.error.ZMQError: Address already in use\n"
    )
    noise = "".join(f"INFO line {i} from the frontend shutting down\n" for i in range(400))
    process = _process(tmp_path, "starting\n" + cause + noise + "RuntimeError: see above\n")
    report = process.failure(chars=1000)
    assert report.startswith("Traceback (most recent call last)")
    assert "Address already in use" in report
    assert report.endswith("RuntimeError: see above\n")
    assert "[...]" in report


def test_failure_is_the_tail_when_the_cause_is_in_it(tmp_path: Path) -> None:
    text = "INFO fine\n" * 5 + "(EngineCore) ERROR 12-05 boom\n"
    process = _process(tmp_path, text)
    assert process.failure(chars=1000) == text
    assert process.failure(chars=1000) == process.tail(chars=1000)


def test_failure_of_a_quiet_log_is_its_tail(tmp_path: Path) -> None:
    process = _process(tmp_path, "x" * 5000)
    assert process.failure(chars=100) == "x" * 100


def test_wait_ready_raises_with_the_root_cause_when_the_process_exits(tmp_path: Path) -> None:
    script = (
        "import sys\n"
        "print('Traceback (most recent call last):')\n"
        "print('OSError: the real cause')\n"
        "for i in range(300): print('INFO shutting down', i)\n"
        "sys.exit(3)\n"
    )
    process = spawn("demo", [sys.executable, "-c", script], tmp_path / "demo.log", {})
    process.proc.wait(30)
    with pytest.raises(RuntimeError) as err:
        wait_ready(lambda: False, process, 30, "demo server")
    message = str(err.value)
    assert message.startswith("demo server exited with 3:")
    assert "OSError: the real cause" in message


def test_event_endpoints_are_unix_sockets_in_the_run_folder(tmp_path: Path) -> None:
    events, replay = event_endpoints(tmp_path, "engine-0")
    assert events == f"ipc://{tmp_path}/engine-0-events.sock"
    assert replay == f"ipc://{tmp_path}/engine-0-replay.sock"


def test_event_endpoints_refuse_a_path_a_unix_socket_cannot_hold(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * UNIX_PATH_MAX)
    with pytest.raises(RuntimeError, match="longer than 107 bytes"):
        event_endpoints(deep, "engine-0")


def test_a_failure_names_the_service_that_died_with_its_log(tmp_path: Path) -> None:
    # A real `kvmesh coordinator` that cannot start: argparse refuses the option.
    owned: list[ServiceProcess] = []
    proc = start_service(owned, "coordinator", ["--no-such-option"], tmp_path, "coordinator")
    proc.proc.wait(60)
    try:
        with pytest.raises(RuntimeError) as err, service_deaths_named(owned):
            raise ConnectionError("failed to connect to all addresses: Connection refused")
    finally:
        proc.stop()
    message = str(err.value)
    assert message.startswith("failed to connect to all addresses: Connection refused\n")
    assert f"{tmp_path / 'coordinator.log'}: exited with 2; its log ends:" in message
    assert "--no-such-option" in message  # argparse's line from the service's log
    assert isinstance(err.value.__cause__, ConnectionError)


def test_a_failure_passes_unchanged_while_every_service_runs(tmp_path: Path) -> None:
    owned: list[ServiceProcess] = []
    proc = start_service(
        owned, "coordinator", ["--port", "0", "--metrics-port", "-1"], tmp_path, "coordinator"
    )
    try:
        proc.wait_ready(60)
        with pytest.raises(ValueError, match=r"^the benchmark's own$"), service_deaths_named(owned):
            raise ValueError("the benchmark's own")
        assert proc.exit_report() is None
    finally:
        proc.stop()
    assert proc.exit_report() is not None  # stopped: now it names its status
