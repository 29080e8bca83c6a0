"""Command-line help and options every kvmesh tool with a ``--json`` output shares.

The benchmarks (``kvmesh bench NAME``, ``python -m kvmesh.bench.NAME``) use both; they
live here, below the CLI and the benchmarks alike, so neither imports the other.
"""

from __future__ import annotations

import argparse


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Help that shows every option's default (``(default: X)``), unless None or False.

    A help text that already says ``%(default)s``, or names the default as
    this would, is left as it is; a list default is shown as typed (``2 1``).
    """

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (
            not action.option_strings
            or "%(default)" in text
            or default is None
            or default is False
            or default is argparse.SUPPRESS
        ):
            return action.help
        if isinstance(default, list | tuple):
            shown = " ".join(str(v) for v in default) or "none"
        else:
            shown = str(default)
        shown = f"(default: {shown})"
        if shown in text:  # the help says it already
            return action.help
        return f"{text} {shown.replace('%', '%%')}"


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    """``--json`` and ``--quiet``, for a benchmark whose own options lack them."""
    dests = {a.dest for a in parser._actions}
    if "json" not in dests:
        parser.add_argument("--json", action="store_true", help="print one JSON object")
    if "quiet" not in dests:
        parser.add_argument(
            "--quiet", action="store_true", help="no progress lines on stderr while it runs"
        )
