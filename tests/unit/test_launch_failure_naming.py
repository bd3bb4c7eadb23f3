"""The launch names the worker that failed of its own accord, not the first to end: under load
the one that raised can end after a peer that failed on the connection to it."""

from __future__ import annotations

import signal
from pathlib import Path
from types import SimpleNamespace

import pytest

from megatron_ext.platform.local_workers import LocalWorkers, _Ended

LOST = "RuntimeError: [gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:41234"
RESET = "RuntimeError: Connection reset by peer"

# (name, workers in the order they ended: (local rank, exit code, noted error or None), rank named)
CASES = [
    ("raiser_ends_after_its_echo", [(2, 1, LOST), (1, 1, "RuntimeError: injected fault"), (0, 1, RESET)], 1),
    ("killed_worker_notes_nothing", [(3, 1, LOST), (0, 1, LOST), (2, -signal.SIGKILL, None)], 2),
    ("first_to_end_when_all_lost_connections", [(3, 1, LOST), (1, 1, RESET)], 3),
    ("a_clean_exit_is_no_failure", [(0, 0, None), (1, 1, "ValueError: bad")], 1),
]


@pytest.mark.parametrize("ended, named", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_first_failure_named(ended, named):
    with LocalWorkers(preemption=False, deadline_s=None) as workers:
        for rank, code, error in ended:
            process = SimpleNamespace(pid=1000 + rank, exitcode=code)
            workers._ended.append(_Ended(attempt=0, rank=rank, process=process))
            if error is not None:
                Path(workers.folder, f"failed.0_{rank}").write_text(error)
        message = str(workers.failure(RuntimeError("torch's report")))
    assert message.startswith(f"rank {named} (pid {1000 + named}) failed first: "), message


def test_no_failed_worker_gives_torchs_line():
    with LocalWorkers(preemption=False, deadline_s=None) as workers:
        message = str(workers.failure(RuntimeError("torch's report\nmore")))
    assert message == "torch's report"
