"""Where the elastic plugin's router starts (`elastic.router_start`), in a one-rank Trainer: with
"quality" each budget selects, before the first step, the grid submodel of least KD loss to the
parent on the run's calibration batches, found here by brute force over the standalone exported
submodels scored with torch's own softmax; with "cost" the router knows only the budgets' costs
and starts elsewhere, at submodels that lose more."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.utils import unwrap_model

from megatron_ext.config import compose_config
from megatron_ext.elastic.size_search import candidates
from megatron_ext.elastic.slicing import export_submodel
from megatron_ext.platform.launch import join_world
from megatron_ext.plugin import build_plugins
from megatron_ext.training.trainer import Trainer

GRID = "{hidden: [32,48,64], heads: [2,4], ffn: [32,64,96,128]}"
BUDGETS = [1.0, 0.75, 0.5]
TOLERANCE = 0.1


def overrides(tmp_path, start: str) -> list[str]:
    return [
        "experiment=none", "plugin=elastic", "logging.progress_bar=false", "model.num_layers=2",
        "model.hidden_size=64", "model.ffn_hidden_size=128", "model.num_attention_heads=4",
        "model.num_query_groups=2", "model.seq_length=32", "train.micro_batch_size=1",
        "train.global_batch_size=2", "train.iters=1", "train.eval_interval=0",
        f"data.cache_dir={tmp_path / 'cache'}", "elastic.calibration_batches=2", f"elastic.grid={GRID}",
        f"elastic.budgets={BUDGETS}", f"elastic.tolerance={TOLERANCE}", f"elastic.router_start={start}",
    ]


def reference_kd(trainer: Trainer, plugin, sizes: dict[str, int]) -> float:
    """Mean KL(parent || submodel) per loss token on the calibration batches, the submodel
    exported standalone from the student (still the reordered parent before the first step)."""
    student = unwrap_model(trainer.model[0])
    sub, _ = export_submodel(student, trainer.cfg.model, plugin.space, sizes, trainer.vocab_size)
    vocab = plugin.distiller.vocab
    total = count = 0.0
    with torch.no_grad():
        for (batch,) in plugin._calibration_rounds(trainer.plugin_context(plugin)):
            args = (batch["tokens"], batch["position_ids"], None)
            log_p = F.log_softmax(plugin.distiller.teacher(*args)[..., :vocab].double(), -1)
            log_q = F.log_softmax(sub.eval()(*args)[..., :vocab].double(), -1)
            per_token = (log_p.exp() * (log_p - log_q)).sum(-1)
            total += float((per_token * batch["loss_mask"]).sum())
            count += float(batch["loss_mask"].sum())
    return total / count


def started(tmp_path, start: str) -> tuple[list[dict], list[dict[str, float]]]:
    """The router's sizes per budget before the first step, and every candidate's reference KD
    loss per budget."""
    join_world("cpu")
    cfg = compose_config(overrides(tmp_path, start))
    trainer = Trainer(cfg, build_plugins(cfg.plugins, cfg))
    try:
        trainer.setup()
        (plugin,) = trainer.plugins
        plugin.on_step_begin(trainer.plugin_context(plugin), 1)  # calibrates, reorders, builds the teacher, starts the router
        chosen = [plugin.router.select(b) for b in range(len(BUDGETS))]
        losses = [
            {str(s): reference_kd(trainer, plugin, s) for s in candidates(plugin.space, plugin.grid, b, TOLERANCE)}
            for b in BUDGETS
        ]
        return chosen, losses
    finally:
        trainer.close()
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[list[dict], list[dict[str, float]]]]:
    tmp = tmp_path_factory.mktemp("router_start")
    return {start: started(tmp, start) for start in ("quality", "cost")}


def test_quality_start_selects_each_budgets_least_kd_submodel(runs):
    chosen, losses = runs["quality"]
    for sizes, by_candidate in zip(chosen, losses):
        assert by_candidate[str(sizes)] == pytest.approx(min(by_candidate.values()), rel=1e-6), by_candidate
    # Not vacuous: some budget has candidates of clearly different loss.
    assert any(max(c.values()) > 1.5 * min(c.values()) for c in losses[1:])


def test_cost_start_loses_more_than_quality_start(runs):
    quality, losses = runs["quality"]
    cost, _ = runs["cost"]
    kd = [(c[str(q)], c[str(s)]) for q, s, c in zip(quality, cost, losses)]
    assert all(q <= s for q, s in kd), kd
    assert any(q < s for q, s in kd), f"the cost-only router started at the same sizes: {kd}"
