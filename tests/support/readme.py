"""The shell commands of the README, as a test reads them.

Every fenced ``bash`` block is split into logical lines (a trailing ``\\``
joins the next line), each line into commands (``&&``, a trailing ``&``), and
each command into its leading ``NAME=value`` assignments and its words
(:func:`shlex.split`: the quoting a shell would apply).
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.harness import REPO_ROOT

README = REPO_ROOT / "README.md"
_BLOCK = re.compile(r"^\s*```bash\n(.*?)^\s*```", re.M | re.S)
_ASSIGNMENT = re.compile(r"^[A-Z_][A-Z0-9_]*=")


@dataclass
class Command:
    """One command of a README block."""

    block: int  # index of its block
    text: str  # the logical line it came from
    env: dict[str, str] = field(default_factory=dict)
    argv: list[str] = field(default_factory=list)
    background: bool = False

    def option(self, name: str) -> str | None:
        """The value of ``--name VALUE`` (or ``--name=VALUE``), or None."""
        for i, word in enumerate(self.argv):
            if word == name and i + 1 < len(self.argv):
                return self.argv[i + 1]
            if word.startswith(name + "="):
                return word.split("=", 1)[1]
        return None


def blocks(path: Path = README) -> list[str]:
    """The text of every ``bash`` block, dedented."""
    out = []
    for match in _BLOCK.finditer(path.read_text()):
        lines = match.group(1).splitlines()
        indent = min((len(x) - len(x.lstrip()) for x in lines if x.strip()), default=0)
        out.append("\n".join(x[indent:] for x in lines))
    return out


def logical_lines(block: str) -> list[str]:
    """Lines with their ``\\`` continuations joined; comments and blanks dropped."""
    out: list[str] = []
    pending = ""
    for raw in block.splitlines():
        line = raw.rstrip()
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = (pending + line).strip()
        pending = ""
        if line and not line.startswith("#"):
            out.append(line)
    return out


def commands(path: Path = README) -> list[Command]:
    """Every command of every ``bash`` block, in order."""
    out = []
    for index, block in enumerate(blocks(path)):
        for line in logical_lines(block):
            words = shlex.split(line, comments=True)
            background = bool(words) and words[-1] == "&"
            if background:
                words = words[:-1]
            parts: list[list[str]] = [[]]
            for word in words:
                if word == "&&":
                    parts.append([])
                else:
                    parts[-1].append(word)
            for part in parts:
                env = {}
                while part and _ASSIGNMENT.match(part[0]):
                    name, _, value = part.pop(0).partition("=")
                    env[name] = value
                out.append(Command(index, line, env, part, background))
    return out
