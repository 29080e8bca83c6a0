"""The repository stands on its own: comments cite only its own docs, and those citations resolve.

Two checks over src/, tests/, scripts/, pyproject.toml, README.md, Dockerfile and
docker-compose.yml:

* no file cites a design or reference document kept outside the repository
  (the forbidden markers are assembled below, so this file does not match them);
* every citation of a page under docs/ names a page that exists and, when it names
  headings too, headings that exist on that page. Accepted forms::

      docs/architecture.md
      ``docs/architecture.md``, "Deadlines"
      (docs/connector.md, "Scheduler flow" and "Worker flow")
      docs/coordinator.md#event-gate

  Headings match the page's markdown ``#`` headings case-insensitively (inline
  code backticks and repeated spaces ignored); an ``#anchor`` matches a heading's
  GitHub-style anchor. A quoted heading may continue on the next line, after a
  comment's ``#``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"

SCANNED_DIRS = ("src", "tests", "scripts")
SCANNED_FILES = ("pyproject.toml", "README.md", "Dockerfile", "docker-compose.yml")
SKIPPED_DIRS = frozenset(
    {"__pycache__", ".mypy_cache", ".pytest_cache", ".ruff_cache", "build", "dist", ".venv"}
)
SKIPPED_SUFFIXES = frozenset({".pyc", ".pyo", ".so", ".o", ".a", ".png", ".jpg", ".gz", ".bin"})

_SECTION = "\N{SECTION SIGN}"
#: Citations of documents that live outside the repository.
FORBIDDEN = (
    "DES" + "IGN " + _SECTION,
    "DES" + "IGN.md",
    "refer" + "ence " + _SECTION,
    "refer" + "ence catalogue",
    "refer" + "ence mp_server",
    "refer" + "ence coordinator " + _SECTION,
    ".." + "/shared",
)
#: A numbered section of some document (a section sign and a digit): docs/ pages have none.
_NUMBERED_SECTION = re.compile(_SECTION + r"\d")

#: ``docs/<page>.md``, optionally in double or single backticks, optionally ``#anchor``.
_PAGE = re.compile(r"(?<![\w/.-])(`{0,2})docs/(?P<page>[\w./-]+?\.md)\1(?:#(?P<anchor>[\w-]+))?")
#: One quoted heading after the page: ``, "Heading"`` or ``and "Heading"`` (the
#: separator and the heading itself may span a line break and a comment's ``#``).
_HEADING = re.compile(r'[\s#]*(?:,|\band\b)[\s#]*"(?P<heading>[^"]{1,120})"')
_CONTINUATION = re.compile(r"\n\s*#*:?")


@dataclass(frozen=True)
class Citation:
    """One citation of a docs page found in a file."""

    path: Path
    line: int
    page: str
    anchor: str | None
    headings: tuple[str, ...]

    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def find_citations(text: str, path: Path = ROOT) -> list[Citation]:
    """Every docs/<page>.md citation in ``text``, with the anchor and headings it names."""
    found = []
    for m in _PAGE.finditer(text):
        headings = []
        pos = m.end()
        while h := _HEADING.match(text, pos):
            headings.append(" ".join(_CONTINUATION.sub(" ", h["heading"]).split()))
            pos = h.end()
        line = text.count("\n", 0, m.start()) + 1
        found.append(Citation(path, line, m["page"], m["anchor"], tuple(headings)))
    return found


def _normalize(heading: str) -> str:
    return " ".join(heading.replace("`", "").split()).casefold()


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.strip().lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def headings_of(markdown: str) -> list[str]:
    """The ``#`` headings of a markdown text, outside fenced code blocks."""
    headings = []
    fence = None
    for line in markdown.splitlines():
        stripped = line.strip()
        marker = stripped[:3]
        if marker in ("```", "~~~"):
            if fence is None:
                fence = marker
            elif marker == fence:
                fence = None
            continue
        if fence is not None:
            continue
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            headings.append(m.group(1))
    return headings


def _scanned_files() -> Iterator[Path]:
    for name in SCANNED_FILES:
        path = ROOT / name
        if path.is_file():
            yield path
    for top in SCANNED_DIRS:
        base = ROOT / top
        if not base.is_dir():
            continue
        for path in sorted(base.rglob("*")):
            rel_parts = path.relative_to(ROOT).parts
            if any(p in SKIPPED_DIRS or p.endswith(".egg-info") for p in rel_parts):
                continue
            if path.is_file() and path.suffix not in SKIPPED_SUFFIXES:
                yield path


