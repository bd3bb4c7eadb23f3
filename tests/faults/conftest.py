"""Fixtures of the fault tables: one data cache for all their runs (the corpus tokenized once),
and the clean run of each layout that faulted runs are compared with (tests/faults/_runs.py)."""

from __future__ import annotations

from typing import Callable

import pytest

from tests.faults._job import run_job
from tests.faults._runs import BASE, CLEAN_STEPS, LAYOUTS, CleanRun
from megatron_ext.checkpointing import tracker


@pytest.fixture(scope="session")
def cache(tmp_path_factory) -> str:
    """The data cache override of every run of the fault tables."""
    return f"data.cache_dir={tmp_path_factory.mktemp('cache')}"


@pytest.fixture(scope="session")
def clean(tmp_path_factory, cache) -> Callable[[str], CleanRun]:
    """A layout's clean run (run once, on first use): CLEAN_STEPS steps, a checkpoint at each."""
    runs: dict[str, CleanRun] = {}

    def clean_run(layout: str) -> CleanRun:
        if layout not in runs:
            root = tmp_path_factory.mktemp("clean") / "ckpt"
            rc, output = run_job(
                [*BASE, *LAYOUTS[layout].overrides(), cache, f"checkpoint.save={root}", "checkpoint.interval=1", "checkpoint.keep_last=null",
                 f"train.exit_interval={CLEAN_STEPS}"]
            )
            assert rc == 0 and tracker.latest_iteration(root) == CLEAN_STEPS, output[-4000:]
            runs[layout] = CleanRun(root, output)
        return runs[layout]

    return clean_run
