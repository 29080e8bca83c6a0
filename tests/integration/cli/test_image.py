"""The Docker image, checked without a Docker engine.

- The build context, as ``.dockerignore`` filters it, holds what the
  Dockerfile's COPY lines name and nothing heavy (.venv, .git, caches).
- What those COPY lines bring is enough to build the package with every
  module of src/kvmesh (engine, connector, the native kernel's C source...):
  a wheel is built from exactly those files.
- The native copy kernel is compiled in the build stage only (into the
  wheel); the runtime stage's check (kernel loaded, every command's modules
  importable) runs here as written.
- ``kvmesh-health`` (deploy/grpc_health_check.py), the compose healthcheck,
  exits 0 only for SERVING, against real servers.
"""

from __future__ import annotations

import fnmatch
import os
import shlex
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvmesh.gateway.app import GatewayApp
from kvmesh.gateway.config import GatewayConfig
from kvmesh.storage.app import StorageApp
from kvmesh.storage.config import StorageConfig
from tests.support.harness import REPO_ROOT, server_thread
from tests.support.ports import free_port

DOCKERFILE = REPO_ROOT / "Dockerfile"
HEALTH_SCRIPT = REPO_ROOT / "deploy" / "grpc_health_check.py"


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the Dockerfile, continuation lines joined."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = pending + line
        pending = ""
        word, _, rest = line.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def _ignore_patterns() -> list[str]:
    lines = (REPO_ROOT / ".dockerignore").read_text().splitlines()
    patterns = [p.strip().strip("/") for p in lines if p.strip() and not p.startswith("#")]
    # The matcher below implements what Docker does for these; exceptions are not used.
    assert not any(p.startswith("!") for p in patterns)
    return patterns


def _segments_match(pattern: list[str], path: list[str]) -> bool:
    if not pattern:
        return not path
    if pattern[0] == "**":
        return any(_segments_match(pattern[1:], path[i:]) for i in range(len(path) + 1))
    return bool(path) and (
        fnmatch.fnmatchcase(path[0], pattern[0]) and _segments_match(pattern[1:], path[1:])
    )


def _ignored(relative: str, patterns: list[str]) -> bool:
    """Docker's rule: a path is out when it, or a directory above it, matches a pattern."""
    parts = relative.split("/")
    return any(
        _segments_match(p.split("/"), parts[:n]) for p in patterns for n in range(1, len(parts) + 1)
    )


def _context(patterns: list[str]) -> Iterator[str]:
    """Every file of the build context (relative paths), as the Docker client sends it."""
    for root, dirs, files in os.walk(REPO_ROOT):
        rel_root = os.path.relpath(root, REPO_ROOT)
        prefix = "" if rel_root == "." else rel_root + "/"
        dirs[:] = [d for d in dirs if not _ignored(prefix + d, patterns)]
        for name in files:
            if not _ignored(prefix + name, patterns):
                yield prefix + name


def _copies() -> list[tuple[list[str], str]]:
    copies = []
    for word, args in _instructions():
        if word != "COPY" or "--from=" in args:
            continue  # COPY --from copies out of an earlier stage, not the build context
        parts = [p for p in shlex.split(args) if not p.startswith("--")]
        copies.append((parts[:-1], parts[-1]))
    return copies


def test_the_build_context_leaves_out_environments_history_and_caches() -> None:
    patterns = _ignore_patterns()
    for heavy in (".venv", ".git", ".mypy_cache", ".pytest_cache", ".ruff_cache", "tests"):
        assert _ignored(heavy, patterns), heavy
    assert _ignored("src/kvmesh/__pycache__/x.cpython-311.pyc", patterns)
    assert _ignored("src/kvmesh.egg-info/PKG-INFO", patterns)
    for needed in ("pyproject.toml", "README.md", "src/kvmesh/cli/main.py"):
        assert not _ignored(needed, patterns), needed
    context = set(_context(patterns))
    assert not any(path.startswith((".venv/", ".git/")) for path in context)
    for native in ("ntcopy.c", "ntcopy.h", "tiles_amx.c", "tiles_vec.c"):
        assert f"src/kvmesh/kernels/_native/{native}" in context


def test_every_copy_source_is_in_the_build_context() -> None:
    context = set(_context(_ignore_patterns()))
    copies = _copies()
    assert copies, "the Dockerfile copies nothing"
    for sources, _ in copies:
        for source in sources:
            assert source in context or any(p.startswith(source + "/") for p in context), source


