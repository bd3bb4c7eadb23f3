"""The global batch of each step as a function of the samples consumed before it: constant,
Megatron-LM's ramp (`--rampup-batch-size`) or its step schedule (`--step-batch-size-schedule`).

    batches = BatchSchedule.of(cfg.train, cfg.model.seq_length, global_batch_size=16)
    batches.at(consumed_samples)      # the next step's global batch
    batches.train_iters(train_samples)  # the iterations a sample-based run trains

The ramp is megatron-core 0.16's `RampupBatchsizeNumMicroBatchesCalculator`: from `start` the
batch grows by `increment` in (global_batch_size - start) / increment equal shares of
`ramp_samples`, then stays at global_batch_size. The step schedule is Megatron-LM's
`StepBatchsizeNumMicroBatchesCalculator` (newer than megatron-core 0.16, so written here): the
batch of the last entry whose threshold the consumed samples have reached. Megatron-LM gives it
the sequence length, so thresholds are tokens, converted to samples by floor division. Reading
and checking a schedule is the config's (config/batch_sizes.py).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

from megatron.core.num_microbatches_calculator import RampupBatchsizeNumMicroBatchesCalculator

from megatron_ext.config.batch_sizes import parse_step_schedule
from megatron_ext.config.schema import TrainConfig


@dataclass(frozen=True)
class BatchSchedule:
    # Megatron-LM's args.global_batch_size: the constant batch, a ramp's last one; it sizes the
    # evaluation and converts iteration counts of the lr schedule to samples.
    global_batch_size: int
    # [start, increment, ramp samples]
    rampup: Optional[tuple[int, int, int]] = None
    # (threshold in samples, batch), sorted
    steps: Optional[tuple[tuple[int, int], ...]] = None

    @classmethod
    def of(cls, train: TrainConfig, seq_length: int, global_batch_size: int) -> BatchSchedule:
        rampup = tuple(train.rampup_batch_size) if train.rampup_batch_size is not None else None
        steps = None
        if train.step_batch_size_schedule is not None:
            steps = parse_step_schedule(train.step_batch_size_schedule, seq_length)
        return cls(global_batch_size, rampup, steps)

    @property
    def varies(self) -> bool:
        return self.rampup is not None or self.steps is not None

    def at(self, consumed_samples: int) -> int:
        """The global batch of the step that starts after `consumed_samples` samples."""
        if self.steps is not None:
            batch = self.steps[0][1]
            for threshold, size in self.steps:
                if consumed_samples < threshold:
                    break
                batch = size
            return batch
        if self.rampup is not None:
            self._ramp.update(consumed_samples, consistency_check=False)
            return self._ramp.get_current_global_batch_size()
        return self.global_batch_size

    @functools.cached_property
    def _ramp(self):
        # One micro-batch of one sample on one rank: the calculator then only computes the batch
        # (divisibility is the config's rule); a rank other than 0 keeps it from logging.
        start, increment, samples = self.rampup
        return RampupBatchsizeNumMicroBatchesCalculator(
            self.global_batch_size, 1, 1, False, 1, start, increment, samples
        )

    def train_iters(self, train_samples: int) -> int:
        """The iterations of a run of `train_samples` samples, counted as Megatron-LM's
        `update_train_iters` counts them: whole constant batches (a partial last one is not
        trained); a step schedule's steps until the samples are reached (the last may pass
        them); a ramp's steps while the samples consumed have not passed the ramp or the run,
        then whole batches of the rest."""
        if self.steps is not None:
            return self._steps_until(lambda consumed: consumed < train_samples)
        if self.rampup is None:
            return train_samples // self.global_batch_size
        ramp_samples = self.rampup[2]
        iters = self._steps_until(lambda consumed: consumed <= min(ramp_samples, train_samples))
        consumed = self.samples(iters)
        return iters + max(train_samples - consumed, 0) // self.global_batch_size

    def _steps_until(self, going_on) -> int:
        iters, consumed = 0, 0
        while going_on(consumed):
            consumed += self.at(consumed)
            iters += 1
        return iters

    def samples(self, iters: int) -> int:
        """The samples `iters` iterations from the start consume."""
        consumed = 0
        while iters and not self._settled(consumed):
            consumed += self.at(consumed)
            iters -= 1
        return consumed + iters * self.at(consumed)

    def _settled(self, consumed_samples: int) -> bool:
        """Whether the batch stays what it is from `consumed_samples` on."""
        if self.steps is not None:
            return consumed_samples >= self.steps[-1][0]
        return self.rampup is None or consumed_samples > self.rampup[2]
