"""Live reshard of a running job: the loss curve continues as if the layout had never changed.

Every layout computes the same per-token loss from the same weights and batches, so a run that
switches layouts mid-way must follow the uninterrupted run (fp32 reduction order aside). That
needs every parameter, Adam moment and the step moved exactly, and the scheduler, counters and
data position carried over.
"""

from __future__ import annotations

import json

import pytest

from megatron_ext.config.validate import ConfigError
from megatron_ext.train import run_from_overrides

pytestmark = pytest.mark.distributed

ITERS = 8
COMMON = [
    "experiment=none",
    f"train.iters={ITERS}",
    "train.eval_interval=0",
    "logging.progress_bar=false",
    "model.seq_length=64",
    "train.micro_batch_size=2",
    "train.global_batch_size=8",
    "launcher.nproc=4",
    "plugins=[reshard]",
]
LOSS_ATOL = 2e-4


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> str:
    return f"data.cache_dir={tmp_path_factory.mktemp('cache')}"


@pytest.fixture(scope="module")
def uninterrupted(cache) -> list[float]:
    return run_from_overrides([*COMMON, cache, "parallel.tp=2", "parallel.pp=2"])["losses"]


def test_scheduled_reshards_follow_the_uninterrupted_run(uninterrupted, cache, tmp_path):
    schedule = "[{step: 3, layout: {tp: 1, pp: 2, dp: 2}}, {step: 6, layout: {tp: 2, pp: 1, dp: 2}}]"
    summary = run_from_overrides(
        [*COMMON, cache, "parallel.tp=2", "parallel.pp=2", f"reshard.schedule={schedule}",
         "reshard.memory_budget_mb=0.05", f"checkpoint.save={tmp_path}"]
    )
    assert summary["losses"] == pytest.approx(uninterrupted, abs=LOSS_ATOL)
    # The final checkpoint is written in the last layout and resumes there.
    resumed = run_from_overrides(
        [*COMMON[:-1], cache, "parallel.tp=2", "parallel.dp=2", f"checkpoint.load={tmp_path}",
         f"train.iters={ITERS + 1}"]
    )
    assert len(resumed["losses"]) == 1


def test_request_file(uninterrupted, cache, tmp_path):
    request = tmp_path / "request.json"
    request.write_text(json.dumps({"layout": {"tp": 1, "pp": 1}}))  # dp derived: 4
    summary = run_from_overrides(
        [*COMMON, cache, "parallel.tp=2", "parallel.pp=2", f"reshard.request_file={request}"]
    )
    assert summary["losses"] == pytest.approx(uninterrupted, abs=LOSS_ATOL)
    assert not request.exists() and (tmp_path / "request.json.done").exists()


def test_bad_scheduled_layout_is_refused_before_training(cache):
    with pytest.raises(Exception, match="parallel.tp"):
        run_from_overrides(
            [*COMMON, cache, "parallel.tp=2", "reshard.schedule=[{step: 2, layout: {tp: 3}}]"]
        )
