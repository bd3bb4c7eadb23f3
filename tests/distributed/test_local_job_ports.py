"""A job of local workers listens on 127.0.0.1 only: the rendezvous store on its launcher, the
workers' store and gloo's ports on its workers."""

from __future__ import annotations

import signal

import pytest

from tests.faults._job import TINY, Job

pytestmark = pytest.mark.distributed


def test_local_job_listens_on_localhost_only(tmp_path):
    job = Job([*TINY, "launcher.nproc=4", "parallel.dp=4", f"checkpoint.save={tmp_path / 'ckpt'}",
               f"data.cache_dir={tmp_path / 'cache'}"])
    job.wait_for_step(2)
    listening = {
        (p.pid, c.laddr.ip)
        for p in job.processes()
        for c in p.net_connections(kind="inet")
        if c.status == "LISTEN"
    }
    job.signal("group", signal.SIGTERM)
    assert job.wait() == 0, job.output[-4000:]
    assert {pid for pid, _ in listening} == {job.process.pid, *(w.pid for w in job.workers_at_start)}
    assert {ip for _, ip in listening} == {"127.0.0.1"}, listening
