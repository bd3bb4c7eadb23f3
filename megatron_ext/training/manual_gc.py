"""Garbage collection at steps every rank agrees on (`train.manual_gc`, Megatron-LM's flags).

Python's cyclic collector runs when allocations cross its thresholds: at a moment of each
process's own. A full collection of a training process's objects takes tenths of a second here
(0.3 s for a worker's 340k tracked objects on these CPUs), and every other rank waits for it in
the next collective. With manual collection the training loop turns the automatic collector
off and collects on every rank at the same iterations instead.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator

from megatron_ext.config.schema import TrainConfig
from megatron_ext.parallel.release import gc_paused


class ManualGC:
    """The training loop's garbage collection: automatic (the default), or manual as
    `TrainConfig.manual_gc`, `manual_gc_interval` and `manual_gc_eval` say."""

    def __init__(self, cfg: TrainConfig) -> None:
        self.enabled = cfg.manual_gc
        self.interval = cfg.manual_gc_interval
        self.around_eval = cfg.manual_gc_eval

    @contextlib.contextmanager
    def training(self) -> Iterator["ManualGC"]:
        """The training loop: no automatic collection inside it when manual (what was pending
        is collected first)."""
        if self.enabled:
            gc.collect()
        with gc_paused() if self.enabled else contextlib.nullcontext():
            yield self

    def after_step(self, iteration: int) -> None:
        if self.enabled and self.interval and iteration % self.interval == 0:
            gc.collect()

    @contextlib.contextmanager
    def evaluation(self) -> Iterator[None]:
        """An evaluation, with a collection before and after it when manual."""
        collect = self.enabled and self.around_eval
        if collect:
            gc.collect()
        yield
        if collect:
            gc.collect()
