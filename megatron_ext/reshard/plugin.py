"""`plugins=[reshard]`: change the layout of a running job between two steps.

Triggers, checked before every step:
  - a schedule in the config:   reshard.schedule='[{step: 100, layout: {tp: 1, pp: 2, dp: 2}}]'
  - a request file, polled:     reshard.request_file=/path/req.json  containing
                                {"layout": {"pp": 2, "dp": 2}}; it is renamed to *.done once
                                applied, so a cluster scheduler or a person can ask again
  - Python:                     megatron_ext.reshard.live.reshard(trainer, ParallelConfig(...))
A layout names the sizes that change; the others keep the run's values (dp is derived when
left out and tp/pp/cp change).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any, Optional

from megatron_ext.plugin import Plugin, register_plugin


@dataclass
class ReshardConfig:
    # [{step: N, layout: {tp: .., pp: .., dp: .., ep: .., cp: .., vpp: ..}}, ...]: reshard
    # before step N runs.
    schedule: list[Any] = field(default_factory=list)
    # A JSON file {"layout": {...}} polled between steps (None: no polling).
    request_file: Optional[str] = None
    # Staging memory per rank per transfer round, for what a rank sends and, separately, for
    # what it receives: the staging peak is at most twice this (printed in the reshard line).
    memory_budget_mb: float = 64.0


SIZES = ("tp", "pp", "dp", "ep", "cp", "vpp")


def target_config(current, layout: dict):
    """The run's ParallelConfig with the sizes `layout` names changed."""
    unknown = set(layout) - set(SIZES)
    if unknown:
        raise ValueError(f"reshard layout: unknown size(s) {sorted(unknown)}; use {list(SIZES)}")
    changes = dict(layout)
    changes.setdefault("dp", None)  # derived from the world unless named
    return dataclasses.replace(current, **changes)


@register_plugin
class ReshardPlugin(Plugin):
    name = "reshard"
    config_class = ReshardConfig

    def setup(self, trainer) -> None:
        self.reports: list = []
        self._due = {int(entry["step"]): dict(entry["layout"]) for entry in self.cfg.schedule}
        # A scheduled layout that cannot work is a config error: refuse it before training.
        parallel = trainer.cfg.parallel
        for step in sorted(self._due):
            parallel = self._checked(trainer, parallel, self._due[step])

    def on_step_begin(self, trainer, step: int) -> None:
        layout = self._due.get(step)
        if layout is None:
            layout = self._requested()
            if layout is None:
                return
            try:
                self._checked(trainer, trainer.cfg.parallel, layout)
            except ValueError as e:  # a bad request must not stop a running job
                trainer.note(f"step {step}: reshard request refused: {e}")
                return
        from megatron_ext.reshard.live import reshard

        report = reshard(trainer, target_config(trainer.cfg.parallel, layout), self.cfg.memory_budget_mb)
        self.reports.append(report)
        trainer.note(f"step {step}: {report}")

    @staticmethod
    def _checked(trainer, current, layout: dict):
        import torch.distributed as dist

        from megatron_ext.config.validate import validate

        target = target_config(current, layout)
        validate(dataclasses.replace(trainer.cfg, parallel=target), dist.get_world_size())
        return target

    def _requested(self) -> Optional[dict]:
        """The layout in the request file, read on rank 0 and shared with every rank."""
        if not self.cfg.request_file:
            return None
        import torch.distributed as dist

        message: list = [None]
        if dist.get_rank() == 0 and os.path.isfile(self.cfg.request_file):
            with open(self.cfg.request_file) as f:
                message[0] = json.load(f)["layout"]
            os.replace(self.cfg.request_file, self.cfg.request_file + ".done")
        dist.broadcast_object_list(message, src=0)
        return message[0]
