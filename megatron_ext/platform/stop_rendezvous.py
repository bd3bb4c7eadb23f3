"""The rendezvous of `launch_local`'s workers: torch's c10d one, which refuses to restart the job
once it was asked to stop.

torch's elastic agent restarts failed workers (`launcher.max_restarts`) through a new
rendezvous. After a pre-emption request the job is ending: a worker that fails while it saves
must end the run, not start a new one that trains on from the last checkpoint past the request.
Whether a request was made is read from the launch's folder, where the launcher and each worker
mark the first one they note (local_workers.py). The backend is registered through torch's
registry of rendezvous handlers, its documented extension point.
"""

from __future__ import annotations

from typing import Callable

from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    rendezvous_handler_registry,
)

BACKEND = "megatron_ext"
# The rendezvous config key of the launch's folder.
FOLDER_KEY = "megatron_ext_workers_folder"


class RestartRefused(RuntimeError):
    """The workers failed after the job was asked to stop: the job is not restarted."""


class _StopAwareRendezvous(RendezvousHandler):
    """torch's c10d rendezvous, refused after the first one once `stop_requested()`."""

    def __init__(self, inner: RendezvousHandler, stop_requested: Callable[[], bool]) -> None:
        self._inner, self._stop_requested, self._rounds = inner, stop_requested, 0

    def next_rendezvous(self) -> RendezvousInfo:
        if self._rounds and self._stop_requested():
            raise RestartRefused("not restarted: the job was asked to stop")
        self._rounds += 1
        return self._inner.next_rendezvous()

    def get_backend(self) -> str:
        return BACKEND

    @property
    def use_agent_store(self) -> bool:
        return self._inner.use_agent_store

    def is_closed(self) -> bool:
        return self._inner.is_closed()

    def set_closed(self) -> None:
        self._inner.set_closed()

    def num_nodes_waiting(self) -> int:
        return self._inner.num_nodes_waiting()

    def get_run_id(self) -> str:
        return self._inner.get_run_id()

    def shutdown(self) -> bool:
        return self._inner.shutdown()


def _create(params: RendezvousParameters) -> RendezvousHandler:
    from megatron_ext.platform.local_workers import stop_requested

    config = dict(params.config)
    folder = config.pop(FOLDER_KEY)
    c10d = RendezvousParameters(
        "c10d", params.endpoint, params.run_id, params.min_nodes, params.max_nodes, params.local_addr, **config
    )
    return _StopAwareRendezvous(rendezvous_handler_registry.create_handler(c10d), lambda: stop_requested(folder))


rendezvous_handler_registry.register(BACKEND, _create)
