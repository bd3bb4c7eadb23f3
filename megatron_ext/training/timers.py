"""Wall-clock time of the phases of a training step, as Megatron-LM's timers report them
(`--log-timers-to-tensorboard`: forward-backward, optimizer, per iteration)."""

from __future__ import annotations

import functools
from typing import Callable

from megatron_ext.platform.device import current_device, wall_clock


class Timers:
    def __init__(self) -> None:
        self._clock = wall_clock(current_device())
        self._seconds: dict[str, float] = {}

    def timed(self, name: str, fn: Callable) -> Callable:
        """`fn`, its calls' time added to phase `name`."""

        @functools.wraps(fn)
        def call(*args, **kwargs):
            start = self._clock()
            try:
                return fn(*args, **kwargs)
            finally:
                self._seconds[name] = self._seconds.get(name, 0.0) + self._clock() - start

        return call

    def pop(self) -> dict[str, float]:
        """The seconds of each phase since the last pop."""
        seconds, self._seconds = self._seconds, {}
        return seconds
