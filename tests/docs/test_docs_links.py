"""Every relative link and anchor in README.md and docs/ points at something that exists."""

from __future__ import annotations

import pytest

from tests.docs._markdown import REPO, anchors, pages, relative_links


def _broken(link) -> str | None:
    path, _, anchor = link.target.partition("#")
    target = (link.page.parent / path).resolve() if path else link.page
    if not target.exists():
        return "no such file"
    if anchor and target.suffix == ".md" and anchor not in anchors(target):
        return f"no heading with anchor #{anchor}"
    return None


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(page):
    broken = [f"{link.page.relative_to(REPO)}:{link.line}: {link.target} ({why})"
              for link in relative_links(page) if (why := _broken(link))]
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_the_link_check_finds_a_broken_link(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n[ok](#title) [gone](missing.md) [bad anchor](#nothing)\n")
    found = {link.target: _broken(link) for link in relative_links(page)}
    assert found == {"#title": None, "missing.md": "no such file", "#nothing": "no heading with anchor #nothing"}
