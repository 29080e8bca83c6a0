"""``kvmesh bench NAME --help`` shows every option's default."""

from __future__ import annotations

import argparse
import importlib

import pytest

from kvmesh.cli.main import BENCHES, bench_parser, run_bench


def _shown(default: object) -> str:
    if isinstance(default, list | tuple):
        return " ".join(str(v) for v in default) or "none"
    return str(default)


def _entries(text: str) -> dict[str, str]:
    """Each option's entry of a --help, by its first option string, on one line."""
    entries: dict[str, list[str]] = {}
    current: list[str] = []
    for row in text.splitlines():
        if row.startswith("  -"):
            current = entries.setdefault(row.split()[0].rstrip(","), [])
        current.append(row.strip())
    return {option: " ".join(rows) for option, rows in entries.items()}


def _help(name: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> str:
    monkeypatch.setenv("COLUMNS", "1000")  # one line per option: no default split by wrapping
    with pytest.raises(SystemExit) as exited:
        run_bench([name, "--help"])
    assert exited.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("name", sorted(BENCHES))
def test_every_option_shows_its_default(
    name: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    text = _help(name, monkeypatch, capsys)
    parser = bench_parser(name, importlib.import_module(BENCHES[name][0]))
    missing = []
    for action in parser._actions:
        if (
            not action.option_strings
            or isinstance(action, argparse._HelpAction)
            or action.default is None
            or action.default is False
            or action.default is argparse.SUPPRESS
        ):
            continue
        entry = _entries(text).get(action.option_strings[0], "")
        if f"(default: {_shown(action.default)})" not in entry:
            missing.append(f"{action.option_strings[0]}: {entry!r}")
    assert missing == [], f"kvmesh bench {name} --help lacks defaults: {missing}"


@pytest.mark.parametrize("name", sorted(BENCHES))
def test_no_default_is_shown_twice(
    name: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    text = _help(name, monkeypatch, capsys)
    doubled = [entry for entry in _entries(text).values() if entry.count("(default") > 1]
    assert doubled == []


@pytest.mark.parametrize("name", sorted(BENCHES))
def test_every_bench_takes_json_and_quiet(name: str) -> None:
    parser = bench_parser(name, importlib.import_module(BENCHES[name][0]))
    options = parser.parse_args(["--json", "--quiet"])
    assert options.json is True
    assert options.quiet is True
    assert parser.parse_args([]).quiet is False


def test_connector_options_are_key_value_pairs() -> None:
    from kvmesh.bench.common import connector_options

    assert connector_options([]) == {}
    assert connector_options(["load_by_layer=false", "log_level=DEBUG", "a=b=c"]) == {
        "load_by_layer": "false",
        "log_level": "DEBUG",
        "a": "b=c",
    }
    for bad in ("load_by_layer", "=x"):
        with pytest.raises(SystemExit, match="expected KEY=VALUE"):
            connector_options([bad])
