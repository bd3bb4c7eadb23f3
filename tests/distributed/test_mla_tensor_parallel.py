"""Multi-latent attention on local layers trains under tensor parallelism as on one rank.

MLA's down-projection of keys and values is split over the TP ranks (a ColumnParallelLinear)
and gathered: its output holds the compressed keys/values and one rotary key shared by every
head. Each TP rank's heads use that shared key, so its gradient is the sum over all ranks'
heads (megatron_ext/platform/mla_rotary_key_grad.py); the latent query norm's gradient is
complete on every rank and must not be summed over them (platform/mla_latent_norm_grads.py).
A tiny MLA model (latent norms on) trains a few SGD steps on one rank (the reference) and at
TP=2, TP=2 with sequence parallelism and TP=2 x PP=2, from the same layout-independent initial
weights on the same batches: the first step's gradients of every parameter, the losses of
every step and the trained weights, put together whole from the ranks' shards, must equal the
reference's up to fp32 reduction order.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import _tiny_sgd as tiny_sgd
from _logical_shards import grad_shards, weight_shards, whole
from _tiny_sgd import STEPS

# fp32 runs that differ only in the order of reductions (TP splits the GEMMs, PP the loss sum).
LOSS_RTOL = 1e-5
GRAD_ATOL = 1e-6
WEIGHT_ATOL = 2e-6

MLA = dict(
    multi_latent_attention=True,
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_head_dim=16,
    qk_pos_emb_head_dim=8,
    v_head_dim=16,
    qk_layernorm=True,
)
# world size -> its layouts (ParallelConfig fields)
WORLDS = {
    1: {"reference": {}},
    2: {"tp2": dict(tp=2), "tp2_sp": dict(tp=2, sequence_parallel=True)},
    4: {"tp2_pp2": dict(tp=2, pp=2)},
}


# --- the worker: every layout of one world, one after another -------------------------------


def config(parallel: dict, cache: str):
    return tiny_sgd.config("mla", MLA, parallel, cache)


def run(parallel: dict, cache: str) -> dict:
    import torch.distributed as dist

    from megatron_ext.config.validate import validate
    from megatron_ext.training.trainer import Trainer

    cfg = config(parallel, cache)
    validate(cfg, dist.get_world_size(), "cpu")
    trainer = Trainer(cfg)
    trainer.setup()
    losses = [trainer.train_step_with_loss()["loss"]]
    grads = grad_shards(trainer.model)
    losses += [trainer.train_step_with_loss()["loss"] for _ in range(STEPS - 1)]
    report = {"losses": losses, "grads": grads, "weights": weight_shards(trainer.model)}
    trainer.close()
    return report


def worker(out_dir: str) -> None:
    import torch.distributed as dist

    from megatron_ext.platform.launch import join_world

    join_world("cpu")
    cache = str(Path(out_dir, "cache"))
    world = dist.get_world_size()
    report = {layout: run(parallel, cache) for layout, parallel in WORLDS[world].items()}
    torch.save(report, Path(out_dir, f"world{world}_rank{dist.get_rank()}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    worker(sys.argv[1])


# --- the tests -----------------------------------------------------------------------------------

pytestmark = pytest.mark.distributed


def launch(out: Path, world: int) -> Path:
    from _torchrun import torchrun

    torchrun(__file__, world, str(out))
    return out


def reports(out: Path, world: int, layout: str) -> list[dict]:
    return [torch.load(out / f"world{world}_rank{r}.pt")[layout] for r in range(world)]


def differences(found: dict, expected: dict, atol: float) -> dict:
    assert found.keys() == expected.keys()
    return {
        k: (found[k] - expected[k]).abs().max().item()
        for k in expected
        if not torch.allclose(found[k], expected[k], atol=atol, rtol=0)
    }


def check(reference: dict, ranks: list[dict], layout: str) -> None:
    assert len(set(reference["losses"])) == STEPS, "the reference did not train"
    assert ranks[0]["losses"] == pytest.approx(reference["losses"], rel=LOSS_RTOL), f"{layout}: losses"
    for what, atol in (("grads", GRAD_ATOL), ("weights", WEIGHT_ATOL)):
        expected = whole([reference[what]], f"reference {what}")
        found = whole([rank[what] for rank in ranks], f"{layout} {what}")
        differ = differences(found, expected, atol)
        assert not differ, f"{layout}: {what} differ {differ}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    out = launch(tmp_path_factory.mktemp("mla_reference"), 1)
    return reports(out, 1, "reference")[0]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> Path:
    return launch(tmp_path_factory.mktemp("mla_two_ranks"), 2)


@pytest.mark.parametrize("layout", list(WORLDS[2]))
def test_mla_at_tp2_equals_one_rank(reference, two_ranks, layout):
    check(reference, reports(two_ranks, 2, layout), layout)


def test_mla_at_tp2_pp2_equals_one_rank(reference, tmp_path):
    check(reference, reports(launch(tmp_path, 4), 4, "tp2_pp2"), "tp2_pp2")
