"""scripts/gpu/check.sh --dry-run: every part of the lent GPU's check runs on the CPU at tiny
sizes and lands in one JSON with sane values, so that a lent GPU's minutes go to measuring.

The dry run hides CUDA from its parts, so on any machine the unit tests run with --device cpu,
the Triton kernels are skipped (select() says why) and MFU is over the H100's peak: tiny but
positive."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("gpu_check") / "check.json"
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([str(REPO / "scripts" / "gpu" / "check.sh"), "--dry-run", "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return json.loads(out.read_text())


def test_every_part_ran_on_the_cpu(dry_run):
    assert dry_run["device"]["name"] == "cpu" and dry_run["device"]["dry_run"]
    assert dry_run["provenance"]["command"].startswith("python scripts/gpu/check.py --dry-run")
    parts = dry_run["parts"]
    assert set(parts) == {"unit_tests", "throughput_megatron", "throughput_plain", "throughput", "lora_kernels",
                          "elastic_latency"}
    assert all(part["status"] == "ok" and part["seconds"] > 0 for name, part in parts.items() if name != "throughput")


def test_the_unit_tests_ran_on_the_device_given(dry_run):
    tests = dry_run["parts"]["unit_tests"]
    assert tests["device"] == "cpu" and tests["failed"] == 0 and tests["passed"] >= 4
    ran = {t["test"].split("::")[0] for t in tests["tests"] if t["outcome"] == "passed"}
    assert {"tests.unit.test_lora_packed", "tests.unit.test_sft_packing_loss"} <= ran


def test_the_throughput_table_has_both_arms(dry_run):
    table = dry_run["parts"]["throughput"]
    assert table["peak_tflops"] == 989.0 and table["tokens_per_step"] == 2 * 2 * 32
    for arm in table["arms"].values():
        assert arm["step_s"] > 0 and arm["tokens_per_s"] == pytest.approx(table["tokens_per_step"] / arm["step_s"])
        assert 0 < arm["mfu"] < 1e-3 and arm["tflops"] == pytest.approx(arm["mfu"] * 989.0)
        assert len(arm["step_s_each"]) == 3 and all(math.isfinite(loss) for loss in arm["losses"])
    assert table["megatron_ext_over_plain"] > 0


def test_lora_kernels_against_the_reference(dry_run):
    paths = dry_run["parts"]["lora_kernels"]["paths"]
    assert paths["reference"]["status"] == "ok" and paths["reference"]["max_relative_error"] == 0.0
    assert paths["triton"]["status"] == "skipped" and paths["triton"]["reason"]
    assert all(p["max_relative_error"] < 1e-5 and p["step_s"] > 0 for p in paths.values() if p["status"] == "ok")


def test_the_elastic_half_against_its_parent(dry_run):
    elastic = dry_run["parts"]["elastic_latency"]
    assert 0.45 <= elastic["params_fraction"] <= 0.55
    assert elastic["latency_s"]["parent"] > 0 and elastic["latency_s"]["50"] > 0 and elastic["latency_ratio"] > 0
