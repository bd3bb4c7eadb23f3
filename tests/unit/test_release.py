"""The left layout's objects are dropped by a background thread, not the caller's; those in
reference cycles are collected there too, after a stall that paused automatic collection."""

from __future__ import annotations

import gc
import threading

from megatron_ext.parallel.release import collection_deferred, gc_paused, release_in_background, wait_released


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


def test_cycles_left_in_a_stall_are_collected_by_the_background_thread_after_it():
    seen: list = []
    cycle = Recorder(seen)
    cycle.self = cycle  # freed only by the cyclic collector
    gc.collect()  # now in the oldest generation, like a layout that trained for a while
    with collection_deferred():
        assert not gc.isenabled()
        release_in_background(cycle)
        del cycle
        kept = [[] for _ in range(100_000)]  # allocations that would trigger automatic collections
        assert seen == []
    del kept
    wait_released()
    assert gc.isenabled()
    assert seen == ["megatron_ext-release"]


def test_gc_paused_blocks_nest_and_restore_the_setting():
    with gc_paused():
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
