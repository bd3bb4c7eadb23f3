"""Benchmarks keep what they measured: a package a run needs only at its end (matplotlib for
`--plot`, the bench extra) is checked when it starts, with one line naming the extra, before
anything is measured; and the JSON is written before anything is drawn, so a drawing that fails
loses no measurement (scripts/bench/extras.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "scripts" / "bench"


def _run(code: str, timeout: int) -> subprocess.CompletedProcess:
    """`code` run as a script beside the benchmarks (their folder on sys.path, as when run)."""
    prelude = f"import sys; sys.path[:0] = [{str(BENCH)!r}, {str(REPO)!r}]\n"
    return subprocess.run([sys.executable, "-c", prelude + code], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


def test_a_benchmark_without_matplotlib_refuses_at_its_start(tmp_path):
    out = tmp_path / "lora.json"
    done = _run(
        "import runpy\n"
        "sys.modules['matplotlib'] = None  # matplotlib does not import\n"
        f"sys.argv = ['lora.py', '--json', {str(out)!r}, '--plot', {str(tmp_path / 'lora.png')!r}]\n"
        f"runpy.run_path({str(BENCH / 'lora.py')!r}, run_name='__main__')\n",
        timeout=120,
    )
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1] == (
        "lora.py: --plot needs matplotlib, which does not import here: pip install -e '.[bench]'"
    )
    assert "Traceback" not in done.stderr and not done.stdout and not out.exists()


def test_the_json_is_written_before_the_drawing(tmp_path):
    out = tmp_path / "sweep.json"
    done = _run(
        "import lora_sweep\n"
        "def broken(*args, **kwargs):\n"
        "    raise RuntimeError('the drawing failed')\n"
        "lora_sweep.plot = lora_sweep.draw_gantt = broken\n"
        "lora_sweep.require = lambda *args: None  # the drawing is stubbed: no matplotlib needed\n"
        f"lora_sweep.main(['--json', {str(out)!r}, '--plot', {str(tmp_path / 'sweep.png')!r}, "
        "'--gap-instances', '1', '--skip-measured'])\n",
        timeout=300,
    )
    assert done.returncode == 1 and "RuntimeError: the drawing failed" in done.stderr
    sweep = json.loads(out.read_text())["sweep"]
    assert sweep["simulated"]["planner"] > 0 and sweep["small_instance_gaps"]["instances"] == 1
    assert not (tmp_path / "lora_sweep_simulated_gantt.png").exists()


@pytest.mark.parametrize("script", sorted(p.name for p in BENCH.glob("*.py") if 'add_argument("--plot"' in p.read_text()))
def test_every_benchmark_that_draws_checks_matplotlib_at_its_start(script):
    source = (BENCH / script).read_text()
    assert "from extras import require" in source and '"matplotlib": "--plot" if args.plot' in source, script
