"""The results pages, generated from the benchmarks' JSON.

    python scripts/bench/results_pages.py            # writes docs/results/<results file>.md and docs/benchmarks.md
    python scripts/bench/results_pages.py --check    # exit 1 when a page differs from what the JSON gives

For each benchmark of `results_catalog.BENCHMARKS`, a page with how it was measured (the command,
the commit, the machine, the date: the JSON's `provenance` record, which `provenance.py` writes;
for a file without the record, what the file holds, the commit that recorded it,
and "not recorded" for the rest), its targets each met or missed, its plot and its tables. The
pages link the JSON and PNG through docs/results/files, a link to scripts/bench/results, so that
mkdocs serves them. docs/benchmarks.md is the index: a line per page with its targets' count.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Optional

from results_catalog import BENCHMARKS, Benchmark, Table, Target, num, verdict

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "scripts" / "bench" / "results"
PAGES = REPO / "docs" / "results"
INDEX = REPO / "docs" / "benchmarks.md"
FILES = "files"  # docs/results/files -> ../../scripts/bench/results
NOT_RECORDED = "not recorded"
PLUGINS = ("reshard", "dpp", "elastic", "lora", "all")


def recorded_in(path: Path) -> Optional[tuple[str, str]]:
    """(hash, date) of the last commit that changed `path`, or None without git history."""
    try:
        done = subprocess.run(["git", "log", "-1", "--format=%H %cs", "--", str(path.relative_to(REPO))], cwd=REPO,
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    fields = done.stdout.split()
    return (fields[0], fields[1]) if done.returncode == 0 and len(fields) == 2 else None


def machine_from_file(data: dict) -> str:
    """What a file written before the provenance record holds about its machine."""
    machine = data.get("machine")
    if isinstance(machine, str):
        return f"as the file says: {machine}; CPU model {NOT_RECORDED}"
    if isinstance(machine, dict) and "cpus" in machine:
        workers = f", {machine['world']} {machine.get('backend', '')} workers" if "world" in machine else ""
        return f"{machine['cpus']} CPU cores{workers}; CPU model and load {NOT_RECORDED}"
    return NOT_RECORDED


def versions_from_file(data: dict) -> str:
    machine = data.get("machine")
    if isinstance(machine, dict) and "torch" in machine:
        return f"torch {machine['torch']}; Python and megatron-core {NOT_RECORDED}"
    return NOT_RECORDED


def provenance_rows(bench: Benchmark, data: dict, commit: Optional[tuple[str, str]]) -> list[tuple[str, str]]:
    record = data.get("provenance")
    if record:
        dirty = " (the tree had uncommitted changes)" if record.get("dirty") else ""
        load = record.get("load_average")
        load = f"load average {' / '.join(num(x, 2) for x in load)} (1 / 5 / 15 min)" if load else f"load {NOT_RECORDED}"
        rows = [
            ("command", f"`{record['command']}`"),
            ("commit", f"`{record['commit']}`{dirty}" if record.get("commit") else NOT_RECORDED),
            ("machine", f"{record['cpu_model']}, {record['cpu_cores']} cores; {load}"),
            ("date", record["date"]),
            ("versions", f"Python {record['python']}, torch {record['torch']}, megatron-core {record['megatron_core']}"),
        ]
        # A record written after the run says how it was made; a run that reused an earlier
        # one's measurements (--reuse) names that run.
        if record.get("note"):
            rows.append(("note", record["note"]))
        if reused := data.get("reused_from"):
            rows.append(("measurements", f"reused from `{reused['file']}` as measured at commit "
                                         f"`{reused.get('commit', NOT_RECORDED)}` on {reused.get('date', NOT_RECORDED)}"))
        return rows
    recorded = f"{NOT_RECORDED}; the file was recorded in commit `{commit[0]}` ({commit[1]})" if commit else NOT_RECORDED
    return [
        ("command", f"{NOT_RECORDED} (the file is written by `{bench.script}`)"),
        ("commit", recorded),
        ("machine", machine_from_file(data)),
        ("date", NOT_RECORDED),
        ("versions", versions_from_file(data)),
    ]


def markdown_table(table: Table) -> str:
    lines = ["| " + " | ".join(table.header) + " |", "|" + "---|" * len(table.header)]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in table.rows]
    return "\n".join(([table.caption, ""] if table.caption else []) + lines)


def target_lines(targets: list[Target]) -> list[str]:
    if not targets:
        return ["This benchmark has no target: it reports the measurements below."]
    return [f"- {verdict(t.met)}: {t.name}" + (f" ({t.detail})" if t.detail else "") for t in targets]


def count(targets: list[Target]) -> str:
    if not targets:
        return "no targets"
    met = sum(t.met is True for t in targets)
    missed = sum(t.met is False for t in targets)
    return f"targets: {met} met, {missed} missed" + (f", {len(targets) - met - missed} not judged" if met + missed < len(targets) else "")


def page(bench: Benchmark, data: dict, commit: Optional[tuple[str, str]]) -> str:
    """The results page of one benchmark."""
    plot = RESULTS / f"{bench.stem}.png"
    parts = [
        f"# {bench.title}",
        f"Generated by `python scripts/bench/results_pages.py` from [`scripts/bench/results/{bench.results}`]"
        f"({FILES}/{bench.results}); do not edit by hand.",
        bench.about,
        "## How it was measured",
        "| | |\n|---|---|\n" + "\n".join(f"| {name} | {value} |" for name, value in provenance_rows(bench, data, commit)),
        "## Targets",
        "\n".join(target_lines(bench.targets(data))),
        "## Results",
    ]
    if plot.exists():
        parts.append(f"![{bench.title}]({FILES}/{plot.name})")
    parts += [markdown_table(t) for t in bench.tables(data)]
    parts += bench.notes(data)
    return "\n\n".join(parts) + "\n"


INDEX_HEAD = """# Benchmarks

