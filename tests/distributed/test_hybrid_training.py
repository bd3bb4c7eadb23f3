"""The hybrid Mamba2 / attention / MLP / MoE model trains with the Trainer, and tensor or
pipeline parallelism changes nothing but the order of reductions.

Reference: a single-rank run of the same config. Every layout starts from the same weights
(layout-independent init, which also draws the mixer's conv and state parameters per logical
tensor) and reads the same batches, so a TP=2 run whose mixer cut heads, groups, conv channels
or the gated norm wrongly would diverge from it, and so would a PP=2 run whose Mamba layers
were drawn or placed by the wrong layer index. The TP=2 checkpoint, resumed at TP=1, checks
that the mixer's split checkpoint layout (in_proj.weight.{z,x,B,C,dt}, conv1d.*.{x,B,C})
reassembles across TP sizes.
"""

from __future__ import annotations

import pytest

from megatron_ext.train import run_from_overrides

pytestmark = pytest.mark.distributed

ITERS = 6
# The TP comparisons without sequence parallelism use the tiny hybrid with its MoE layer made a
# dense MLP: megatron-core 0.16 trains MoE under TP only with sequence parallelism.
DENSE = ["model.hybrid_pattern=M*M-M-", "model.num_experts=null"]
SP = ["parallel.tp=2", "parallel.sequence_parallel=true"]
COMMON = [
    "experiment=none",
    "model=hybrid_tiny",
    f"train.iters={ITERS}",
    "train.eval_interval=0",
    "logging.progress_bar=false",
    "model.seq_length=64",
    "train.micro_batch_size=2",
    "train.global_batch_size=4",
    "optim.lr_warmup_iters=0",
]
LOSS_ATOL = 2e-4  # fp32 runs that differ only in the order of reductions
# Tighter under sequence parallelism: leaving the norms' weight gradients un-reduced over TP moves
# the losses by about 1e-4, which Adam's scale invariance would hide at LOSS_ATOL.
SP_LOSS_ATOL = 1e-5


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("data_cache"))


def train(data_cache: str, *overrides: str, nproc: int = 1) -> list[float]:
    summary = run_from_overrides([*COMMON, f"data.cache_dir={data_cache}", f"launcher.nproc={nproc}", *overrides])
    return summary["losses"]


@pytest.fixture(scope="module")
def single_rank(data_cache) -> list[float]:
    return train(data_cache, *DENSE)


@pytest.fixture(scope="module")
def moe_single_rank(data_cache) -> list[float]:
    return train(data_cache)


def test_hybrid_moe_trains(moe_single_rank):
    assert len(moe_single_rank) == ITERS and moe_single_rank[-1] < moe_single_rank[0] - 0.5, moe_single_rank


def test_hybrid_moe_tp2_with_sequence_parallelism_matches_single_rank(moe_single_rank, data_cache):
    # Mamba, attention, MLP and MoE layers with the sequence split over the TP ranks between them.
    assert train(data_cache, *SP, nproc=2) == pytest.approx(moe_single_rank, abs=SP_LOSS_ATOL)


# name -> (overrides, workers)
LAYOUTS = {"tp2": (["parallel.tp=2"], 2), "pp2": (["parallel.pp=2"], 2)}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_rank(name, single_rank, data_cache):
    overrides, nproc = LAYOUTS[name]
    assert train(data_cache, *DENSE, *overrides, nproc=nproc) == pytest.approx(single_rank, abs=LOSS_ATOL)


@pytest.mark.slow
def test_tp2_checkpoint_resumes_at_tp1(single_rank, data_cache, tmp_path):
    save = [f"checkpoint.save={tmp_path}", f"checkpoint.interval={ITERS // 2}"]
    train(data_cache, *DENSE, "parallel.tp=2", *save, nproc=2)
    resumed = train(data_cache, *DENSE, f"checkpoint.load={tmp_path}", f"checkpoint.step={ITERS // 2}")
    assert resumed == pytest.approx(single_rank[ITERS // 2 :], abs=LOSS_ATOL)
