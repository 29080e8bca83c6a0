"""Run :mod:`kvmesh.engine.vllm.worker` in a subprocess and read its results."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from kvmesh.engine.vllm.worker import MARK, engine_env


class EngineRunError(RuntimeError):
    """The vLLM process failed; the message ends with the tail of its output."""


def start_engine(spec: dict[str, Any]) -> subprocess.Popen[str]:
    """Start one fresh vLLM process over ``spec`` (read it with :func:`results`)."""
    env = {**os.environ, **engine_env(int(spec.get("kv_cache_gib", 1)))}
    if spec.get("omp_bind"):
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(spec["omp_bind"])
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    return subprocess.Popen(
        [sys.executable, "-m", "kvmesh.engine.vllm.worker", f.name],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # vLLM's own children go with the group on a kill
    )


def results(proc: subprocess.Popen[str], *, timeout_s: float = 600.0) -> list[dict[str, Any]]:
    """Wait for a started engine; one result per prompt run, in order."""
    return results_and_log(proc, timeout_s=timeout_s)[0]


def results_and_log(
    proc: subprocess.Popen[str], *, timeout_s: float = 600.0
) -> tuple[list[dict[str, Any]], str]:
    """:func:`results`, and what the engine wrote on stderr (its log)."""
    spec_path = Path(str(proc.args[-1]))  # type: ignore[index]
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        raise EngineRunError(
            f"vLLM ran past {timeout_s:.0f} s:\n{(stdout + stderr)[-4000:]}"
        ) from None
    except BaseException:
        # Ctrl-C or SIGTERM (a benchmark turns it into SystemExit) while waiting:
        # the engine runs in a session of its own, so nothing else would stop it.
        kill(proc)
        raise
    finally:
        spec_path.unlink(missing_ok=True)
    return _parse(proc.returncode, stdout, stderr), stderr


def is_paused(pause: str | Path) -> bool:
    """True once an engine reached its ``pause_before`` entry with this path."""
    return Path(f"{pause}.ready").exists()


def resume(pause: str | Path) -> None:
    """Let an engine waiting at its ``pause_before`` entry with this path go on."""
    Path(f"{pause}.go").touch()


def kill(proc: subprocess.Popen[str]) -> None:
    """SIGKILL a started engine with vLLM's children (its process group) and reap it."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def run_engine(spec: dict[str, Any], *, timeout_s: float = 600.0) -> list[dict[str, Any]]:
    """One fresh vLLM process over ``spec``; one result per prompt run, in order."""
    return results(start_engine(spec), timeout_s=timeout_s)


def _parse(returncode: int | None, stdout: str, stderr: str) -> list[dict[str, Any]]:
    proc_out = stdout
    results = [
        json.loads(line[len(MARK) :]) for line in proc_out.splitlines() if line.startswith(MARK)
    ]
    if returncode != 0 or not results or not results[-1].get("done"):
        tail = (stdout + stderr)[-4000:]
        raise EngineRunError(f"vLLM exited with {returncode}:\n{tail}")
    return results[:-1]
