"""No page says how the project came to be: the docs (and the benchmarks' manual,
scripts/bench/README.md) say how things are now."""

from __future__ import annotations

import re

import pytest

from tests.docs._markdown import REPO, pages

HISTORY_WORDS = (
    "had been",
    "previously",
    "no longer",
    "now fixed",
    "before that",
    "this session",
    "found failing",
    "used to",
    "the previous run",
    "earlier run",
    "earlier runs",
    "re-run",
    "re-measured",
    "measured again",
    "since then",
)
PATTERN = re.compile("|".join(rf"\b{re.escape(w)}\b" for w in HISTORY_WORDS), re.IGNORECASE)


def history_lines(text: str) -> list[tuple[int, str]]:
    return [(n, line.strip()) for n, line in enumerate(text.splitlines(), 1) if PATTERN.search(line)]


@pytest.mark.parametrize("page", [*pages(), REPO / "scripts" / "bench" / "README.md"],
                         ids=lambda p: str(p.relative_to(REPO)))
def test_page_has_no_history_words(page):
    found = history_lines(page.read_text())
    assert not found, f"{page.relative_to(REPO)} tells history:\n" + "\n".join(f"  {n}: {t}" for n, t in found)


def test_the_word_list_catches_history():
    text = "Runs on CPU.\nThe stall had been longer.\nPreviously it failed.\n"
    assert [n for n, _ in history_lines(text)] == [2, 3]
