#!/usr/bin/env python3
"""Regenerate (or check) the committed generated package ``kvmesh.api`` from protos/.

The contract lives in ``protos/kvmesh/<area>/v1/*.proto`` (folder = proto
package, wire names ``kvmesh.<area>.v1``). The generated messages
(``*_pb2.py``), gRPC stubs (``*_pb2_grpc.py``) and their type stubs (``*.pyi``,
from mypy-protobuf) are committed under ``src/kvmesh/api/<area>/v1``: protoc
names Python modules after the .proto paths, so its output is rewritten from
``kvmesh.<area>.v1`` to ``kvmesh.api.<area>.v1`` (the Python import path only;
the descriptors, and so every wire name, are untouched).

    python scripts/gen_protos.py            # rewrite the generated files
    python scripts/gen_protos.py --check    # exit 1 if they differ from the .proto files

``--root DIR`` points at another copy of the repository (the drift test uses
a temporary copy). The output depends on the pinned grpcio-tools and
mypy-protobuf versions in pyproject.toml's dev extra.
"""

from __future__ import annotations

import argparse
import filecmp
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", "_pb2_grpc.pyi")
PACKAGE = "kvmesh"
# Where the generated modules live in the source tree, relative to the repository root.
API_DIR = Path("src") / "kvmesh" / "api"
# Only Python import paths are rewritten: ``from kvmesh.<area>.v1 import`` lines and the
# module name handed to the descriptor builder. The serialized descriptors (wire names,
# ``.kvmesh.<area>.v1.Message``) must stay byte for byte what protoc wrote.
_IMPORT_LINE = re.compile(r"^from kvmesh\.(\w+)\.v1 import ", re.MULTILINE)
_MODULE_NAME = re.compile(r"'kvmesh\.(\w+)\.v1\.(\w+_pb2)'")


def _plugin(name: str) -> str:
    """Path of a protoc plugin installed beside this interpreter (venv-safe)."""
    beside = Path(sys.executable).parent / name
    if beside.exists():
        return str(beside)
    found = shutil.which(name)
    if found is None:
        sys.exit(f"error: {name} not found; install the dev extra: pip install -e '.[dev]'")
    return found


def generate(proto_root: Path, api_root: Path) -> None:
    """Run protoc over every .proto under proto_root/kvmesh; write ``kvmesh.api`` into api_root."""
    try:
        import grpc_tools
        from grpc_tools import protoc
    except ImportError:
        sys.exit("error: grpcio-tools is missing; install the dev extra: pip install -e '.[dev]'")
    protos = sorted(str(p.relative_to(proto_root)) for p in (proto_root / PACKAGE).rglob("*.proto"))
    if not protos:
        sys.exit(f"error: no .proto files under {proto_root / PACKAGE}")
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{proto_root}",
        f"-I{well_known}",
        f"--plugin=protoc-gen-mypy={_plugin('protoc-gen-mypy')}",
        f"--plugin=protoc-gen-mypy_grpc={_plugin('protoc-gen-mypy_grpc')}",
        "--python_out={OUT}",
        "--grpc_python_out={OUT}",
        "--mypy_out=quiet:{OUT}",
        "--mypy_grpc_out=quiet:{OUT}",
        *protos,
    ]
    with tempfile.TemporaryDirectory() as raw:
        out_root = Path(raw)
        args = [a.replace("{OUT}", raw) for a in args]
        # protoc resolves paths relative to the working directory for some plugins.
        cwd = os.getcwd()
        try:
            os.chdir(proto_root)
            status = protoc.main(args)
        finally:
            os.chdir(cwd)
        if status != 0:
            sys.exit(f"error: protoc failed with status {status}")
        for path in sorted((out_root / PACKAGE).rglob("*")):
            if not path.is_file() or not path.name.endswith(GENERATED_SUFFIXES):
                continue
            target = api_root / path.relative_to(out_root / PACKAGE)
            target.parent.mkdir(parents=True, exist_ok=True)
            text = _IMPORT_LINE.sub(r"from kvmesh.api.\1.v1 import ", path.read_text())
            text = _MODULE_NAME.sub(r"'kvmesh.api.\1.v1.\2'", text)
            target.write_text(text)
    # Make every generated folder an importable package.
    for folder in [api_root, *(p for p in api_root.rglob("*") if p.is_dir())]:
        if folder.name == "__pycache__":
            continue
        (folder / "__init__.py").touch()


def generated_files(root: Path) -> dict[str, Path]:
    """Generated files (and package markers) under the api folder ``root``, by relative path."""
    found: dict[str, Path] = {}
    for path in root.rglob("*"):
        if path.is_file() and (
            path.name.endswith(GENERATED_SUFFIXES) or path.name == "__init__.py"
        ):
            found[str(path.relative_to(root))] = path
    return found


def check(proto_root: Path, api_root: Path) -> list[str]:
    """Differences between committed and freshly generated files (empty = in sync)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        generate(proto_root, out)
        fresh = generated_files(out)
        committed = generated_files(api_root)
        problems = []
        for rel in sorted(fresh.keys() - committed.keys()):
            problems.append(f"missing: {rel}")
        for rel in sorted(committed.keys() - fresh.keys()):
            problems.append(f"stale (no .proto produces it): {rel}")
        for rel in sorted(fresh.keys() & committed.keys()):
            if not filecmp.cmp(fresh[rel], committed[rel], shallow=False):
                problems.append(f"differs: {rel}")
        return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if stubs are out of date")
    parser.add_argument(
        "--root",
        type=Path,
        default=Path(__file__).resolve().parent.parent,
        help="repository root (default: this checkout)",
    )
    args = parser.parse_args(argv)
    proto_root = args.root.resolve() / "protos"
    api_root = args.root.resolve() / API_DIR
    if args.check:
        problems = check(proto_root, api_root)
        if problems:
            print("generated stubs are out of date; run: python scripts/gen_protos.py")
            for line in problems:
                print(f"  {line}")
            return 1
        print("generated stubs are up to date")
        return 0
    for stale in generated_files(api_root).values():
        if stale.name.endswith(GENERATED_SUFFIXES):
            stale.unlink()
    generate(proto_root, api_root)
    print(f"regenerated {len(generated_files(api_root))} files under {api_root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