def _read_text(path: Path) -> str | None:
    data = path.read_bytes()
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _texts() -> list[tuple[Path, str]]:
    texts = []
    for path in _scanned_files():
        text = _read_text(path)
        if text is not None:
            texts.append((path, text))
    return texts


@pytest.fixture(scope="module")
def texts() -> list[tuple[Path, str]]:
    return _texts()


def test_nothing_cites_documents_outside_the_repository(texts: list[tuple[Path, str]]) -> None:
    bad = [
        f"{path.relative_to(ROOT)}:{i}: {line.strip()}"
        for path, text in texts
        for i, line in enumerate(text.splitlines(), 1)
        if any(marker in line for marker in FORBIDDEN) or _NUMBERED_SECTION.search(line)
    ]
    assert not bad, "cite the repository's own docs/ page and heading instead:\n" + "\n".join(bad)


def test_every_docs_citation_names_an_existing_page_and_heading(
    texts: list[tuple[Path, str]],
) -> None:
    citations = [c for path, text in texts for c in find_citations(text, path)]
    assert citations, "the scan found no docs/ citation at all: the pattern is broken"
    assert any(c.headings for c in citations)
    problems = check_citations(citations)
    assert not problems, "\n".join(problems)


def check_citations(citations: list[Citation]) -> list[str]:
    """What is wrong with ``citations``: missing pages, headings or anchors."""
    pages: dict[str, list[str] | None] = {}
    bad = []
    for c in citations:
        if c.page not in pages:
            page_path = DOCS / c.page
            pages[c.page] = (
                headings_of(page_path.read_text(encoding="utf-8")) if page_path.is_file() else None
            )
        headings = pages[c.page]
        if headings is None:
            bad.append(f"{c.where()}: docs/{c.page} does not exist")
            continue
        known = {_normalize(h) for h in headings}
        for heading in c.headings:
            if _normalize(heading) not in known:
                bad.append(f'{c.where()}: docs/{c.page} has no heading "{heading}"')
        if c.anchor is not None and c.anchor.lower() not in {_anchor(h) for h in headings}:
            bad.append(f"{c.where()}: docs/{c.page} has no heading with anchor #{c.anchor}")
    return bad


# -- the parser itself ------------------------------------------------------------


def _sample(text: str) -> str:
    """``text`` with ``DOCS/`` made ``docs/`` (so the samples below are not citations here)."""
    return text.replace("DOCS/", "docs/")


def test_citation_forms_are_parsed() -> None:
    text = _sample(
        'see ``DOCS/architecture.md``, "Deadlines".\n'
        '(DOCS/connector.md, "Scheduler flow" and "Worker flow")\n'
        '# (DOCS/coordinator.md, "Event gate",\n# "Key directory"\n# and "Usage")\n'
        "[p2p](DOCS/p2p.md#node-to-node-p2p) and DOCS/vllm.md, nothing quoted\n"
        'path = "xDOCS/other.md", "not a citation"\n'
        '(DOCS/coordinator.md, "Event sources and\nstream position")\n'
    )
    got = [(c.line, c.page, c.anchor, c.headings) for c in find_citations(text)]
    assert got == [
        (1, "architecture.md", None, ("Deadlines",)),
        (2, "connector.md", None, ("Scheduler flow", "Worker flow")),
        (3, "coordinator.md", None, ("Event gate", "Key directory", "Usage")),
        (6, "p2p.md", "node-to-node-p2p", ()),
        (6, "vllm.md", None, ()),
        (8, "coordinator.md", None, ("Event sources and stream position",)),
    ]


def test_missing_pages_headings_and_anchors_are_reported() -> None:
    text = _sample(
        '(DOCS/architecture.md, "deadlines") (DOCS/architecture.md, "No such heading")\n'
        "DOCS/no-such-page.md DOCS/architecture.md#deadlines DOCS/architecture.md#nowhere\n"
    )
    problems = check_citations(find_citations(text))
    assert len(problems) == 3, problems
    assert 'no heading "No such heading"' in problems[0]
    assert "/no-such-page.md does not exist" in problems[1]
    assert "#nowhere" in problems[2]


def test_headings_skip_code_blocks_and_anchors_follow_github() -> None:
    markdown = "# Title\n\n```bash\n# not a heading\n```\n## Node to node (P2P)\n### `x` y ##\n"
    assert headings_of(markdown) == ["Title", "Node to node (P2P)", "`x` y"]
    assert _anchor("Node to node (P2P)") == "node-to-node-p2p"
    assert _anchor("Emitter: batching and numbering") == "emitter-batching-and-numbering"
