"""TensorBoard event files carry the same per-step losses as the run summary."""

from __future__ import annotations

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from megatron_ext.train import run_from_overrides

pytestmark = pytest.mark.distributed


def test_tensorboard_scalars(tmp_path):
    tb = tmp_path / "tb"
    summary = run_from_overrides(
        [
            "experiment=none",
            "train.iters=3",
            "train.eval_interval=3",
            "train.eval_iters=1",
            "model.seq_length=32",
            "train.micro_batch_size=2",
            "train.global_batch_size=2",
            f"data.cache_dir={tmp_path / 'cache'}",
            f"logging.tensorboard_dir={tb}",
        ]
    )
    events = EventAccumulator(str(tb))
    events.Reload()
    train_loss = [e.value for e in events.Scalars("train/loss")]
    assert train_loss == pytest.approx(summary["losses"], rel=1e-6)
    assert [e.step for e in events.Scalars("eval/loss")] == [3]
    assert {"train/lr", "train/grad_norm", "train/tokens_per_s"} <= set(events.Tags()["scalars"])
