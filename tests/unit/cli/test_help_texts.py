"""Every option of every ``kvmesh`` command says what it does in ``--help``.

``kvmesh bench NAME`` and ``kvmesh demo`` build their parsers only when they
run (see :func:`kvmesh.cli.main.run_bench` and :func:`~kvmesh.cli.main.run_demo`);
this builds each the same way, from each module's ``add_arguments``.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.abc
import sys
from collections.abc import Iterator

import pytest

from kvmesh.cli.main import BENCHES, OneLineParser, build_parser


def _bench_parser(name: str) -> argparse.ArgumentParser:
    """The parser ``kvmesh bench NAME`` builds (run_bench adds ``--json`` if missing)."""
    module_name, help_text = BENCHES[name]
    module = importlib.import_module(module_name)
    parser = OneLineParser(prog=f"kvmesh bench {name}", description=help_text)
    module.add_arguments(parser)
    if not any(a.dest == "json" for a in parser._actions):
        parser.add_argument("--json", action="store_true", help="print one JSON object")
    return parser


def _demo_parser() -> argparse.ArgumentParser:
    from kvmesh.cli import demo

    parser = OneLineParser(prog="kvmesh demo", description=demo.DESCRIPTION)
    demo.add_arguments(parser)
    return parser


def _options_without_help(parser: argparse.ArgumentParser) -> list[str]:
    return [
        "/".join(action.option_strings)
        for action in parser._actions
        if action.option_strings
        and not isinstance(action, argparse._HelpAction)
        and not (action.help or "").strip()
    ]


def _subcommand_parsers(
    parser: argparse.ArgumentParser, prog: str
) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    yield prog, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _subcommand_parsers(sub, f"{prog} {name}")


def test_the_list_covers_every_benchmark() -> None:
    assert {"datapath", "ingest", "lookup", "p2p", "vllm"} <= set(BENCHES)


@pytest.mark.parametrize("name", sorted(BENCHES))
def test_every_bench_option_has_help(name: str) -> None:
    parser = _bench_parser(name)
    assert len(parser._actions) > 2, f"kvmesh bench {name} has no options"
    assert _options_without_help(parser) == [], f"kvmesh bench {name}: options without help"


def test_every_demo_option_has_help() -> None:
    assert _options_without_help(_demo_parser()) == []


def test_every_other_command_option_has_help() -> None:
    missing = {
        prog: options
        for prog, parser in _subcommand_parsers(build_parser(), "kvmesh")
        if (options := _options_without_help(parser))
    }
    assert missing == {}


class _NoVllm(importlib.abc.MetaPathFinder):
    """Refuse ``vllm`` and its submodules, as on a machine without the extra."""

    def find_spec(self, fullname: str, path: object, target: object = None) -> None:
        if fullname == "vllm" or fullname.startswith("vllm."):
            raise ModuleNotFoundError(f"No module named {fullname!r}", name=fullname)


def test_the_vllm_bench_options_load_without_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    # Import kvmesh.bench.vllm afresh with vLLM unavailable: its --help must not need it.
    fresh = ("vllm", "kvmesh.bench.vllm", "kvmesh.engine.vllm")
    for name in list(sys.modules):
        if any(name == top or name.startswith(f"{top}.") for top in fresh):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [_NoVllm(), *sys.meta_path])
    parser = _bench_parser("vllm")
    assert _options_without_help(parser) == []
    assert "vllm" not in sys.modules


def test_bench_vllm_gives_each_round_its_own_ratios() -> None:
    from kvmesh.bench.vllm import _figures, format_table

    def runs(*ms: float) -> list[dict[str, float]]:
        return [{"ttft_s": m / 1000} for m in ms]

    one = _figures(
        {
            "cold": runs(300, 310, 290),
            "floor": runs(20, 30, 25),
            "miss": runs(330, 300, 320),
            "warm": runs(40, 35, 30),
            # Within the miss and warm processes: each prompt's own baseline.
            "cold_same_process": runs(300, 300, 320),
            "floor_same_process": runs(20, 35, 25),
        }
    )
    same_process = {
        "ttft_cold_same_process_ms": 300.0,
        "ttft_prefix_cache_same_process_ms": 25.0,
        "warm_over_prefix_cache_same_process": 1.2,  # median of 2.0, 1.0, 1.2
        "miss_cost_fraction_same_process": 0.0,  # median of 1.1, 1.0, 1.0
    }
    assert one == {
        "ttft_cold_ms": 300.0,
        "ttft_prefix_cache_ms": 25.0,
        "ttft_miss_ms": 320.0,
        "ttft_warm_ms": 35.0,
        "warm_over_prefix_cache": 1.4,
        "miss_cost_fraction_of_cold": 0.067,
        **same_process,
    }
    result = {
        "prompt_tokens": 8000,
        "ttft_cold_ms": 300.0,
        "ttft_prefix_cache_ms": 25.0,
        "ttft_miss_ms": 320.0,
        "ttft_warm_ms": 35.0,
        "warm_over_prefix_cache": 1.4,
        "miss_cost_fraction_of_cold": 0.067,
        **same_process,
        "speedup_warm_vs_cold": 8.6,
        "tokens_from_cache": 7936,
        "outputs_match": True,
        "lmcache_0_5_6_warm_ms_reference": 100.0,
        "rounds": [one, one],
    }
    assert format_table(result).count("warm / floor 1.40x") == 3  # the pooled line and 2 rounds
