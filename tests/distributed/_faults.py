"""A training run with a fault injected into the first live reshard, for test_reshard_live.py.

    python tests/distributed/_faults.py SUMMARY.json fault.kind=raise fault.rank=1 ...overrides
    python tests/distributed/_faults.py - fault.kind=raise_in_stop_save ...overrides   # as the CLI

The `fault` plugin makes rank `fault.rank` fail at its `fault.after_writes`-th write of a
destination piece during a reshard: `raise` raises an exception there, `kill` ends the process
on the spot; or, with `raise_in_setup`, raise in its first trainer's setup (on a standby
worker: the trainer it builds ahead of joining); with `raise_ahead`, raise the first time it
builds an optimizer in a background thread (the new layout built ahead); with
`raise_in_stop_save`, raise in the save of a pre-emption stop (the ranks agreed to stop). Only in the job's
first attempt: a job the launcher restarts runs clean. The run's summary (losses and notes of
the last attempt) is written to SUMMARY.json; with `-` instead, the run goes through
`megatron_ext.train.main` (its exit codes and error lines).
"""

from __future__ import annotations

import json
import os
import sys
import threading
from dataclasses import dataclass

from megatron_ext.plugin import Plugin, register_plugin


@dataclass
class FaultConfig:
    kind: str = "raise"  # raise | kill | raise_in_setup | raise_ahead | raise_in_stop_save
    rank: int = 1
    after_writes: int = 3


_FAILED_SETUP: list = []  # whether this process's fault plugin has failed a setup or build


@register_plugin
class FaultPlugin(Plugin):
    name = "fault"
    config_class = FaultConfig

    def setup(self, ctx) -> None:
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


if __name__ == "__main__":
    from megatron_ext.train import main, run_from_overrides

    if sys.argv[1] == "-":
        main(sys.argv[2:])
        sys.exit(0)
    summary = run_from_overrides(sys.argv[2:])
    with open(sys.argv[1], "w") as f:
        json.dump(summary, f)