Each plugin has a benchmark in `scripts/bench/` that runs the baseline and the plugin in one
launch, on the same state, and writes JSON and, with `--plot`, a PNG
(`pip install -e '.[bench]'`); `scripts/bench/README.md` says how each is run and what it
measures. Each page below is generated from one results file in `scripts/bench/results/` by
`python scripts/bench/results_pages.py`: the command, commit, machine and date that produced
it, its targets met and missed, its plot and its tables.
"""


def index(summaries: list[tuple[Benchmark, str]]) -> str:
    parts = [INDEX_HEAD]
    for plugin in PLUGINS:
        mine = [(b, s) for b, s in summaries if b.plugin == plugin]
        if mine:
            parts.append(f"## {'all plugins' if plugin == 'all' else plugin}\n")
            parts.append("\n".join(f"- [{b.title}](results/{b.stem}.md) (`{b.results}`): {s}" for b, s in mine) + "\n")
    return "\n".join(parts)


def generated() -> dict[Path, str]:
    """Every page this script writes -> its text."""
    out, summaries = {}, []
    for bench in BENCHMARKS:
        path = RESULTS / bench.results
        data = json.loads(path.read_text())
        out[PAGES / f"{bench.stem}.md"] = page(bench, data, recorded_in(path))
        summaries.append((bench, count(bench.targets(data))))
    out[INDEX] = index(summaries)
    return out


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when a page differs from the generated text")
    args = parser.parse_args(argv)
    pages = generated()
    if args.check:
        stale = [p for p, text in pages.items() if not p.exists() or p.read_text() != text]
        for p in stale:
            print(f"{p.relative_to(REPO)} is stale: python scripts/bench/results_pages.py", file=sys.stderr)
        return 1 if stale else 0
    PAGES.mkdir(parents=True, exist_ok=True)
    for p, text in pages.items():
        p.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
