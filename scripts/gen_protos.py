#!/usr/bin/env python3
"""Regenerate (or check) the committed Python package ``kvmesh`` from protos/.

The generated messages (``*_pb2.py``), gRPC stubs (``*_pb2_grpc.py``) and their
type stubs (``*.pyi``, from mypy-protobuf) are written beside the ``.proto``
files under protos/kvmesh, which is the importable package ``kvmesh``.

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
import shutil
import sys
import tempfile
from pathlib import Path

GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", "_pb2_grpc.pyi")
PACKAGE = "kvmesh"


def _plugin(name: str) -> str:
    """Path of a protoc plugin installed beside this interpreter (venv-safe)."""
    beside = Path(sys.executable).parent / name
    if beside.exists():
        return str(beside)
    found = shutil.which(name)
    if found is None:
        sys.exit(f"error: {name} not found; install the dev extra: pip install -e '.[dev]'")
    return found


def generate(proto_root: Path, out_root: Path) -> None:
    """Run protoc over every .proto under proto_root/kvmesh into out_root."""
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
        f"--python_out={out_root}",
        f"--grpc_python_out={out_root}",
        f"--mypy_out=quiet:{out_root}",
        f"--mypy_grpc_out=quiet:{out_root}",
        *protos,
    ]
    # protoc resolves paths relative to the working directory for some plugins.
    cwd = os.getcwd()
    try:
        os.chdir(proto_root)
        status = protoc.main(args)
    finally:
        os.chdir(cwd)
    if status != 0:
        sys.exit(f"error: protoc failed with status {status}")
    # Make every generated folder an importable, typed package.
    for folder in [out_root / PACKAGE, *(p for p in (out_root / PACKAGE).rglob("*") if p.is_dir())]:
        if folder.name == "__pycache__":
            continue
        (folder / "__init__.py").touch()
    (out_root / PACKAGE / "py.typed").touch()


def generated_files(root: Path) -> dict[str, Path]:
    """Generated files (and package markers) under root/kvmesh, by relative path."""
    found: dict[str, Path] = {}
    for path in (root / PACKAGE).rglob("*"):
        if path.is_file() and (
            path.name.endswith(GENERATED_SUFFIXES) or path.name in ("__init__.py", "py.typed")
        ):
            found[str(path.relative_to(root))] = path
    return found


def check(proto_root: Path) -> list[str]:
    """Differences between committed and freshly generated files (empty = in sync)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        generate(proto_root, out)
        fresh = generated_files(out)
        committed = generated_files(proto_root)
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
    if args.check:
        problems = check(proto_root)
        if problems:
            print("generated stubs are out of date; run: python scripts/gen_protos.py")
            for line in problems:
                print(f"  {line}")
            return 1
        print("generated stubs are up to date")
        return 0
    for stale in generated_files(proto_root).values():
        if stale.name.endswith(GENERATED_SUFFIXES):
            stale.unlink()
    generate(proto_root, proto_root)
    print(f"regenerated {len(generated_files(proto_root))} files under {proto_root / PACKAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
