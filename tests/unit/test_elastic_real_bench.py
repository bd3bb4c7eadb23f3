"""A short run of the real-model elastic benchmark (SmolLM2-135M on the stdlib's text, a few
steps, one seed): the table has its structure, and every trained arm's held-out perplexity falls
from where it starts (the pruned parent at its sizes)."""

from __future__ import annotations

import importlib
import math
import sys
from pathlib import Path

import pytest

from tests.unit.test_elastic_slicing import world  # noqa: F401

pytestmark = [pytest.mark.model, pytest.mark.slow]

BENCH = Path(__file__).parents[2] / "scripts" / "bench"
ROW_KEYS = {"budget", "params", "tokens_elastic", "tokens_separate", "latency_ratio"} | {
    f"ppl_{arm}{suffix}" for arm in ("parent", "elastic", "separate", "pruned") for suffix in ("", "_se")
}


def bench():
    if str(BENCH) not in sys.path:  # elastic_real is a script beside elastic.py
        sys.path.insert(0, str(BENCH))
    return importlib.import_module("elastic_real")


def test_short_real_run_has_the_table_and_trained_arms_improve(world):  # noqa: F811
    real = bench()
    plan, _ = real.parse(["--parent", "smollm2_135m", "--json", "unused", "--seq", "64", "--micro-batch", "2",
                          "--micro-batches", "1", "--steps", "4", "--seeds", "0", "--heldout-windows", "4",
                          "--lr", "5e-5", "--router-warmup", "100"])
    result = real.run(plan)
    rows = result["budgets"]
    assert [r["budget"] for r in rows] == [1.0, 0.75, 0.5]
    for row in rows:
        assert ROW_KEYS <= row.keys(), ROW_KEYS - row.keys()
        assert row["tokens_elastic"] == 4 * 2 * 64
    fractions = [r["params"] / rows[0]["params"] for r in rows]
    assert all(abs(f - b) <= 0.05 * b for f, b in zip(fractions, (1.0, 0.75, 0.5))), fractions
    assert rows[0]["ppl_pruned"] == pytest.approx(rows[0]["ppl_parent"])  # the 100 % size is the parent
    for row in rows[1:]:
        assert row["ppl_elastic"] < row["ppl_pruned"] and row["ppl_separate"] < row["ppl_pruned"], row
        assert row["tokens_separate"] == row["tokens_elastic"]
    assert set(result["hf_export"]) == {"75", "50"}
    assert {t["pair"] for t in result["thinking"]} == {"think50-answer100", "think100-answer100", "think50-answer50"}
    assert all(math.isfinite(v) for v in result["targets"]["elastic_minus_separate"]["50"].values() if isinstance(v, float))
