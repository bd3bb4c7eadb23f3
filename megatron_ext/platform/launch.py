"""Where the processes come from: torchrun, SLURM `srun`, or N local workers started here.

The trainer always runs inside an initialised torch.distributed world. `detect_launch()` reads
what an outside launcher set; when there is none, `launch_local()` starts `nproc` workers itself
with torch's elastic agent (the machinery behind torchrun) so failures propagate the same way.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import multiprocessing
import os
import signal
import socket
import sys
from datetime import timedelta
from typing import Any, Callable, Iterator, Optional

import psutil
import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from megatron_ext.platform import cpu_compat, resource_tracker, writer_queue
from megatron_ext.platform import no_restart_rendezvous as rendezvous
from megatron_ext.platform.device import resolve_device
from megatron_ext.platform.launch_env import LISTEN_ON_ENV, LaunchEnv, detect_launch
from megatron_ext.platform.local_workers import (
    REFUSED_EXIT_CODE,
    LaunchFailed,
    LocalWorkers,
    note_failure,
    note_refusal,
    note_stop_request,
    register,
    say_in_launch,
)
from megatron_ext.platform.signals import FORWARDED_BY_FORKSERVER, preemption_signals


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(launch: LaunchEnv, device: torch.device, timeout_s: int = 600) -> None:
    """Join the world `launch` describes (gloo on CPU, NCCL on GPU). The rendezvous is passed
    explicitly rather than through os.environ, so a process that trains in-process (tests,
    notebooks) keeps its environment as it was."""
    if dist.is_initialized():
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = timedelta(seconds=timeout_s)
    dist.init_process_group(
        backend="nccl" if device.type == "cuda" else "gloo",
        store=rendezvous_store(launch, timeout),
        rank=launch.rank,
        world_size=launch.world_size,
        timeout=timeout,
    )


def rendezvous_store(launch: LaunchEnv, timeout: timedelta) -> dist.Store:
    """The key-value store the world meets in, hosted by rank 0 (listening on
    `launch.listen_on` only, when given) or by torchrun's agent. An agent-hosted store outlives
    a restart of the job, so each attempt works under its own prefix: a restarted job must not
    read the addresses its dead predecessors left there."""
    is_master = launch.rank == 0 and not launch.agent_store
    store = dist.TCPStore(
        launch.master_addr,
        launch.master_port,
        launch.world_size,
        is_master=is_master,
        timeout=timeout,
        master_listen_fd=listener(launch.listen_on, launch.master_port).detach()
        if is_master and launch.listen_on
        else None,
    )
    return dist.PrefixStore(f"megatron_ext/attempt_{launch.restart}", store)


def join_world(device_request: str = "auto", timeout_s: int = 600) -> tuple[LaunchEnv, torch.device]:
    """Join the world an outside launcher made, or form a world of one: `prepare_process`,
    then initialise torch.distributed."""
    launch, device = prepare_process(device_request)
    init_distributed(launch, device, timeout_s)
    return launch, device


def prepare_process(device_request: str = "auto") -> tuple[LaunchEnv, torch.device]:
    """This process's place in the launch and its device, with CPU threads limited, the CPU
    compatibility layer applied when the device is the CPU, megatron's checkpoint writer made to
    leave no process behind (writer_queue.py) and Python's resource tracker to outlive SIGUSR1
    (resource_tracker.py)."""
    launch = detect_launch() or LaunchEnv(0, 1, 0, "127.0.0.1", free_port(), "local", listen_on="127.0.0.1")
    if launch.listen_on:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", interface_of(launch.listen_on))
    device = resolve_device(device_request, launch.local_rank)
    if device.type == "cpu":
        limit_cpu_threads(launch.world_size)
    cpu_compat.apply(on_cpu=device.type == "cpu")
    writer_queue.apply()
    resource_tracker.start()
    return launch, device


def limit_cpu_threads(nproc_on_host: int) -> None:
    """Workers sharing a few cores oversubscribe them with one OpenMP pool each."""
    if "OMP_NUM_THREADS" not in os.environ and nproc_on_host > 1:
        os.environ["OMP_NUM_THREADS"] = "1"


def launch_local(
    nproc: int,
    worker: Callable[..., Any],
    args: tuple,
    master_addr: str,
    master_port: int,
    max_restarts: int = 0,
    preempt_timeout_s: Optional[float] = None,
    refusals: tuple[type[BaseException], ...] = (),
) -> dict[int, Any]:
    """Run `worker(*args)` in `nproc` local processes forming one world (like torchrun);
    returns each rank's return value. When a worker fails, all are restarted, up to
    `max_restarts` times, but not once the job was asked to stop; then LaunchFailed names the
    first worker that failed, its error, and the log file that holds the workers' tracebacks and
    torch's reports (platform/local_workers.py). A worker that raises one of `refusals` (bad
    input) ends the
    launch, never restarted: LaunchRefused, its one line. With
    `preempt_timeout_s` (workers that stop at a step boundary on a pre-emption signal), a
    signal to this process is forwarded to the workers (platform/local_workers.py); a second
    one, or no exit within `preempt_timeout_s` seconds (0: no deadline), raises LaunchAborted.
    Without, torch's agent ends the workers on SIGTERM or SIGINT. Every port the job listens
    on is bound to `master_addr`."""
    interface_of(master_addr)  # refused here, before a worker starts
    limit_cpu_threads(nproc)
    resource_tracker.start()  # the forkserver's and the workers' (before the forkserver starts it)
    start_method = "spawn" if torch.cuda.is_available() else "forkserver"
    environ = None
    if start_method == "forkserver":
        # Workers are forked from one server process that imported megatron once (seconds per
        # process, times nproc on a few shared cores), kept for every later launch of this
        # process. Not with CUDA: the server's imports may initialise the driver, which a
        # forked child cannot use.
        multiprocessing.set_forkserver_preload([*_PRELOAD, worker.__module__])
        environ = dict(os.environ)
    preemption = preempt_timeout_s is not None
    with bound_store(master_addr, master_port) as port, LocalWorkers(preemption, preempt_timeout_s) as workers:
        config = LaunchConfig(
            local_addr=master_addr,  # the workers' MASTER_ADDR (else the host's name)
            min_nodes=1,
            max_nodes=1,
            nproc_per_node=nproc,
            run_id=f"megatron_ext_{os.getpid()}",
            rdzv_backend=rendezvous.BACKEND,  # c10d's, refusing restarts of a job that must end
            rdzv_endpoint=f"{master_addr}:{port}",
            rdzv_configs={rendezvous.FOLDER_KEY: workers.folder},
            max_restarts=max_restarts,
            monitor_interval=0.5,
            start_method=start_method,
            **_agent_signals(LaunchConfig, preemption),
        )
        listen_on = {LISTEN_ON_ENV: master_addr}
        entry = _LocalWorker(
            worker, environ, listen_on, workers.folder, workers.log, preemption, workers.worker_deadline_s, refusals
        )
        try:
            with _worker_hosted_store():
                return elastic_launch(config, entry)(*args)
        except SignalException:
            if workers.aborted is None:
                raise
            raise workers.aborted from None
        except (ChildFailedError, rendezvous.RestartRefused) as e:
            refused = workers.refusal()
            if refused is not None:
                raise refused from None
            if isinstance(e, rendezvous.RestartRefused):
                raise LaunchFailed(f"{workers.failure(e)}; {e}") from e
            raise workers.failure(e) from e


def interface_of(address: str) -> str:
    """The network interface that carries `address` (gloo binds to an interface by name)."""
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address == address for a in addresses):
            return name
    raise ValueError(f"launcher.master_addr: {address} is not an address of this machine")


def listener(address: str, port: int) -> socket.socket:
    """A TCP socket listening on `address` only, at `port` (a free one when 0), for a store
    server to take over (torch's own listens on every interface)."""
    sock = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((address, port))
    sock.listen(1024)
    return sock


@contextlib.contextmanager
def bound_store(address: str, port: int) -> Iterator[int]:
    """A store server listening on `address` only, for the elastic agent's rendezvous to use:
    torch's c10d rendezvous opens its store as a multi-tenant one, which joins a server this
    process already runs on the port (a torch that did not would find the port taken and join
    as a client). Yields the port (a free one when `port` is 0)."""
    sock = listener(address, port)
    port = sock.getsockname()[1]
    store = dist.TCPStore(
        address,
        port,
        None,
        True,
        timedelta(seconds=60),
        wait_for_workers=False,
        multi_tenant=True,
        master_listen_fd=sock.detach(),  # the store's from now on
    )
    try:
        yield port
    finally:
        del store


@contextlib.contextmanager
def _worker_hosted_store() -> Iterator[None]:
    """The workers' store is hosted by their rank 0 (`rendezvous_store`, on the address it is
    given) rather than by torch's agent, whose own server would listen on every interface.
    This process's environment is given back as it was (torch's launch also sets the signals
    its agent handles there)."""
    names = ("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "TORCHELASTIC_SIGNALS_TO_HANDLE")
    previous = {name: os.environ.get(name) for name in names}
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    try:
        yield
    finally:
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


# What every worker imports; megatron_ext.training.trainer pulls in megatron-core, and torch's
# optimizers import TorchDynamo when the first one is built (about 1 s on these CPUs).
# The forkserver also forwards a pre-emption signal sent to it alone to the launcher.
_PRELOAD = (
    "megatron_ext.platform.forkserver_signals",
    "megatron_ext.platform.launch",
    "megatron_ext.training.trainer",
    "torch._dynamo",
)


def _agent_signals(launch_config: type, preemption: bool) -> dict:
    """The signals torch's agent handles itself (it ends the workers): with `preemption`, not
    the pre-emption signals, which are the launcher's (local_workers.py); else these too, so
    that SIGUSR1 leaves no worker behind. torch before 2.9 handles SIGTERM, SIGINT, SIGHUP and
    SIGQUIT whatever it is told."""
    if "signals_to_handle" not in {f.name for f in dataclasses.fields(launch_config)}:
        return {}
    return {"signals_to_handle": "SIGHUP,SIGQUIT" if preemption else "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"}


# This process's environment when this module was imported: in a forkserver, the server's.
_ENVIRON_AT_IMPORT = dict(os.environ)


class _LocalWorker:
    """`worker` as a process of `launch_local` runs it: registered in the launch's folder
    (local_workers.py), with `extra_env`, without the handlers it inherits from the forkserver;
    with `preemption`, noting pre-emption signals from its start (with `deadline_s`;
    platform/signals.py); exiting on an exception of `refusals` with its line noted
    (local_workers.py) rather than a traceback; failing on another with its first line noted and
    its traceback in the launch's `log`. Under a forkserver also in `environ`, the
    launcher's environment of the moment of the launch, plus the variables the elastic agent
    set for the rank, as a spawned worker sees them: a forkserver's children inherit the
    server's environment instead, the launcher's at the server's start (Python hands them the
    launcher's working directory and import path itself)."""

    def __init__(
        self,
        worker: Callable[..., Any],
        environ: Optional[dict],
        extra_env: dict,
        folder: str,
        log: str,
        preemption: bool,
        deadline_s: Optional[float],
        refusals: tuple[type[BaseException], ...] = (),
    ) -> None:
        functools.update_wrapper(self, worker)  # the elastic agent names the job after it
        self.worker, self.environ, self.extra_env = worker, environ, extra_env
        self.folder, self.log, self.preemption, self.deadline_s = folder, log, preemption, deadline_s
        self.refusals = refusals

    def __call__(self, *args: Any) -> Any:
        for signum in FORWARDED_BY_FORKSERVER:  # not to be chained to after a stop
            signal.signal(signum, signal.SIG_DFL)
        signals = contextlib.nullcontext()
        if self.preemption:
            # noted when the ranks agree to stop, not when a signal comes: torch's agent
            # signals the workers too, to end them after a failure
            noted = functools.partial(note_stop_request, self.folder)
            notices = functools.partial(say_in_launch, self.folder, self.log)
            signals = preemption_signals(self.deadline_s, from_launcher=True, on_stop=noted, notices=notices)
        with signals:
            if self.environ is not None:
                from_agent = {k: v for k, v in os.environ.items() if _ENVIRON_AT_IMPORT.get(k) != v}
                os.environ.clear()
                os.environ.update({**self.environ, **from_agent})
            os.environ.update(self.extra_env)  # prepare_process binds gloo to LISTEN_ON_ENV too
            if "OMP_NUM_THREADS" in os.environ:  # read by OpenMP when the server loaded torch
                torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
            register(self.folder)
            try:
                return self.worker(*args)
            except self.refusals as e:
                note_refusal(self.folder, e)
                sys.exit(REFUSED_EXIT_CODE)
            except Exception as e:
                note_failure(self.folder, self.log, e)
                raise
