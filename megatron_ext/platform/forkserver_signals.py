"""Imported by `launch_local`'s forkserver only (a preloaded module), never elsewhere.

The forkserver starts the workers and reports their exit codes to the launcher; it does no
training. A pre-emption signal sent to it alone goes to its parent, the launcher, which forwards
it to the workers, and the server keeps serving: had it died, the launcher would read every
worker's exit status as 255 and end the run. (The server ignores SIGINT itself, as every
multiprocessing forkserver does; a signal to the whole process group reaches the launcher and
the workers directly.) A worker forked from here forwards a signal so too until it notes
signals itself, at its start (`launch._LocalWorker`).
"""

from __future__ import annotations

import os
import signal

from megatron_ext.platform.signals import FORWARDED_BY_FORKSERVER

_LAUNCHER, _SERVER = os.getppid(), os.getpid()


def _to_launcher(signum, frame) -> None:
    # In the server, or in a worker that has not put its own handlers in place yet; not in a
    # process whose parent died (the launcher's pid may be another process's by then).
    if os.getppid() in (_LAUNCHER, _SERVER):
        os.kill(_LAUNCHER, signum)


for _signum in FORWARDED_BY_FORKSERVER:
    signal.signal(_signum, _to_launcher)
