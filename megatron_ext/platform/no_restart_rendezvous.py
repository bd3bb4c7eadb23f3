"""The rendezvous of `launch_local`'s workers: torch's c10d one, which refuses to restart a job
that must end.

torch's elastic agent restarts failed workers (`launcher.max_restarts`) through a new
rendezvous. Two failures must end the run instead: one after a pre-emption request (the job is
ending; a restarted one would train on from the last checkpoint past the request) and a worker's
refusal of its input (a restart would meet the same input). The launcher and the workers note
both in the launch's folder (local_workers.py), which this rendezvous reads. The backend is
registered through torch's registry of rendezvous handlers, its documented extension point.
"""

from __future__ import annotations

from typing import Callable, Optional

from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    rendezvous_handler_registry,
)

from megatron_ext.platform.local_workers import why_not_restart

BACKEND = "megatron_ext"
# The rendezvous config key of the launch's folder.
FOLDER_KEY = "megatron_ext_workers_folder"


class RestartRefused(RuntimeError):
    """The job failed and must not be restarted: the message says why."""


class _NoRestartRendezvous(RendezvousHandler):
    """torch's c10d rendezvous, refused after the first one while `why_not()` says why."""

    def __init__(self, inner: RendezvousHandler, why_not: Callable[[], Optional[str]]) -> None:
        self._inner, self._why_not, self._rounds = inner, why_not, 0

    def next_rendezvous(self) -> RendezvousInfo:
        why = self._why_not() if self._rounds else None
        if why is not None:
            raise RestartRefused(f"not restarted: {why}")
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
    config = dict(params.config)
    folder = config.pop(FOLDER_KEY)
    c10d = RendezvousParameters(
        "c10d", params.endpoint, params.run_id, params.min_nodes, params.max_nodes, params.local_addr, **config
    )
    return _NoRestartRendezvous(rendezvous_handler_registry.create_handler(c10d), lambda: why_not_restart(folder))


rendezvous_handler_registry.register(BACKEND, _create)
