"""A packed run checkpointed at step k and resumed on a freshly built base continues bitwise
like the run that never stopped: every job's losses, eval losses and final adapter weights.

k falls where one job is between two optimizer steps (gradients accumulated, part of its batch
drawn), a finished job's slot has been taken by a queued one, and Adam, the LR schedule and the
dropout masks are all in play.
"""

from __future__ import annotations

import pytest
import torch

from test_lora_packed import MODEL, VOCAB

from megatron_ext.lora.export import load_megatron
from megatron_ext.lora.job import LoraJob
from megatron_ext.lora.runtime import checkpoint
from megatron_ext.lora.runtime.base import build_base
from megatron_ext.lora.runtime.batching import SyntheticData
from megatron_ext.lora.runtime.layers import logical_weights
from megatron_ext.lora.runtime.packed import PackedTrainer

JOBS = [
    LoraJob("a", rank=4, lr=1e-2, weight_decay=0.1, steps=3, micro_batch_size=1, global_batch_size=2, seq_length=16,
            lr_decay_style="cosine", lr_warmup_steps=1, dropout=0.1, eval_interval=1, eval_iters=1),
    LoraJob("b", rank=8, lr=3e-2, steps=2, micro_batch_size=2, global_batch_size=2, seq_length=12, seed=5,
            target_modules=("linear_qkv", "linear_fc2"), clip_grad=0.05, eval_iters=1),
    LoraJob("c", rank=2, lr=2e-2, steps=2, micro_batch_size=1, global_batch_size=3, seq_length=16, seed=9,
            lr_decay_style="linear", eval_iters=1),
]  # packed steps: a 6; b 2, then c takes its slot for 6


def trainer_with(final: dict) -> PackedTrainer:
    model, wrappers, routing = build_base(MODEL, VOCAB, dtype=torch.float32)

    def keep(trainer, active):
        final[active.job.name] = logical_weights(trainer.wrappers, active.slot)

    trainer = PackedTrainer(model, wrappers, routing, lambda job: SyntheticData(job, VOCAB), 2, on_finish=keep)
    trainer.submit(JOBS)
    return trainer


def outcome(results: dict, final: dict) -> dict:
    return {name: (r.status, r.steps, r.losses, r.eval_losses, r.tokens, final.get(name)) for name, r in results.items()}


def assert_same(x: dict, y: dict) -> None:
    assert x.keys() == y.keys()
    for name in x:
        *values, weights = x[name]
        *others, other_weights = y[name]
        assert values == others, name  # floats compared exactly
        assert weights.keys() == other_weights.keys()
        assert all(torch.equal(weights[k][i], other_weights[k][i]) for k in weights for i in (0, 1)), name


@pytest.mark.parametrize("k", [1, 3])
def test_resume_is_bitwise_exact(one_rank_world, tmp_path, k):
    final = {}
    whole = outcome(trainer_with(final).run(), final)
    assert all(status == "done" for status, *_ in whole.values())

    final = {}
    first = trainer_with(final)
    first.run(until=k)
    mid_batch = {a.job.name for a in first.active.values() if a.micro}
    assert mid_batch, "k should stop a job inside its global batch"
    saved = {a.job.name: logical_weights(first.wrappers, a.slot) for a in first.active.values()}
    folder = first.save(tmp_path)
    del first

    second = trainer_with(final)
    second.resume(tmp_path)
    resumed = outcome(second.run(), final)
    assert_same(resumed, whole)
    for name, weights in saved.items():  # a job's checkpoint is also a plain adapter checkpoint
        job, loaded = load_megatron(folder / name)
        assert job == next(j for j in JOBS if j.name == name)
        assert all(torch.equal(loaded[key][i], weights[key][i]) for key in weights for i in (0, 1))


def test_a_save_that_fails_midway_leaves_the_previous_checkpoint(one_rank_world, tmp_path, monkeypatch):
    final = {}
    whole = outcome(trainer_with(final).run(), final)
    final = {}
    first = trainer_with(final)
    first.run(until=1)
    first.save(tmp_path)
    first.run(until=3)

    save_job, saved = checkpoint.save_job, []

    def disk_full_at_the_second_job(*args) -> None:
        if saved:
            raise OSError("no space left on device")
        saved.append(save_job(*args))

    monkeypatch.setattr(checkpoint, "save_job", disk_full_at_the_second_job)
    with pytest.raises(OSError, match="no space"):
        first.save(tmp_path)
    monkeypatch.undo()
    second = trainer_with(final)
    second.resume(tmp_path)  # from step 1: the save at step 3 never completed
    assert_same(outcome(second.run(), final), whole)


def test_resume_refuses_a_changed_job_and_the_others_go_on(one_rank_world, tmp_path):
    final = {}
    whole = outcome(trainer_with(final).run(), final)
    final = {}
    first = trainer_with(final)
    first.run(until=3)
    first.save(tmp_path)

    model, wrappers, routing = build_base(MODEL, VOCAB, dtype=torch.float32)
    changed = [JOBS[0].replace(lr=5e-3), *JOBS[1:]]
    second = PackedTrainer(model, wrappers, routing, lambda job: SyntheticData(job, VOCAB), 2,
                           on_finish=lambda t, a: final.__setitem__(a.job.name, logical_weights(t.wrappers, a.slot)))
    second.submit(changed)
    second.resume(tmp_path)
    results = second.run()
    assert results["a"].status == "failed" and "other ['lr']" in results["a"].error
    assert not any(w.adapters for w in wrappers.values())
    resumed = outcome(results, final)
    assert_same({n: resumed[n] for n in ("b", "c")}, {n: whole[n] for n in ("b", "c")})
