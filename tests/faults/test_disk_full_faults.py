"""A full disk during a save: the write that runs out of space ends in one line naming the path
and the space left on its filesystem, where the writers' own errors name neither (`[Errno 28]`
without a path, torch's `unexpected pos`, megatron's empty CheckpointException); the last
complete checkpoint stays the latest.

In one process, a save whose files fail to sync (sync and async saves), and the errors known as a
full disk. Then (-m slow; it needs root to mount) a DP=2 job on a real tmpfs with room for one
and a half checkpoints: its second save fills it. What must hold: exit 2 and that one line last
on stderr; the tracker at the first checkpoint, bitwise the clean run's; a resume from it trains
the next step to the clean run's checkpoint of that step, bitwise.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import subprocess
import uuid

import pytest

from megatron_ext.config.schema import ModelConfig
from megatron_ext.config.validate import ConfigError
from megatron_ext.models.convert.world import build_model
from megatron_ext.platform.disk_space import disk_full
from megatron_ext.checkpointing import torch_dist as ckpt
from megatron_ext.checkpointing.megatron_lm import content_metadata
from tests.faults._job import Job
from tests.faults._runs import BASE, LAYOUTS, assert_bitwise, staging_folders, steps_logged

SMALL = ModelConfig(num_layers=2, hidden_size=32, ffn_hidden_size=48, num_attention_heads=4, num_query_groups=2, vocab_size=100)
FREE = re.compile(r"no space left on its filesystem \((\d+ B|[\d.]+ [KMGT]iB) free of [\d.]+ [KMGT]?i?B\)")


def _full_at_fsync(folder: str, monkeypatch) -> None:
    """Files under `folder` fail with ENOSPC when synced, as on a full disk whose blocks are only
    claimed at write-back. Megatron's checkpoint writers (forked processes) inherit this."""
    fsync = os.fsync

    def failing_fsync(fd: int) -> None:
        if os.readlink(f"/proc/self/fd/{fd}").startswith(folder):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        fsync(fd)

    monkeypatch.setattr(os, "fsync", failing_fsync)


METADATA = content_metadata(distributed_optimizer=False, fully_reshardable=False)


def _plain(iteration: int) -> dict:
    return {"iteration": iteration, "checkpoint_version": 3.0}


def test_a_checkpoint_save_on_a_full_disk_names_the_folder_and_keeps_the_last_one(one_rank_world, tmp_path, monkeypatch):
    model = build_model(SMALL, padded_vocab=128)
    ckpt.save_checkpoint(tmp_path, 1, model, None, _plain(1), METADATA)
    staging = tmp_path / f".{ckpt.iteration_dir(tmp_path, 2).name}.tmp"
    with monkeypatch.context() as patch:
        _full_at_fsync(str(staging), patch)
        with pytest.raises(ConfigError) as full:
            ckpt.save_checkpoint(tmp_path, 2, model, None, _plain(2), METADATA)
    message = str(full.value)
    assert "\n" not in message
    assert message.startswith(f"checkpoint.save: {staging}: ") and FREE.search(message), message
    assert message.endswith(f"; {ckpt.iteration_dir(tmp_path, 1)} stays the latest")
    assert ckpt.latest_iteration(tmp_path) == 1 and not ckpt.iteration_dir(tmp_path, 2).exists()
    assert ckpt.load_checkpoint(tmp_path, 1, build_model(SMALL, padded_vocab=128), None, load_rng=True)["iteration"] == 1


CAUSES = {
    # what a writer says, whether it is a full disk (the filesystem has room: by its words only)
    "errno": (OSError(errno.ENOSPC, "No space left on device"), True),
    "zip_writer": (RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"), True),
    "wrapped": (RuntimeError("Worker failure"), True),
    "permission": (PermissionError(errno.EACCES, "Permission denied"), False),
    "other": (RuntimeError("something else"), False),
}


@pytest.mark.parametrize("case", CAUSES)
def test_a_full_disk_is_known_by_its_errno_or_its_words(tmp_path, case):
    error, full = CAUSES[case]
    if case == "wrapped":  # megatron's writer process failure, the OS error as its cause
        error.__cause__ = OSError(errno.ENOSPC, "No space left on device")
    free = shutil.disk_usage(tmp_path).free
    if free < 64 * 2**20:
        pytest.skip(f"{tmp_path} is nearly full: every failure there counts as a full disk")
    reason = disk_full(error, tmp_path / "x")
    assert (reason is not None) == full
    if full:
        assert reason.startswith(f"{tmp_path / 'x'}: ") and FREE.search(reason)


def test_an_async_save_on_a_full_disk_names_the_folder_when_it_is_finalised(one_rank_world, tmp_path, monkeypatch):
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    model = build_model(SMALL, padded_vocab=128)
    ckpt.save_checkpoint(tmp_path, 1, model, None, _plain(1), METADATA)
    staging = tmp_path / f".{ckpt.iteration_dir(tmp_path, 2).name}.tmp"
    queue = AsyncCallsQueue()
    try:
        with monkeypatch.context() as patch:
            _full_at_fsync(str(staging), patch)  # the background writer is forked from here
            ckpt.save_checkpoint(tmp_path, 2, model, None, _plain(2), METADATA, async_queue=queue)
            with pytest.raises(ConfigError) as full:
                queue.maybe_finalize_async_calls(blocking=True)
    finally:
        queue.close()
    message = str(full.value)
    assert message.startswith(f"checkpoint.save: {staging}: ") and FREE.search(message), message
    assert message.endswith(f"; {ckpt.iteration_dir(tmp_path, 1)} stays the latest")
    assert ckpt.latest_iteration(tmp_path) == 1


# --- a real full disk (-m slow) ------------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path, clean):
    """A tmpfs that holds one checkpoint of the DP=2 layout but not two (needs root: skipped
    otherwise)."""
    checkpoint = ckpt.iteration_dir(clean("DP=2").root, 1)
    size = sum(f.stat().st_size for f in checkpoint.rglob("*") if f.is_file())
    mount = tmp_path / f"disk-{uuid.uuid4().hex[:6]}"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size * 3 // 2}", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.mark.slow  # two 2-worker launches, beside the one-process saves above
@pytest.mark.distributed
def test_a_save_that_fills_the_disk_is_one_line_and_keeps_the_last_checkpoint(small_disk, clean, cache, tmp_path):
    root, dp2 = small_disk / "ckpt", [*BASE, *LAYOUTS["DP=2"].overrides(), cache]
    job = Job([*dp2, f"checkpoint.save={root}", "checkpoint.interval=2", "train.exit_interval=4"])
    assert job.wait() == 2, job.output[-4000:]
    staging = ckpt.staging_dir(root, 4)
    assert re.fullmatch(
        rf"error: checkpoint\.save: {re.escape(str(staging))}: {FREE.pattern}; "
        rf"{re.escape(str(ckpt.iteration_dir(root, 2)))} stays the latest",
        job.errors[-1],
    ), job.output[-4000:]
    assert ckpt.latest_iteration(root) == 2 and staging_folders(root) == [staging.name]
    assert_bitwise(root, 2, clean("DP=2").root, tmp_path)
    resumed = Job([*dp2, f"checkpoint.load={root}", f"checkpoint.save={tmp_path / 'resumed'}", "train.exit_interval=1"])
    assert resumed.wait() == 0, resumed.output[-4000:]
    assert steps_logged(resumed.output) == [3]
    assert_bitwise(tmp_path / "resumed", 3, clean("DP=2").root, tmp_path)
