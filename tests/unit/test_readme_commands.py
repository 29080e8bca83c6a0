"""Every command in the README is one kvmesh (or the tools it names) accepts.

Each ``bash`` block of README.md is read as a shell would split it
(tests/support/readme.py), and each command checked by what it runs:

- ``kvmesh SERVICE ...``: parsed by kvmesh's own command line and its settings
  resolved and validated, as the service does before it starts;
- other ``kvmesh`` commands: parsed by their own parsers;
- ``python -m vllm...``: its ``--kv-transfer-config`` names kvmesh's connector
  and its extra config is one the connector accepts, its gateway a lane or
  address a command of the same block serves;
- ``pip install``: every extra exists, and a pinned torch is the one the
  storage extra pins;
- ``grpcurl``: the service and method exist in the contract.

A command this test does not know fails it, so a new README command gets a
check. The production recipe also runs for real, with real vLLM
(tests/e2e/with_vllm/test_readme_recipe.py).
"""

from __future__ import annotations

import importlib
import json
import re
import tomllib
from pathlib import Path

import pytest
from google.protobuf import descriptor_pool

import kvmesh.api  # noqa: F401 - registers every service of the contract
from kvmesh.cli.main import BENCHES, SERVICES, OneLineParser, build_parser
from kvmesh.common.config import resolve
from kvmesh.connector.vllm.settings import parse_settings
from tests.support.harness import REPO_ROOT
from tests.support.readme import Command, commands

PROJECT = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
EXTRAS = set(PROJECT["optional-dependencies"])
ALL = commands()


def _ids(command: Command) -> str:
    return " ".join(command.argv[:3])


def test_the_readme_has_the_commands_this_test_checks() -> None:
    kinds = {c.argv[0] for c in ALL if c.argv}
    assert {"kvmesh", "pip", "python"} <= kinds
    assert any(c.argv[:2] == ["kvmesh", "node"] for c in ALL)
    assert any("vllm.entrypoints.openai.api_server" in c.argv for c in ALL)


@pytest.mark.parametrize("command", ALL, ids=_ids)
def test_each_readme_command_is_accepted(command: Command, tmp_path: Path) -> None:
    argv = command.argv
    assert argv, command.text
    program = argv[0]
    if program == "kvmesh":
        _check_kvmesh(argv[1:])
    elif program == "pip":
        _check_pip(argv[1:])
    elif program == "python" and argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]:
        _check_vllm(command)
    elif program == "grpcurl":
        _check_grpcurl(argv[1:])
    elif argv[:3] == ["python3", "-m", "venv"] or argv[0] == ".":
        pass  # making and entering a virtual environment
    elif program == "scripts/test":
        assert (REPO_ROOT / "scripts" / "test").stat().st_mode & 0o111
    else:
        pytest.fail(f"README command not checked by this test: {command.text}")


def _check_kvmesh(argv: list[str]) -> None:
    name, rest = argv[0], argv[1:]
    if name == "bench":
        module_name, help_text = BENCHES[rest[0]]
        parser = OneLineParser(prog=f"kvmesh bench {rest[0]}", description=help_text)
        importlib.import_module(module_name).add_arguments(parser)
        parser.parse_args(rest[1:])
        return
    if name == "demo":
        from kvmesh.cli import demo

        parser = OneLineParser(prog="kvmesh demo")
        demo.add_arguments(parser)
        parser.parse_args(rest)
        return
    args = build_parser().parse_args(argv)
    for service in SERVICES:
        if service.name == name:
            flags = {k: v for k, v in vars(args).items() if k not in ("command", "config")}
            resolve(service.load(service.config), name, flags=flags, yaml_path=args.config)


def _check_pip(argv: list[str]) -> None:
    if argv[0] == "uninstall":
        return
    assert argv[0] == "install"
    storage_torch = next(d for d in PROJECT["optional-dependencies"]["storage"] if "torch" in d)
    for word in argv[1:]:
        extras = re.fullmatch(r"(?:kvmesh|\.)\[([a-z0-9_,-]+)\]", word)
        if extras:
            assert set(extras.group(1).split(",")) <= EXTRAS, word
        elif word.startswith("torch=="):
            assert word == storage_torch, (
                f"the README pins {word}, the storage extra {storage_torch}"
            )


def _check_vllm(command: Command) -> None:
    config = json.loads(command.option("--kv-transfer-config") or "{}")
    assert config["kv_connector"] == "KVMeshConnector"
    module = importlib.import_module(config["kv_connector_module_path"])
    assert hasattr(module, "KVMeshConnector")
    assert config["kv_role"] == "kv_both"
    settings = parse_settings(config.get("kv_connector_extra_config"))
    # The gateway it names is served by a command of the same block.
    served = set()
    for other in ALL:
        if other.block == command.block and other.argv[:2] == ["kvmesh", "node"]:
            lane = other.option("--lane-socket")
            if lane:
                served.add(f"lane:{lane}")
            served.add(f"127.0.0.1:{other.option('--port') or 8302}")
    assert settings.gateway in served, (settings.gateway, served)
    assert "VLLM_CPU_OMP_THREADS_BIND" in command.env


def _check_grpcurl(argv: list[str]) -> None:
    method = argv[-1]
    if method == "list":
        return
    service, _, name = method.rpartition("/")
    found = descriptor_pool.Default().FindServiceByName(service)
    assert found.FindMethodByName(name) is not None, method