def test_what_the_dockerfile_copies_builds_every_module_of_the_package(tmp_path: Path) -> None:
    """The files COPY brings into the workdir, and only those, build a wheel with all of kvmesh."""
    patterns = _ignore_patterns()
    context = sorted(_context(patterns))
    workdir = tmp_path / "opt-kvmesh"
    workdir.mkdir()
    for sources, destination in _copies():
        if destination.startswith("/"):
            continue  # outside the workdir (the health probe script)
        into = workdir / destination
        for source in sources:
            files = [p for p in context if p.startswith(source + "/")]
            if not files:  # a file: into a directory by its name, or to the path named
                dir_like = destination.endswith("/") or len(sources) > 1
                target = into / Path(source).name if dir_like else into
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(REPO_ROOT / source, target)
            for path in files:  # a directory: its contents, under the destination
                target = into / Path(path).relative_to(source)
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(REPO_ROOT / path, target)
    wheels = tmp_path / "wheels"
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(wheels), str(workdir)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    (wheel,) = wheels.glob("kvmesh-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    package = [
        path[len("src/") :]
        for path in context
        if path.startswith("src/kvmesh/") and path.endswith((".py", ".pyi", ".c", "py.typed"))
    ]
    missing = sorted(p for p in package if p not in names)
    assert missing == []
    for module in ("kvmesh/engine/__init__.py", "kvmesh/connector/__init__.py"):
        assert module in names
    # The native copy kernel is compiled into the wheel (setup.py), not at run time.
    assert [n for n in names if n.startswith("kvmesh/kernels/_ntcopy") and n.endswith(".so")]


def test_the_image_builds_the_native_kernel_and_checks_every_command(tmp_path: Path) -> None:
    """The kernel is compiled in the build stage only; the final check runs as written."""
    instructions = _instructions()
    stages = [i for i, (word, _) in enumerate(instructions) if word == "FROM"]
    assert len(stages) == 2, "a build stage and a runtime stage"
    build, runtime = instructions[stages[0] : stages[1]], instructions[stages[1] :]
    assert any(word == "RUN" and "gcc" in args for word, args in build)
    assert not [args for word, args in runtime if word == "RUN" and "gcc" in args]
    assert any(word == "RUN" and "pip wheel" in args for word, args in build)
    (check,) = [args for word, args in runtime if word == "RUN" and "native.load()" in args]
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    env.pop("KVMESH_NATIVE_COPY", None)
    env.pop("KVMESH_NATIVE_LIBRARY", None)
    done = subprocess.run(
        ["bash", "-c", check], capture_output=True, text=True, timeout=300, env=env,
        cwd=tmp_path, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "copy kernel: loaded" in done.stdout


def _health(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(HEALTH_SCRIPT), *args, "--timeout", "5"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


def test_the_image_installs_the_health_probe() -> None:
    assert (["deploy/grpc_health_check.py"], "/usr/local/bin/kvmesh-health") in _copies()
    assert os.access(HEALTH_SCRIPT, os.X_OK)


@pytest.mark.parametrize("service", ["", "kvmesh.gateway.v1.GatewayService"])
def test_health_probe_exits_0_only_when_serving(service: str, tmp_path: Path) -> None:
    with server_thread() as storage_thread, server_thread() as thread:
        storage = storage_thread.start(
            StorageConfig(
                port=0,
                data_dir=str(tmp_path),
                l1_size_bytes=64 << 20,
                l2=["none"],
                metrics_port=-1,
            ),
            StorageApp,
        )
        gateway = thread.start(
            GatewayConfig(port=0, storage_target=storage.target, metrics_port=-1), GatewayApp
        )
        done = _health(gateway.target, service)
        assert done.returncode == 0, done.stderr
        assert done.stderr == ""
    gone = _health(gateway.target, service)
    assert gone.returncode == 1
    assert gone.stderr.count("\n") == 1
    assert "UNAVAILABLE" in gone.stderr


def test_health_probe_fails_for_a_gateway_whose_storage_is_down() -> None:
    with server_thread() as thread:
        gateway = thread.start(
            GatewayConfig(port=0, storage_target=f"127.0.0.1:{free_port()}", metrics_port=-1),
            GatewayApp,
        )
        done = _health(gateway.target, "kvmesh.gateway.v1.GatewayService")
    assert done.returncode == 1
    assert "NOT_SERVING" in done.stderr
