"""The results pages are generated from the benchmarks' JSON and current; each carries the provenance
its JSON records (or says what is not recorded); and every measured number on README.md,
docs/benchmarks.md and scripts/bench/README.md is a value of a results file the page names."""

from __future__ import annotations

import importlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.docs._markdown import DOCS, REPO

BENCH = REPO / "scripts" / "bench"


@pytest.fixture(scope="module")
def bench():
    """scripts/bench/results_pages.py and provenance.py, imported by name from their folder as the
    scripts import each other."""
    sys.path.insert(0, str(BENCH))
    try:
        yield importlib.import_module("results_pages"), importlib.import_module("provenance")
    finally:
        sys.path.remove(str(BENCH))


def test_results_pages_are_current(bench):
    results_pages, _ = bench
    legacy = [b.results for b in results_pages.BENCHMARKS
              if "provenance" not in json.loads((results_pages.RESULTS / b.results).read_text())]
    if legacy and results_pages.recorded_in(results_pages.RESULTS / legacy[0]) is None:
        pytest.skip("no git history here: the pages name the commit that recorded each older results file")
    stale = [str(p.relative_to(REPO)) for p, text in results_pages.generated().items()
             if not p.exists() or p.read_text() != text]
    assert not stale, f"stale: {stale}; run python scripts/bench/results_pages.py"


def test_every_results_page_is_in_the_nav(bench):
    results_pages, _ = bench
    nav = (REPO / "mkdocs.yml").read_text()
    pages = [f"results/{b.stem}.md" for b in results_pages.BENCHMARKS]
    assert [p for p in pages if p not in nav] == []
    assert (DOCS / "results" / results_pages.FILES).resolve() == results_pages.RESULTS


def test_a_page_shows_the_recorded_provenance(bench, tmp_path):
    results_pages, provenance = bench
    record = provenance.provenance(str(BENCH / "dpp.py"), ["--json", "out file.json"])
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    assert record["command"] == "python scripts/bench/dpp.py --json 'out file.json'"
    if head:
        assert record["commit"] == head
    bench_ = next(b for b in results_pages.BENCHMARKS if b.results == "reshard_transport_cpu.json")
    data = json.loads((results_pages.RESULTS / bench_.results).read_text())
    text = results_pages.page(bench_, {**data, "provenance": record}, None)
    for shown in (record["command"], record["cpu_model"], f"{record['cpu_cores']} cores", record["date"]):
        assert shown in text
    assert "not recorded" not in text


def test_an_older_file_says_what_is_not_recorded(bench):
    results_pages, _ = bench
    bench_ = next(b for b in results_pages.BENCHMARKS if b.results == "reshard_transport_cpu.json")
    data = {k: v for k, v in json.loads((results_pages.RESULTS / bench_.results).read_text()).items() if k != "provenance"}
    text = results_pages.page(bench_, data, ("0123abcd", "2026-01-02"))
    rows = dict(re.findall(r"^\| (command|commit|machine|date|versions) \| (.*) \|$", text, re.M))
    assert rows["date"] == "not recorded"
    assert rows["command"].startswith("not recorded")
    assert "recorded in commit `0123abcd` (2026-01-02)" in rows["commit"]
    assert rows["machine"].startswith(f"{data['machine']['cpus']} CPU cores")


# ---- every measured number comes from a results file the page names ----

# A number or range (0.06–0.13 s) with a unit of measurement, not part of a name (TP2×PP2) or a
# setting (TP=2).
NUMBER = r"\d[\d,]*(?:\.\d+)?"
MEASURED = re.compile(rf"(?<![\w.=/-])({NUMBER})(?:\s?[–-]\s?({NUMBER}))?\s?(×|x\b|ms\b|s\b|%|GiB\b|MiB\b|GB\b|MB\b)")
NAMED = re.compile(r"([\w.-]+)\.(?:json|md)\b")
SCALE = {"%": (100,), "GiB": (2**-30,), "MiB": (2**-20,), "GB": (1e-9, 2**-30), "MB": (1e-6, 2**-20), "ms": (1e3,)}


def _values(node, key: str = "") -> list[tuple[str, float]]:
    """Every number of a JSON document, with the key that holds it."""
    if isinstance(node, bool):
        return []
    if isinstance(node, (int, float)):
        return [(key, float(node))]
    children = node.items() if isinstance(node, dict) else [(key, c) for c in node] if isinstance(node, list) else []
    return [v for k, child in children for v in _values(child, k)]


def _scales(unit: str, key: str) -> tuple[float, ...]:
    """How a value of `key` is shown in `unit`: seconds and bytes are scaled; a field named in
    megabytes (`..._mb`, /proc's KiB / 1024) is shown as it is."""
    if unit in ("MB", "MiB") and key.endswith("_mb"):
        return (1,)
    return SCALE.get(unit, (1,))


def _shown_as(text: str, value: float) -> bool:
    decimals = len(text.partition(".")[2])
    return round(value, decimals) == float(text.replace(",", ""))


def blocks(page_text: str) -> list[str]:
    """Paragraphs and list items: a number must come from a file named in its own block."""
    return [b for b in re.split(r"\n\s*\n|\n(?=\s*[-*] )", page_text) if b.strip()]


def unsourced_numbers(page_text: str, results: Path) -> list[str]:
    """The measured numbers of `page_text` that no results file named in the same paragraph or list
    item holds (rounded as shown)."""
    out = []
    for block in blocks(page_text):
        named = {results / f"{stem}.json" for stem in NAMED.findall(block)}
        values = [v for path in named if path.exists() for v in _values(json.loads(path.read_text()))]
        for *numbers, unit in MEASURED.findall(block):
            out += [
                f"{n}{unit}" for n in numbers
                if n and not any(_shown_as(n, v * s) for key, v in values for s in _scales(unit, key))
            ]
    return out


@pytest.mark.parametrize("page", ["README.md", "docs/benchmarks.md", "scripts/bench/README.md"])
def test_every_measured_number_is_in_a_named_results_file(page):
    found = unsourced_numbers((REPO / page).read_text(), BENCH / "results")
    assert not found, f"{page}: numbers in no results file the page names: {found}"


def test_the_number_check_finds_a_number_without_a_source(tmp_path):
    (tmp_path / "run.json").write_text(json.dumps({"stall_s": 0.1284, "ratio": [33.06], "fraction": 0.0037}))
    page = "- From `run.json`: the stall takes 0.128 s, 33× shorter, error 0.37%; TP2×PP2 on TP=2 × PP=2.\n"
    assert unsourced_numbers(page, tmp_path) == []
    assert unsourced_numbers(page + "- The restart takes 14 s (`run.json`).\n", tmp_path) == ["14s"]
    assert unsourced_numbers(page + "- The stall takes 0.128 s.\n", tmp_path) == ["0.128s"]
    assert unsourced_numbers(page.replace("0.128 s", "0.13–0.15 s"), tmp_path) == ["0.15s"]

