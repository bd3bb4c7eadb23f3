"""The documentation's markdown as data: which files, their links, their headings' anchors and
their shell commands. Shared by the tests of tests/docs/."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"

FENCE = re.compile(r"^```(\w*)\s*$")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def pages() -> list[Path]:
    """README.md and every markdown page of docs/."""
    return [REPO / "README.md", *sorted(DOCS.rglob("*.md"))]


def prose_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of the lines outside fenced code blocks."""
    out, fenced = [], False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if FENCE.match(line.strip()) or line.strip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            out.append((number, line))
    return out


def slug(heading: str) -> str:
    """The anchor a heading gets (GitHub's and Python-Markdown's toc agree on these headings):
    markup dropped, lower case, word characters, spaces and hyphens kept, spaces to hyphens."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", heading).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.strip().replace(" ", "-")


def anchors(path: Path) -> set[str]:
    return {slug(m.group(2)) for _, line in prose_lines(path) if (m := HEADING.match(line))}


@dataclass(frozen=True)
class Link:
    page: Path
    line: int
    target: str


def relative_links(path: Path) -> list[Link]:
    """Links to other files of the repository or to anchors (not URLs, not mail addresses)."""
    out = []
    for number, line in prose_lines(path):
        for target in LINK.findall(line):
            if not re.match(r"^[a-z][a-z0-9+.-]*:", target):
                out.append(Link(path, number, target))
    return out


def shell_commands(path: Path) -> list[str]:
    """Every command of the page's ```bash blocks: continuation lines joined, comments and
    blank lines dropped."""
    commands, block, fenced = [], None, False
    for line in path.read_text().splitlines():
        m = FENCE.match(line.strip())
        if m and not fenced:
            fenced, block = True, (m.group(1) in ("bash", "sh", "shell"))
            pending = ""
            continue
        if line.strip() == "```" and fenced:
            fenced = False
            continue
        if not (fenced and block):
            continue
        text = pending + re.sub(r"\s+#.*$", "", line.strip()) if not line.strip().startswith("#") else pending
        if text.endswith("\\"):
            pending = text[:-1].rstrip() + " "
            continue
        pending = ""
        if text.strip():
            commands.append(" ".join(text.split()))
    return commands


def transcripts(path: Path) -> list[tuple[str, list[str]]]:
    """(command, the output lines shown under it) of each `$ command` in the page's unlabelled
    code blocks: terminal sessions."""
    out: list[tuple[str, list[str]]] = []
    fenced, labelled, session = False, False, None
    for line in path.read_text().splitlines():
        m = FENCE.match(line.strip())
        if m:
            fenced, labelled, session = not fenced, bool(m.group(1)), None  # a block's output is its own
            continue
        if not fenced or labelled:
            continue
        if line.startswith("$ "):
            session = (line[2:].strip(), [])
            out.append(session)
        elif session is not None:
            session[1].append(line)
    return out
