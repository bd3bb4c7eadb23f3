"""The layout controller on a one-rank tiny run: a layout prepared beside the running one is what
`install` enters (its model and optimizer, megatron's groups made current), a layout installed
without one is built then, the scheduler and counters carry over, `rollback` enters the last
committed layout again (built anew), `release` leaves the layout, and a prepared layout that is
discarded frees its model. The multi-rank moves that drive it are tests/distributed/test_reshard_*."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_ext.config import compose_config
from megatron_ext.platform.device import current_device
from megatron_ext.platform.launch import join_world
from megatron_ext.training.layout_controller import PreparedLayout
from megatron_ext.training.trainer import Trainer

TINY = [
    "experiment=none", "model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=128",
    "model.num_attention_heads=4", "model.num_query_groups=2", "model.seq_length=32",
    "train.micro_batch_size=1", "train.global_batch_size=1", "train.iters=4", "train.eval_interval=0",
    "logging.progress_bar=false", "launcher.nproc=1", "data.mock=true",
]


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    """A set-up trainer that stepped once."""
    join_world("cpu")
    trainer = Trainer(compose_config([*TINY, f"data.cache_dir={tmp_path_factory.mktemp('ctl') / 'cache'}"]))
    try:
        trainer.setup()
        trainer.train_step()
        yield trainer
    finally:
        trainer.close()
        dist.destroy_process_group()


def test_install_enters_the_prepared_layout_and_carries_the_run(trainer):
    controller, layout = trainer.layout_controller, trainer.layout
    prepared = controller.prepare(trainer.cfg.parallel, current_device())
    assert isinstance(prepared, PreparedLayout) and prepared.layout == layout and not prepared.installed
    iteration, steps = trainer.state.iteration, trainer.scheduler.num_steps
    controller.install(prepared)
    assert prepared.installed and trainer.layout == layout
    assert trainer.model is prepared.model and trainer.optimizer is prepared.optimizer
    assert parallel_state.model_parallel_is_initialized()
    assert trainer.state.iteration == iteration
    assert trainer.scheduler.num_steps == steps > 0
    controller.commit()


def test_rollback_enters_the_committed_layout_again_built_anew(trainer):
    controller, layout, model = trainer.layout_controller, trainer.layout, trainer.model
    controller.install(layout)  # built now
    assert trainer.model is not model
    controller.release()
    assert trainer.layout is None and not parallel_state.model_parallel_is_initialized()
    controller.rollback()
    assert trainer.layout == layout and trainer.model is not model


def test_a_discarded_layout_frees_what_it_built(trainer):
    prepared = trainer.layout_controller.prepare(trainer.cfg.parallel, current_device())
    prepared.discard()
    assert prepared.model is None and prepared.optimizer is None
    assert trainer.layout_controller.can_prepare_ahead  # no plugin rewrites the model
