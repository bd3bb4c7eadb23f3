"""One-rank training under Megatron-LM's batch-size schedules: each step runs the micro-batches
of the global batch Megatron-LM's rules give at the samples consumed before it (written out
here), its learning rate is the scheduler's formula at the samples consumed after it (Megatron-LM
advances the scheduler by each step's batch), a checkpoint is saved before a step of a new
batch (as Megatron-LM saves one), and a run stopped mid-schedule resumes from its checkpoint
bitwise equal to the run that was not stopped."""

from __future__ import annotations

import math

import pytest

from megatron_ext.train import run_from_overrides
from megatron_ext.training import trainer as trainer_module
from megatron_ext.training.trainer import Trainer

LR, MIN_LR, SEQ = 1e-3, 1e-4, 32
COMMON = [
    "experiment=none",
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.ffn_hidden_size=128",
    "model.num_attention_heads=4",
    "model.num_query_groups=2",
    f"model.seq_length={SEQ}",
    "train.micro_batch_size=1",
    "train.eval_interval=0",
    f"optim.lr={LR}",
    f"optim.min_lr={MIN_LR}",
    "optim.lr_decay_style=cosine",
    "logging.progress_bar=false",
    "launcher.nproc=1",
    "data.mock=true",
]


def ramp(start: int, increment: int, ramp_samples: int, gbs: int):
    """megatron-core's ramp: one increment per ramp_samples / increments samples."""
    per_increment = ramp_samples / ((gbs - start) // increment)
    return lambda consumed: gbs if consumed > ramp_samples else start + increment * int(consumed / per_increment)


def steps(*entries: tuple[int, int]):
    """Megatron-LM's step schedule, thresholds in samples."""
    return lambda consumed: [batch for threshold, batch in entries if consumed >= threshold][-1]


# name -> (overrides, batch at consumed samples, iterations, lr warmup / decay in samples,
# iteration to stop and resume at)
CASES = {
    # 2 2 2 4 4 while the ramp lasts (14 samples), then (40 - 14) // 6 = 4 steps of 6
    "rampup_samples": (
        ["train.global_batch_size=6", "train.rampup_batch_size=[2,2,12]", "train.train_samples=40",
         "optim.lr_warmup_samples=4"],
        ramp(2, 2, 12, 6), 9, (4, 40), 4,
    ),
    # Megatron-LM's gpt3 example's form: iterations, the schedule's last batch as the global one;
    # the lr schedule counts iterations times it (warmup 1 * 4, decay 6 * 4 samples).
    "step_schedule_iterations": (
        ["train.global_batch_size=4", f"train.step_batch_size_schedule='0:2 {2 * SEQ}:3 {5 * SEQ}:4'",
         "train.iters=6", "optim.lr_warmup_iters=1"],
        steps((0, 2), (2, 3), (5, 4)), 6, (4, 24), 2,
    ),
}


def expected_lr(consumed: int, warmup: int, decay: int) -> float:
    """megatron-core's OptimizerParamScheduler at `consumed` samples: linear warmup, cosine."""
    if consumed <= warmup:
        return LR * consumed / warmup
    if consumed > decay:
        return MIN_LR
    coeff = 0.5 * (math.cos(math.pi * (consumed - warmup) / (decay - warmup)) + 1.0)
    return MIN_LR + coeff * (LR - MIN_LR)


def recorded_run(overrides: list[str], monkeypatch) -> list[tuple[int, float, float]]:
    """(micro-batches run, lr, loss) of each training step of one invocation."""
    forwards, record = [0], []
    forward_step, train_step = trainer_module.forward_step, Trainer.train_step

    def counted_forward(data_iterator, model):
        forwards[0] += 1
        return forward_step(data_iterator, model)

    def recorded_step(trainer):
        forwards[0] = 0
        metrics = train_step(trainer)
        record.append((forwards[0], metrics["lr"]))
        return metrics

    with monkeypatch.context() as m:
        m.setattr(trainer_module, "forward_step", counted_forward)
        m.setattr(Trainer, "train_step", recorded_step)
        losses = run_from_overrides([*COMMON, *overrides])["losses"]
    return [(forwards, lr, loss) for (forwards, lr), loss in zip(record, losses, strict=True)]


@pytest.mark.parametrize("overrides, batch_at, iters, lr_samples, stop", CASES.values(), ids=CASES.keys())
def test_schedule_trains_megatron_batches_and_resumes_bitwise(overrides, batch_at, iters, lr_samples, stop, tmp_path, monkeypatch):
    overrides = [*overrides, f"data.cache_dir={tmp_path / 'cache'}"]
    whole = recorded_run(overrides, monkeypatch)

    batches, consumed = [], 0
    for _ in range(iters):
        batches.append(batch_at(consumed))
        consumed += batches[-1]
    assert [micro for micro, _, _ in whole] == batches  # one sample per micro-batch, one rank
    assert len(set(batches)) > 1
    after = [sum(batches[: i + 1]) for i in range(iters)]
    assert [lr for _, lr, _ in whole] == pytest.approx([expected_lr(c, *lr_samples) for c in after], rel=1e-12)

    ckpt = tmp_path / "ckpt"
    first = recorded_run([*overrides, f"train.exit_interval={stop}", f"checkpoint.save={ckpt}"], monkeypatch)
    # Megatron-LM also saves before the first step of a new global batch: step `stop`'s here.
    assert batches[stop - 1] != batches[stop - 2]
    assert sorted(p.name for p in ckpt.glob("iter_*")) == [f"iter_{stop - 1:07d}", f"iter_{stop:07d}"]
    resumed = recorded_run([*overrides, f"checkpoint.load={ckpt}", f"checkpoint.save={ckpt}"], monkeypatch)
    assert first + resumed == whole  # exact floats: the same batches, lrs and losses
