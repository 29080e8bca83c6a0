"""Frozen config dataclasses loaded from flags, ``KVMESH_*`` variables and YAML.

A service declares its settings once, as a frozen dataclass whose fields carry
a help text (``setting(default, "help")``). This module derives the command
line from it and resolves each field with the precedence

    flag  >  environment variable  >  YAML file  >  default

The variable of field ``l1_size_bytes`` of the storage service is
``KVMESH_STORAGE_L1_SIZE_BYTES``. The YAML file (``--config``) is a mapping
of field names, either flat or under a section named after the service, so
one file can configure a whole fleet. Fields ending in ``_bytes`` accept sizes
such as ``512MiB`` or ``20GB``; fields ending in ``_seconds`` accept floats.

Every problem — an unknown key, a value of the wrong type, an unreadable
file — raises :class:`ConfigError` with a one-line reason; the CLI prints it
and exits non-zero, never a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import json
import os
import re
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml

ENV_PREFIX = "KVMESH_"
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {
    "": 1,
    "B": 1,
    "K": 1000,
    "KB": 1000,
    "KIB": 1024,
    "M": 1000**2,
    "MB": 1000**2,
    "MIB": 1024**2,
    "G": 1000**3,
    "GB": 1000**3,
    "GIB": 1024**3,
    "T": 1000**4,
    "TB": 1000**4,
    "TIB": 1024**4,
}

C = TypeVar("C")

_KIND_NAMES: dict[Any, str] = {int: "an integer", float: "a number", str: "text", Path: "a path"}


class ConfigError(ValueError):
    """A configuration problem, described in one line."""


def setting(default: Any, help: str, *, flag: str | None = None) -> Any:
    """Declare a config field with its help text (and optionally its flag name)."""
    metadata = {"help": help, "flag": flag}
    if isinstance(default, list | dict):
        factory = default.copy
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def require_module(module: str) -> None:
    """Raise ModuleNotFoundError (naming ``module``) when an optional package is missing.

    Settings that need an optional extra call this while they are validated,
    so the CLI reports the missing package (and the extra that brings it)
    before anything is built.
    """
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise ModuleNotFoundError(f"No module named {module!r}", name=module)


def check_creatable(name: str, path: str | Path, *, directory: bool = False) -> None:
    """Raise ConfigError when ``path`` (a file, or a directory) could never be created.

    Checked when settings are validated, before anything is built, and
    without creating anything: the nearest existing ancestor must be a
    writable directory on a filesystem that holds files (not /proc or /sys).
    """
    target = Path(path).expanduser()
    if target.exists():
        if directory and not target.is_dir():
            raise ConfigError(f"{name} {target} exists and is not a directory")
        if not directory and target.is_dir():
            raise ConfigError(f"{name} {target} is a directory, not a file")
        return
    ancestor = target.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise ConfigError(f"{name} {target}: {ancestor} is not a directory")
    if not os.access(ancestor, os.W_OK | os.X_OK) or os.statvfs(ancestor).f_blocks == 0:
        raise ConfigError(f"{name} {target}: cannot create it under {ancestor}")


def parse_size(text: str | int | float) -> int:
    """Bytes in ``text``: ``1048576``, ``1MiB``, ``1.5GB``, ``20GiB``."""
    if isinstance(text, bool):
        raise ConfigError(f"not a size: {text!r}")
    if isinstance(text, int | float):
        if text < 0:
            raise ConfigError(f"size must be >= 0, got {text}")
        return int(text)
    match = _SIZE_RE.match(text)
    if match is None:
        raise ConfigError(f"not a size: {text!r} (examples: 1048576, 512MiB, 20GB)")
    number, unit = match.groups()
    return int(float(number) * _SIZE_UNITS[(unit or "").upper()])


def _field_type(cls: type, field: dataclasses.Field[Any]) -> Any:
    hints = typing.get_type_hints(cls)
    return hints[field.name]


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0], True
    return tp, False


def convert(name: str, tp: Any, value: Any) -> Any:
    """Convert a raw value (string from a flag/env, or a YAML scalar) to ``tp``."""
    inner, optional = _unwrap_optional(tp)
    if optional and (value is None or (isinstance(value, str) and value.lower() in ("", "none"))):
        return None
    try:
        if name.endswith("_bytes") and inner is int:
            try:
                return parse_size(value)
            except ConfigError as exc:
                raise ConfigError(f"{name}: {exc}") from None
        if inner is bool:
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            raise ConfigError(f"{name}: expected true/false, got {value!r}")
        if inner is int:
            if isinstance(value, bool):
                raise ConfigError(f"{name}: expected an integer, got {value!r}")
            return int(value)
        if inner is float:
            return float(value)
        if inner is str:
            return str(value)
        if inner is Path:
            return Path(str(value)).expanduser()
        if isinstance(inner, type) and issubclass(inner, enum.Enum):
            try:
                return inner(value)
            except ValueError:
                choices = ", ".join(str(m.value) for m in inner)
                raise ConfigError(f"{name}: {value!r} is not one of {choices}") from None
        origin = typing.get_origin(inner)
        if origin is typing.Literal:
            allowed = typing.get_args(inner)
            if value not in allowed:
                raise ConfigError(f"{name}: {value!r} is not one of {', '.join(map(str, allowed))}")
            return value
        if origin in (list, tuple):
            (item_tp, *_) = typing.get_args(inner) or (str,)
            if isinstance(value, str):
                # An environment variable: a JSON array, or comma-separated scalars.
                items = json.loads(value) if value.lstrip().startswith("[") else value.split(",")
            else:
                items = list(value)
            converted = [convert(name, item_tp, v) for v in items if v != ""]
            return tuple(converted) if origin is tuple else converted
    except ConfigError:
        raise
    except (TypeError, ValueError, json.JSONDecodeError) as exc:
        kind = _KIND_NAMES.get(inner, getattr(inner, "__name__", str(inner)))
        raise ConfigError(f"{name}: cannot read {value!r} as {kind}") from exc
    raise ConfigError(f"{name}: unsupported setting type {tp!r}")


def flag_name(field: dataclasses.Field[Any]) -> str:
    """``--l1-size-bytes`` for field ``l1_size_bytes`` (unless the field names its flag)."""
    return str(field.metadata.get("flag") or "--" + field.name.replace("_", "-"))


def env_name(service: str, field_name: str) -> str:
    """``KVMESH_STORAGE_L1_SIZE_BYTES`` for service ``storage``, field ``l1_size_bytes``."""
    return f"{ENV_PREFIX}{service.upper()}_{field_name.upper()}"


def add_config_arguments(parser: argparse.ArgumentParser, cls: type, service: str) -> None:
    """Add one flag per field of ``cls`` (plus ``--config``) to ``parser``."""
    parser.add_argument(
        "--config",
        type=Path,
        default=None,
        metavar="FILE",
        help=f"YAML file of settings (flat, or under a '{service}:' section); "
        f"env {ENV_PREFIX}CONFIG",
    )
    for field in dataclasses.fields(cls):
        tp, _ = _unwrap_optional(_field_type(cls, field))
        if field.default is not dataclasses.MISSING:
            default = field.default
        else:
            default = typing.cast(Callable[[], Any], field.default_factory)()
        shown = default.value if isinstance(default, enum.Enum) else default
        env = env_name(service, field.name)
        help_text = f"{field.metadata.get('help', '')} (default: {shown!r}; env {env})"
        help_text = help_text.replace("%", "%%")
        if tp is bool:
            parser.add_argument(
                flag_name(field),
                dest=field.name,
                action=argparse.BooleanOptionalAction,
                default=None,
                help=help_text,
            )
        else:
            metavar = "SIZE" if field.name.endswith("_bytes") else field.name.upper()
            if typing.get_origin(tp) in (list, tuple):
                parser.add_argument(
                    flag_name(field),
                    dest=field.name,
                    action="append",
                    default=None,
                    metavar=field.name.upper().removesuffix("S"),
                    help=help_text + " (repeatable)",
                )
                continue
            choices = None
            if isinstance(tp, type) and issubclass(tp, enum.Enum):
                choices = [m.value for m in tp]
            elif typing.get_origin(tp) is typing.Literal:
                choices = list(typing.get_args(tp))
            parser.add_argument(
                flag_name(field),
                dest=field.name,
                default=None,
                metavar=metavar if choices is None else None,
                choices=choices,
                help=help_text,
            )


def read_text_file(path: Path, what: str) -> str:
    """A UTF-8 text file an operator gave; ConfigError (one line) when unreadable or not text.

    ``what`` names the file in the message ("config file", "trace file").
    """
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        column = exc.start - (raw.rfind(b"\n", 0, exc.start) + 1) + 1
        raise ConfigError(
            f"{what} {path} is not UTF-8 text: byte 0x{raw[exc.start]:02x} at line {line}, "
            f"column {column}"
        ) from None


def load_yaml(path: Path, service: str) -> dict[str, Any]:
    """The settings for ``service`` in a YAML file (its section, or the whole flat mapping)."""
    text = read_text_file(path, "config file")
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"config file {path} is not valid YAML{where}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping, not {type(data).__name__}")
    section = data.get(service)
    if isinstance(section, dict):
        return dict(section)
    return {k: v for k, v in data.items() if not isinstance(v, dict)}


def resolve(
    cls: type[C],
    service: str,
    *,
    flags: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
    yaml_path: Path | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> C:
    """Build ``cls`` from flags > environment > YAML > defaults, then validate it.

    ``overrides`` (programmatic, e.g. from ``kvmesh up``) rank above flags.
    Raises ConfigError for unknown YAML keys or bad values.
    """
    environ = os.environ if environ is None else environ
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    if yaml_path is None and environ.get(f"{ENV_PREFIX}CONFIG"):
        yaml_path = Path(environ[f"{ENV_PREFIX}CONFIG"])
    values: dict[str, Any] = {}
    # Where each value came from, so a bad one is reported as the operator wrote it.
    origin: dict[str, str] = {}
    if yaml_path is not None:
        from_yaml = load_yaml(yaml_path, service)
        unknown = sorted(set(from_yaml) - set(fields))
        if unknown:
            raise ConfigError(
                f"config file {yaml_path}: unknown setting(s) {', '.join(unknown)} "
                f"(known: {', '.join(sorted(fields))})"
            )
        values.update(from_yaml)
        origin.update({name: f"config file {yaml_path}: {name}" for name in from_yaml})
    for name in fields:
        env_value = environ.get(env_name(service, name))
        if env_value is not None:
            values[name] = env_value
            origin[name] = f"environment variable {env_name(service, name)}"
    for source in (flags or {}, overrides or {}):
        for name, value in source.items():
            if name not in fields:
                raise ConfigError(f"unknown setting {name!r}")
            if value is not None:
                values[name] = value
                origin[name] = flag_name(fields[name])
    converted = {}
    for name, value in values.items():
        try:
            converted[name] = convert(name, _field_type(cls, fields[name]), value)
        except ConfigError as exc:
            where = origin.get(name, name)
            message = str(exc)
            if where != name and message.startswith(f"{name}: "):
                message = f"{where}: {message[len(name) + 2 :]}"
            raise ConfigError(message) from exc
    try:
        config = cls(**converted)
    except TypeError as exc:
        raise ConfigError(str(exc)) from exc
    validate = getattr(config, "validate", None)
    if callable(validate):
        validate()
    return config


def describe(config: object) -> list[str]:
    """``name = value`` lines of a config, for the startup log."""
    lines = []
    for field in dataclasses.fields(config):  # type: ignore[arg-type]
        value = getattr(config, field.name)
        if "password" in field.name or "secret" in field.name:
            value = "***"
        lines.append(f"{field.name} = {value!r}")
    return lines


def parse_args_to_config(
    cls: type[C], service: str, argv: Sequence[str] | None, prog: str, description: str
) -> C:
    """Stand-alone helper: parse ``argv`` for one service and resolve its config."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    add_config_arguments(parser, cls, service)
    args = parser.parse_args(argv)
    flags = {k: v for k, v in vars(args).items() if k != "config"}
    return resolve(cls, service, flags=flags, yaml_path=args.config)
