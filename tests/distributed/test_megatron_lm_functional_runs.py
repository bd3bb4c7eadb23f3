"""The end-to-end sample of Megatron-LM's functional test cases (scripts/
megatron_lm_functional_tests.py's SAMPLE: dense TP x PP, PP with interleaving, MoE with TP x EP
and with CP x PP x EP, a ckpt-resume case), shrunk, through `python -m megatron_ext.pretrain_gpt`
on the fewest ranks of each layout: the command lines and exit codes the JSON records. A
ckpt-resume case is resumed from its middle checkpoint, as Megatron-LM's runner does, and must
repeat the first run's losses there."""

from __future__ import annotations

import json
import re

import pytest

from tests.unit._functional_tests_script import functional_tests_script

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

SCRIPT = functional_tests_script()
CASES = [case for case in json.loads(SCRIPT.JSON_PATH.read_text())["cases"] if case["end_to_end"]]


def losses(stdout: str) -> dict[int, str]:
    """Iteration -> the loss its log line prints."""
    return {int(i): loss for i, loss in re.findall(r"iter\s+(\d+)/\d+ \| loss ([\d.]+)", stdout)}


@pytest.mark.parametrize("case", CASES, ids=[case["name"] for case in CASES])
def test_functional_test_case_trains_shrunk(case, tmp_path):
    plan = case["end_to_end"]
    results = SCRIPT.run_case(plan, str(tmp_path), timeout=600)
    assert [r.returncode for r in results] == [step["exit_code"] for step in plan["runs"]], (
        results[-1].stderr[-3000:]
    )
    if len(results) == 2:  # resumed at iteration 2: iterations 3 and 4 again, the same
        first, again = losses(results[0].stdout), losses(results[1].stdout)
        assert sorted(again) == [3, 4] and again == {i: first[i] for i in again}
