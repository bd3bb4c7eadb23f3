"""A save that dies half-way leaves the previous checkpoint loadable and nothing trusted.

The crash is injected into megatron's `dist_checkpointing.save` after it has written part of
the checkpoint, in a one-rank world inside this process; resuming then must continue from the
previous checkpoint exactly as a run that was never interrupted.
"""

from __future__ import annotations

import pytest

from megatron_ext.train import run_from_overrides
from megatron_ext.checkpointing import torch_dist as ckpt

pytestmark = pytest.mark.distributed

COMMON = [
    "experiment=none",
    "train.iters=6",
    "train.eval_interval=0",
    "logging.progress_bar=false",
    "model.seq_length=64",
    "train.micro_batch_size=2",
    "train.global_batch_size=4",
    "checkpoint.interval=3",
]


class InjectedCrash(RuntimeError):
    pass


def test_crash_during_save_keeps_previous_checkpoint(tmp_path, monkeypatch):
    cache, root = tmp_path / "cache", tmp_path / "ckpt"
    uninterrupted = run_from_overrides([*COMMON, f"data.cache_dir={cache}"])["losses"]

    real_save = ckpt.dist_checkpointing.save
    calls = []

    def save_then_crash(state, directory, *args, **kwargs):
        calls.append(directory)
        real_save(state, directory, *args, **kwargs)  # the files are on disk...
        if len(calls) == 2:
            raise InjectedCrash("killed before the checkpoint was published")  # ...unpublished

    monkeypatch.setattr(ckpt.dist_checkpointing, "save", save_then_crash)
    with pytest.raises(InjectedCrash):
        run_from_overrides([*COMMON, f"data.cache_dir={cache}", f"checkpoint.save={root}"])
    monkeypatch.setattr(ckpt.dist_checkpointing, "save", real_save)

    assert ckpt.latest_iteration(root) == 3
    assert not ckpt.iteration_dir(root, 6).exists()
    assert list(root.glob(".iter_*.tmp")), "the broken save's staging folder should be left over"

    resumed = run_from_overrides(
        [*COMMON, f"data.cache_dir={cache}", f"checkpoint.load={root}", f"checkpoint.save={root}"]
    )["losses"]
    assert resumed == uninterrupted[3:]
    assert ckpt.latest_iteration(root) == 6
    assert not list(root.glob(".iter_*.tmp")), "the next run of the directory cleans up the broken save"
