"""What a resume restores besides the weights, as Megatron-LM's --no-load-optim, --no-load-rng and
--finetune choose it (checkpoint.load_optim / load_rng / finetune). The reference is a resume
that loads everything from the same checkpoint (its weights, moments and counters) and a run
that loads nothing (its RNG streams)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_ext.config import compose_config
from megatron_ext.platform.launch import join_world
from megatron_ext.train import run_from_overrides
from megatron_ext.training.trainer import Trainer

ITERS = 3
COMMON = [
    "experiment=none",
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.ffn_hidden_size=128",
    "model.num_attention_heads=4",
    "model.num_query_groups=2",
    "model.seq_length=32",
    # Dropout draws from torch's generator while training, so the checkpoint's RNG state is not
    # the one a fresh seeding gives.
    "model.hidden_dropout=0.1",
    "train.micro_batch_size=2",
    "train.global_batch_size=2",
    "train.eval_interval=0",
    "logging.progress_bar=false",
    "launcher.nproc=1",
]


# name -> (precision, distributed optimizer)
LAYOUTS = {"fp32": ("fp32", True), "bf16_distributed": ("bf16", True), "bf16": ("bf16", False)}


@pytest.fixture(scope="module", params=LAYOUTS.values(), ids=LAYOUTS.keys())
def saved(request, tmp_path_factory) -> list[str]:
    """The overrides of a run that trained ITERS steps and saved; a resume adds its own."""
    precision, distributed = request.param
    tmp = tmp_path_factory.mktemp(precision)
    overrides = [
        *COMMON,
        f"model.precision={precision}",
        f"parallel.use_distributed_optimizer={distributed}",
        f"data.cache_dir={tmp / 'cache'}",
    ]
    run_from_overrides([*overrides, f"train.iters={ITERS}", f"checkpoint.save={tmp / 'ckpt'}"])
    return [*overrides, f"train.iters={2 * ITERS}", f"checkpoint.load={tmp / 'ckpt'}"]


def resumed(overrides: list[str]) -> dict:
    """Weights, main params, Adam moments, counters, lr-schedule steps and torch's RNG state of
    a trainer set up from `overrides` (before any step)."""
    join_world("cpu")
    trainer = Trainer(compose_config(overrides))
    try:
        trainer.setup()
        optimizers = getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer])
        moments = [s[k] for o in optimizers for s in o.optimizer.state.values() for k in ("exp_avg", "exp_avg_sq") if k in s]
        return {
            "weights": [p.detach().float().clone() for m in trainer.model for p in m.parameters()],
            "main_params": main_params(optimizers),
            "main_params_from_weights": main_params(optimizers, reload=True),
            "moments": [m.clone() for m in moments],
            "iteration": trainer.state.iteration,
            "consumed_samples": trainer.state.consumed_samples,
            "scheduler_steps": trainer.scheduler.num_steps,
            "rng": torch.get_rng_state(),
        }
    finally:
        trainer.close()
        dist.destroy_process_group()


def main_params(optimizers: list, reload: bool = False) -> list[torch.Tensor]:
    """The optimizer's (fp32) main params; `reload`: after megatron copies them anew from the
    model's weights."""
    if reload:
        for o in optimizers:
            o.reload_model_params()
    return [p.detach().clone() for o in optimizers for g in o.optimizer.param_groups for p in g["params"]]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_no_load_optim_keeps_the_weights_with_fresh_moments_and_schedule(saved):
    full, weights_only = resumed(saved), resumed([*saved, "checkpoint.load_optim=false"])
    assert full["moments"] and any(m.abs().sum() > 0 for m in full["moments"])  # the reference did load them
    assert same(weights_only["weights"], full["weights"])
    assert all(m.abs().sum() == 0 for m in weights_only["moments"])
    # bf16: the fp32 main params are copies of the loaded weights, not of the seed's.
    assert same(weights_only["main_params"], weights_only["main_params_from_weights"])
    assert (weights_only["iteration"], weights_only["consumed_samples"]) == (ITERS, full["consumed_samples"])
    assert (full["scheduler_steps"], weights_only["scheduler_steps"]) == (ITERS, 0)


def test_no_load_rng_keeps_this_runs_seeding(saved):
    fresh = resumed([o for o in saved if not o.startswith("checkpoint.load=")])
    full, no_rng = resumed(saved), resumed([*saved, "checkpoint.load_rng=false"])
    assert not torch.equal(full["rng"], fresh["rng"])  # the checkpoint's streams differ from a fresh seeding
    assert torch.equal(no_rng["rng"], fresh["rng"])
    assert same(no_rng["moments"], full["moments"])


def test_finetune_loads_only_the_weights(saved):
    full, finetune = resumed(saved), resumed([*saved, "checkpoint.finetune=true"])
    assert same(finetune["weights"], full["weights"])
    assert all(m.abs().sum() == 0 for m in finetune["moments"])
    assert (finetune["iteration"], finetune["consumed_samples"], finetune["scheduler_steps"]) == (0, 0, 0)
