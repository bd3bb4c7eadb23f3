"""Test plugins that inject a fault into a training run: `fault` (a failure at a chosen point of a
live reshard, a setup or a stop) and `nan` (a non-finite number at step k on one rank).

    python tests/faults/_faults.py SUMMARY.json fault.kind=raise fault.rank=1 ...overrides
    python tests/faults/_faults.py - fault.kind=raise_in_stop_save ...overrides   # as the CLI
    MEGATRON_EXT_PLUGINS=tests.faults._faults python -m megatron_ext.train plugins=[nan] nan.where=grad ...

The `fault` plugin makes rank `fault.rank` fail at its `fault.after_writes`-th write of a
destination piece during a reshard: `raise` raises an exception there, `kill` ends the process
on the spot, `signal` sends `fault.signal` to the job's process group (as `scancel` or Ctrl-C
would) and goes on; or, with `raise_in_setup`, raise in its first trainer's setup (on a standby
worker: the trainer it builds ahead of joining); with `raise_ahead`, raise the first time it
builds an optimizer in a background thread (the new layout built ahead); with
`raise_in_stop_save`, raise in the save of a pre-emption stop (the ranks agreed to stop). Only in the job's
first attempt: a job the launcher restarts runs clean.

The `nan` plugin makes step `nan.step` non-finite on rank `nan.rank`, the first time that step
runs (a rollback runs it again, clean): `loss`, that rank's loss of one token is NaN in the
forward pass (its gradients stay finite: only the loss check sees it); `grad`, one element of
the first gradient of that rank's model (the word embedding's, on the first pipeline stage) is NaN
before any reduction. With `data`, sample
`nan.sample` of the training set carries a NaN loss-mask weight whenever it is read, on every
rank that reads it (its loss and gradients turn NaN there): only passing over it gets by.

With a SUMMARY.json path, the run's summary (losses and notes of the last attempt) is written
there; with `-` instead, the run goes through `megatron_ext.train.main` (its exit codes and
error lines).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from dataclasses import dataclass
from typing import Optional

from megatron_ext.plugin import Plugin, register_plugin


@dataclass
class FaultConfig:
    kind: str = "raise"  # raise | kill | signal | raise_in_setup | raise_ahead | raise_in_stop_save
    rank: int = 1
    after_writes: int = 3
    signal: str = "SIGTERM"  # kind=signal: the signal sent to the job's process group


_FAILED_SETUP: list = []  # whether this process's fault plugin has failed a setup or build


@register_plugin
class FaultPlugin(Plugin):
    name = "fault"
    config_class = FaultConfig

    def setup(self, ctx) -> None:
        # torch and megatron: in the ranks (a launcher imports this module for its config)
        import torch.distributed as dist

        from megatron_ext.reshard.state_access import MegatronState
        from megatron_ext.training.trainer import Trainer

        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if not first_attempt or dist.get_rank() != self.cfg.rank:
            return
        # The hooks receive the Trainer's narrow context: a fault goes into the Trainer class.
        if self.cfg.kind == "raise_ahead":
            build = Trainer.build_optimizer

            def failing_build(trainer, *args, **kwargs):
                if threading.current_thread() is not threading.main_thread() and not _FAILED_SETUP:
                    _FAILED_SETUP.append(True)
                    raise RuntimeError("injected fault while building ahead")
                return build(trainer, *args, **kwargs)

            Trainer.build_optimizer = failing_build
            return
        if self.cfg.kind == "raise_in_stop_save":
            _fail_the_stops_save(Trainer)
            return
        if self.cfg.kind == "raise_in_setup":
            if not _FAILED_SETUP:
                _FAILED_SETUP.append(True)
                raise RuntimeError("injected fault in setup")
            return
        write, cfg, writes = MegatronState.write, self.cfg, [0]

        def failing_write(state, piece, box, values):
            writes[0] += 1
            if writes[0] == cfg.after_writes:
                if cfg.kind == "kill":
                    os._exit(1)
                if cfg.kind == "signal":
                    os.killpg(os.getpgrp(), signal.Signals[cfg.signal])
                else:
                    raise RuntimeError("injected fault")
            write(state, piece, box, values)

        MegatronState.write = failing_write


def _fail_the_stops_save(trainer_class: type) -> None:
    from megatron_ext.platform.signals import preemption_signals

    with preemption_signals() as signals:  # the worker's own, from its start
        stopping = signals.stopping

    def failing_save(*args, **kwargs):
        print("fault: raising in the save of the stop", file=sys.stderr, flush=True)  # for the test to see
        raise RuntimeError("injected fault in the save of the stop")

    def stop_then_fail_the_save() -> None:
        stopping()
        trainer_class.save = failing_save

    signals.stopping = stop_then_fail_the_save


@dataclass
class NanConfig:
    where: str = "grad"  # loss | grad | data
    rank: int = 1  # loss, grad: the global rank whose step turns non-finite
    step: int = 3  # loss, grad: the step (1-based)
    sample: Optional[int] = None  # data: the index of the poisoned training sample


@register_plugin
class NanPlugin(Plugin):
    name = "nan"
    config_class = NanConfig

    def __init__(self, cfg=None) -> None:
        super().__init__(cfg)
        self._fired = False
        self._hooks: list = []  # what makes this step non-finite, removed at the next one
        self._poisoned: Optional[type] = None

    def on_step_begin(self, ctx, step: int) -> None:
        import torch.distributed as dist  # torch: in the ranks (a launcher imports this module for its config)

        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        if self.cfg.where == "data":
            self._poison_sample(ctx)
            return
        if step != self.cfg.step or self._fired or dist.get_rank() != self.cfg.rank:
            return
        self._fired = True
        if self.cfg.where == "loss":
            self._hooks.append(ctx.model[-1].module.register_forward_hook(_nan_in_first_token_loss))
        elif self.cfg.where == "grad":
            param = next(p for p in ctx.model[0].parameters() if p.requires_grad)
            self._hooks.append(param.register_hook(_nan_in_first_element))
        else:
            raise ValueError(f"nan.where: {self.cfg.where!r} is none of loss, grad, data")

    def _poison_sample(self, ctx) -> None:
        """From the first step on, sample `nan.sample` of the training set (whichever dataset
        object is the run's: a rollback opens it anew) has a NaN loss-mask weight."""
        if self._poisoned is not None:
            return
        dataset_class = self._poisoned = type(ctx.train_ds)
        read, index = dataset_class.__getitem__, self.cfg.sample

        def poisoned_read(dataset, idx):
            sample = read(dataset, idx)
            if idx == index and dataset is ctx.train_ds:
                sample = {**sample, "loss_mask": sample["loss_mask"].clone()}
                sample["loss_mask"][0] = float("nan")
            return sample

        dataset_class.__getitem__ = poisoned_read


def _nan_in_first_token_loss(module, inputs, output):
    """The per-token losses of the last pipeline stage's forward, the first one NaN (filled:
    no gradient flows from it). On another stage the output is a hidden state: left alone."""
    if not module.post_process:
        return output
    first = output.new_zeros(output.shape, dtype=bool)
    first.view(-1)[0] = True
    return output.masked_fill(first, float("nan"))


def _nan_in_first_element(grad):
    grad = grad.clone()
    grad.view(-1)[0] = float("nan")
    return grad


if __name__ == "__main__":
    from megatron_ext.train import main, run_from_overrides

    if sys.argv[1] == "-":
        main(sys.argv[2:])
        sys.exit(0)
    summary = run_from_overrides(sys.argv[2:])
    with open(sys.argv[1], "w") as f:
        json.dump(summary, f)
