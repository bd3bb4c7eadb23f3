"""Manual garbage collection (`train.manual_gc`): no automatic collection in the training loop,
full collections exactly at the configured iterations and around evaluations, the automatic
collector back afterwards; off, nothing changes."""

from __future__ import annotations

import dataclasses
import gc

import pytest

from megatron_ext.config.schema import TrainConfig
from megatron_ext.training.manual_gc import ManualGC


@pytest.fixture
def full_collections():
    """The number of full (oldest-generation) collections started so far."""
    seen: list = []

    def count(phase: str, info: dict) -> None:
        if phase == "start" and info["generation"] == 2:
            seen.append(1)

    gc.callbacks.append(count)
    yield seen
    gc.callbacks.remove(count)


def run_loop(collector: ManualGC, steps: int, eval_every: int, seen: list) -> tuple[list, list]:
    """(collections after each step, whether automatic collection was on at each step)."""
    counts, automatic = [], []
    with collector.training():
        for iteration in range(1, steps + 1):
            automatic.append(gc.isenabled())
            collector.after_step(iteration)
            if iteration % eval_every == 0:
                with collector.evaluation():
                    pass
            counts.append(len(seen))
    return counts, automatic


CASES = {
    # name: (config, collections after each of 6 steps (evaluation every 3), automatic collection on)
    "every_2_steps_and_around_eval": (dict(manual_gc=True, manual_gc_interval=2), [1, 2, 4, 5, 5, 8], False),
    "around_eval_only": (dict(manual_gc=True), [1, 1, 3, 3, 3, 5], False),
    "every_2_steps_only": (dict(manual_gc=True, manual_gc_interval=2, manual_gc_eval=False), [1, 2, 2, 3, 3, 4], False),
}


@pytest.mark.parametrize("case", CASES)
def test_manual_collections_happen_exactly_where_configured(full_collections, case):
    fields, expected, on = CASES[case]
    counts, automatic = run_loop(ManualGC(dataclasses.replace(TrainConfig(), **fields)), 6, 3, full_collections)
    assert counts == expected  # the first one: what was pending when the loop began
    assert automatic == [on] * 6
    assert gc.isenabled()


def test_off_by_default_changes_nothing(full_collections):
    gc.disable()  # so that no automatic full collection is counted
    try:
        counts, automatic = run_loop(ManualGC(TrainConfig()), 6, 3, full_collections)
    finally:
        gc.enable()
    assert counts == [0] * 6 and automatic == [False] * 6
