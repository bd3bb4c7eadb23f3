"""Putting a job into a slot is all or nothing: a failure part-way (a weight that does not fit,
a missing one, a data source that breaks after the adapter is in) leaves the slot empty, every
other slot as it was, names the job, and the other jobs train as if it had never been queued."""

from __future__ import annotations

import pytest
import torch

from test_lora_packed import JOBS, MODEL, VOCAB, max_diff, random_weights, train

from megatron_ext.lora.job import LoraJob
from megatron_ext.lora.runtime.base import build_base
from megatron_ext.lora.runtime.batching import SyntheticData
from megatron_ext.lora.runtime.layers import install_job
from megatron_ext.lora.runtime.packed import PackedTrainer

NEW = LoraJob("new", rank=4, seed=11)


def snapshot(wrappers) -> dict:
    """Every slot of every wrapper: the adapter objects and their values."""
    return {
        key: {slot: (adapter, adapter.a.detach().clone(), adapter.b.detach().clone()) for slot, adapter in w.adapters.items()}
        for key, w in wrappers.items()
    }


def assert_unchanged(before: dict, wrappers) -> None:
    after = snapshot(wrappers)
    assert before.keys() == after.keys()
    for key in before:
        assert before[key].keys() == after[key].keys(), key
        for slot, (adapter, a, b) in before[key].items():
            assert after[key][slot][0] is adapter and torch.equal(adapter.a, a) and torch.equal(adapter.b, b)


@pytest.mark.parametrize("slot", [0, 1], ids=["replacing", "free"])
def test_a_weight_that_does_not_fit_changes_nothing(one_rank_world, slot):
    _, wrappers, _ = build_base(MODEL, VOCAB, dtype=torch.float64)
    install_job(wrappers, 0, JOBS[0], random_weights(wrappers, JOBS[0].rank, 0))
    before = snapshot(wrappers)
    bad = random_weights(wrappers, NEW.rank, 1)
    last = list(wrappers)[-1]  # every other linear would be built before this one fails
    bad[last] = (bad[last][0], bad[last][1][:-1])
    with pytest.raises(ValueError, match=r"lora job 'new': lora linear_fc2 \(layer 2\).*do not fit"):
        install_job(wrappers, slot, NEW, bad)
    assert_unchanged(before, wrappers)

    missing = random_weights(wrappers, NEW.rank, 1)
    del missing[last]
    with pytest.raises(ValueError, match=r"lora job 'new': weights missing for \[\(2, 'linear_fc2'\)\]"):
        install_job(wrappers, slot, NEW, missing)
    assert_unchanged(before, wrappers)


class BrokenEval(SyntheticData):
    """Job "bad"'s held-out data cannot be read: the runtime asks for it after installing the
    adapter, so the failure comes with the slot half set up."""

    def eval(self):
        if self.job.name == "bad":
            raise OSError("held-out shard unreadable")
        return super().eval()


def test_a_job_that_cannot_start_fails_alone(one_rank_world):
    bad = LoraJob("bad", rank=4, steps=2, seq_length=16, seed=21)
    model, wrappers, routing = build_base(MODEL, VOCAB, dtype=torch.float64)
    final, at_failure = {}, []

    def keep(trainer, active):
        final[active.job.name] = {k: w.logical(active.slot) for k, w in trainer.wrappers.items() if w.slot(active.slot)}

    def log(name, line):
        if name == "bad":  # the slot's contents the moment the failure is reported
            at_failure.append(({s for w in wrappers.values() for s in w.adapters}, line))

    trainer = PackedTrainer(model, wrappers, routing, lambda job: BrokenEval(job, VOCAB), 2, on_finish=keep, log=log)
    trainer.submit([JOBS[0], bad, JOBS[2]])
    results = trainer.run()

    assert results["bad"].status == "failed" and results["bad"].steps == 0
    assert "'bad'" in results["bad"].error and "held-out shard unreadable" in results["bad"].error
    assert at_failure == [({"0"}, results["bad"].error)], "slot 1 kept part of the failed job"
    for job in (JOBS[0], JOBS[2]):
        assert results[job.name].status == "done"
        solo, _, _, _ = train([job], capacity=1, dtype=torch.float64)
        assert max_diff(final[job.name], solo[job.name]) <= 1e-10, job.name
