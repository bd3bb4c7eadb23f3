"""The left layout's objects are dropped by a background thread, not the caller's."""

from __future__ import annotations

import threading

from megatron_ext.training.release import release_in_background, wait_released


class Recorder:
    """Records the thread its last reference was dropped in."""

    def __init__(self, seen: list) -> None:
        self.seen = seen

    def __del__(self) -> None:
        self.seen.append(threading.current_thread().name)


def test_objects_are_dropped_in_the_background_thread_in_order():
    seen: list = []
    first, second = Recorder(seen), [Recorder(seen)]
    release_in_background(first)
    release_in_background(second)
    del first, second
    wait_released()
    assert seen == ["megatron_ext-release", "megatron_ext-release"]


def test_objects_still_referenced_elsewhere_are_kept():
    seen: list = []
    kept = Recorder(seen)
    release_in_background(kept)
    wait_released()
    assert seen == [] and kept.seen is seen


def test_nothing_handed_over_keeps_the_thread_going():
    seen: list = []
    release_in_background()
    release_in_background(Recorder(seen))
    wait_released()
    assert seen == ["megatron_ext-release"]
