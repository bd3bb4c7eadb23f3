"""The training loop's host syncs per step, counted: megatron_ext's own code adds to a step that
logs nothing only the stop agreement, and the loss's read where the NaN check is on
(docs/architecture.md, "The step's budget"), while megatron-core's optimizer keeps its own (the
gradient norm it clips with).

On a GPU each `.item()`, `.tolist()` or `.cpu()` of a device tensor waits for the device, and a
blocking collective waits for every rank; here there is no GPU, so the calls themselves are
counted, by the file of the innermost megatron_ext or megatron-core frame that made them."""

from __future__ import annotations

import collections
import traceback

import pytest
import torch
import torch.distributed as dist

from megatron_ext.plugin import Plugin, register_plugin
from megatron_ext.train import run_from_overrides

# What megatron_ext's code may do on a step that neither logs, evaluates nor saves: the ranks'
# agreement on a pre-emption signal (one 1-element all-reduce, read once); with the NaN check on
# (Megatron-LM's default) also the step's loss, read as Megatron-LM's check reads it (one
# .tolist(); on one rank no data-parallel all-reduce, and with one pipeline stage no broadcast).
BUDGETS = {
    "check_for_nan=false": collections.Counter({"all_reduce": 1, "item": 1}),
    "check_for_nan=true": collections.Counter({"all_reduce": 1, "item": 1, "tolist": 1}),
}

HOST_COPIES = ("item", "tolist", "cpu")
COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_object", "all_gather_into_tensor",
               "reduce_scatter_tensor", "barrier", "broadcast_object_list", "gather", "scatter")
LOG_INTERVAL = 4

counts: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
step = [0]  # the step now running (set by the plugin's on_step_begin)


def _caller() -> str:
    """Whose code made the call: 'megatron_ext', 'megatron' (megatron-core) or 'other'."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if "/megatron_ext/" in frame.filename and "/tests/" not in frame.filename:
            return "megatron_ext"
        if "/megatron/core/" in frame.filename:
            return "megatron"
    return "other"


def _counted(name: str, fn, blocking=lambda args, kwargs: True):
    def call(*args, **kwargs):
        if step[0] and blocking(args, kwargs):
            counts[step[0]][(_caller(), name)] += 1
        return fn(*args, **kwargs)

    return call


@register_plugin
class StepMarks(Plugin):
    name = "host_sync_marks"

    def on_step_begin(self, ctx, step_: int) -> None:
        step[0] = step_


@pytest.fixture
def counting(monkeypatch):
    counts.clear()
    step[0] = 0
    for name in HOST_COPIES:
        monkeypatch.setattr(torch.Tensor, name, _counted(name, getattr(torch.Tensor, name)))
    for name in COLLECTIVES:
        # An async collective (async_op=True) is waited on later, overlapped: not a sync here.
        monkeypatch.setattr(dist, name, _counted(name, getattr(dist, name), lambda a, k: not k.get("async_op")))
    yield counts
    step[0] = 0


@pytest.mark.parametrize("check", list(BUDGETS))
def test_a_step_that_logs_nothing_stays_within_its_budget(tmp_path, counting, check):
    iters = 3 * LOG_INTERVAL
    summary = run_from_overrides([
        "experiment=none", "launcher.nproc=1", "launcher.device=cpu", f"train.iters={iters}",
        "train.eval_interval=0", f"logging.log_interval={LOG_INTERVAL}", "logging.progress_bar=false",
        "plugins=[host_sync_marks]", f"data.cache_dir={tmp_path}/cache", f"train.{check}",
    ])
    budget = BUDGETS[check]
    assert len(summary["losses"]) == iters  # every step's loss, read on the log steps
    quiet = [s for s in range(2, iters) if s % LOG_INTERVAL]  # the first step builds; the last logs
    for s in quiet:
        ours = collections.Counter({name: n for (who, name), n in counting[s].items() if who == "megatron_ext"})
        theirs = {name: n for (who, name), n in counting[s].items() if who == "megatron"}
        assert ours <= budget, f"step {s}: megatron_ext made {dict(ours)} (budget {dict(budget)}); megatron-core {theirs}"
    logged = collections.Counter(
        {name: n for (who, name), n in counting[LOG_INTERVAL].items() if who == "megatron_ext"})
    assert logged["tolist"] >= 1  # the log step reads the losses: the count sees syncs where they are
