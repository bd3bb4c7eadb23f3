"""Dropping the last references to a left layout's objects off the training thread.

A gloo process group's destructor joins its threads and closes its connections: tens of
milliseconds each (28 ms per connected group, measured on 4 CPU ranks), with the GIL released.
A layout holds about twenty groups; freed in the training thread when a job switches layout,
they added 0.02-0.11 s per rank to a tiny model's live reshard (profiled on 4 ranks, where the
whole stall was 0.12-0.22 s). One daemon thread takes the references instead and drops them, in
the order given.

Much of a layout (modules and their hooks, DDP, the optimizer, the groups they hold) sits in
reference cycles, which only the cyclic garbage collector frees: left alone, it ran at whatever
allocation next crossed its threshold, in any thread, and with the groups' destructors a full
collection took 1.1-2.1 s in each of 4 tiny-model workers after a few moves (measured; a full
collection of a worker's 340k tracked objects alone takes about 0.3 s here). A stall therefore
pauses automatic collection and ends by asking this thread to collect
(`collection_deferred`), so that the destructors run there, after the stall.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import queue
import threading
import traceback
from typing import Any, Callable, Iterator, Optional, TypeVar

T = TypeVar("T")
_log = logging.getLogger(__name__)

_QUEUE: queue.SimpleQueue = queue.SimpleQueue()
_THREAD: Optional[threading.Thread] = None
_LOCK = threading.Lock()


def release_in_background(*objects: Any) -> None:
    """Let a background thread drop these references (the caller keeps none it needs)."""
    global _THREAD
    with _LOCK:
        if _THREAD is None:
            _THREAD = threading.Thread(target=_drop_forever, name="megatron_ext-release", daemon=True)
            _THREAD.start()
    _QUEUE.put(objects)


@contextlib.contextmanager
def collection_deferred() -> Iterator[None]:
    """No automatic garbage collection inside the block (`gc_paused`); after it, the background
    thread runs a full one once it has dropped what it was handed so far."""
    with gc_paused():
        try:
            yield
        finally:
            release_in_background(_COLLECT)


def wait_released() -> None:
    """Until everything handed over so far has been dropped (and collected, where asked)."""
    if _THREAD is not None:
        done = threading.Event()
        _QUEUE.put((done,))
        done.wait()


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """No automatic garbage collection inside the block (in any thread: the switch is
    process-wide); explicit `gc.collect()` calls still run."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


_COLLECT = object()  # collect_in_background's mark


def _drop_forever() -> None:
    while True:
        objects = _QUEUE.get()
        for item in objects:
            if item is _COLLECT:
                gc.collect()
            elif isinstance(item, threading.Event):  # wait_released's mark
                item.set()
        objects = item = None


def built_or_failure(build: Callable[[], T], free_failed: Callable[[], Any]) -> tuple[Optional[T], Optional[str]]:
    """(`build()`, None), or (None, what failed) with everything the failed build made freed
    at once: `free_failed` forgets what it registered elsewhere (process groups), and its
    objects go with the traceback's frames (logged as text). A gloo group closes its
    connections only in its destructor, so peers waiting in a collective of the failed build's
    groups fail then, rather than at their timeout."""
    try:
        return build(), None
    except Exception as e:  # noqa: BLE001 - reported to the caller, without its frames
        failure = f"{type(e).__name__}: {e}"
        _log.warning("building ahead failed:\n%s", traceback.format_exc())
    free_failed()
    gc.collect()
    return None, failure


def describe(error: Optional[BaseException | str]) -> Optional[str]:
    """A failure as one line ("Type: message"); a string is one already."""
    return error if error is None or isinstance(error, str) else f"{type(error).__name__}: {error}"


def unlink_optimizer(model_config: Any) -> None:
    """Drop a model config's (megatron's TransformerConfig) link to its optimizer (loss
    scaling). The optimizer's fp32 shards are views with autograd history, which hides DDP's
    hook cycle from Python's garbage collector: with the link, a layout left behind would never
    be freed."""
    model_config.grad_scale_func = None
