"""The elastic plugin distils a hybrid Mamba2 / attention / MLP parent at TP=2 as one process does,
and the MoE hybrid at TP=2 with sequence parallelism.

The dense hybrid ("M*M-M-": megatron-core 0.16 trains MoE under TP only with sequence
parallelism, which the hybrid's torch norms lack) has 8 Mamba heads of 16 channels in 2 groups:
at TP=2 each rank holds one group of 4 heads. The grid cuts Mamba heads (2 or 3 per group) and
head channels, so a rank that scored, permuted or cut its heads as the global ones, or a channel
score that is not the norm over both ranks' heads, trains other sizes or losses than one process;
a nested checkpoint whose in_proj or conv rows were joined rank by rank instead of part by part
([z | x | B | C | dt] of each rank) is off by whole weights.

Tolerance: fp32 runs that differ in summation order (row-parallel outputs and the vocabulary's
partition sum all-reduced in two halves; the head-channel scores' squares summed over the ranks
before the root). The KD losses (about 0.01, differences of log-probabilities) measured up to
5.3e-6 relative apart, the router losses 8e-11; without the head-channel scores' reduction over
the ranks the first loss is 5e-2 relative off, and an in_proj joined rank by rank fails the
checkpoint's comparison (both measured). Budgets, sizes and router choices are compared exactly,
and at learning rate 0 the nested checkpoint to the bit (it holds the reordered parent: the
importance orders).
"""

from __future__ import annotations

import pytest
import torch

from test_elastic_hybrid_pp import HYBRID_RUN
from test_elastic_plugin import assert_same_run, run

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

HYBRID = [
    *HYBRID_RUN,
    "train.micro_batch_size=1",
    "elastic.budget_draw=sample",
    "elastic.budgets=[0.8,0.6,0.4]",
]
# Both grids start the router by cost alone: these runs check the distillation's layout
# equality on sizes that cut every axis, not the start (the quality start keeps every Mamba head
# channel of the dense grid, and scores the MoE grid's best candidates within the layouts'
# rounding of each other; tests/unit/test_elastic_router_start.py checks it).
DENSE = [
    "model.hybrid_pattern=M*M-M-",
    "model.num_experts=null",
    "elastic.grid={hidden: [32,48,64], heads: [2,4], ffn: [64,128], mamba_heads: [4,6,8], mamba_head_dim: [8,16]}",
    "elastic.router_start=cost",
]
TP2 = ["launcher.nproc=2", "parallel.tp=2"]
REL = 2e-5


def test_hybrid_tp2_distillation_equals_one_process(tmp_path):
    """Four steps: the same budgets per sample, sizes, router choices and losses."""
    one, _ = run(tmp_path, "one", "train.iters=4", *DENSE, common=HYBRID)
    two, _ = run(tmp_path, "tp", "train.iters=4", *DENSE, *TP2, common=HYBRID)
    assert_same_run(one, two, REL)
    trained = [s for h in one["history"] for s in h["sizes"]]
    assert any(s["mamba_heads"] < 8 for s in trained), "no Mamba heads cut: vacuous"
    assert any(s["mamba_head_dim"] < 16 for s in trained), "no head channels cut: vacuous"


def test_hybrid_tp2_export_equals_one_process(tmp_path):
    """At learning rate 0 the student stays the reordered parent: the same importance orders and
    a right gather give the one-process nested checkpoint to the bit."""
    common = ["optim.lr=0.0", "optim.min_lr=0.0", "train.iters=2", *DENSE]
    _, one = run(tmp_path, "one", *common, common=HYBRID)
    _, two = run(tmp_path, "tp", *common, *TP2, common=HYBRID)
    assert one.keys() == two.keys()
    assert any(k.endswith("mixer.in_proj.weight") for k in one)
    for key in one:
        assert torch.equal(two[key], one[key]), key


# The MoE hybrid: megatron-core 0.16 runs MoE under TP with sequence parallelism only. The router
# picks 3 or 2 experts of 4 and an expert FFN width of 48 of 64 (the second TP rank keeps half of
# its 32 neurons).
MOE = [
    "elastic.grid={hidden: [48,64], heads: [4], ffn: [128], mamba_heads: [8], mamba_head_dim: [16], "
    "moe_experts: [2,3,4], moe_ffn: [16,48,64]}",
    "elastic.budgets=[0.95,0.85,0.75]",
    "elastic.router_start=cost",
]
MOE_LAYOUTS = {"tp2_sp": [*TP2, "parallel.sequence_parallel=true"]}
# The experts' partial outputs are reduce-scattered over TP too: the KD losses measured up to
# 7.5e-5 relative apart (fp32).
MOE_REL = 2e-4


FROZEN = ["optim.lr=0.0", "optim.min_lr=0.0", "train.iters=2"]


@pytest.fixture(scope="module")
def moe_one_process(tmp_path_factory) -> tuple[dict, dict]:
    """One process's four steps (report) and, at learning rate 0, its nested checkpoint."""
    tmp = tmp_path_factory.mktemp("moe_one")
    report, _ = run(tmp, "one", "train.iters=4", *MOE, common=HYBRID)
    _, frozen = run(tmp, "frozen", *FROZEN, *MOE, common=HYBRID)
    return report, frozen


@pytest.mark.parametrize("layout", list(MOE_LAYOUTS))
def test_hybrid_moe_distillation_and_export_equal_one_process(moe_one_process, tmp_path, layout):
    """Four steps of the MoE hybrid: the same budgets, sizes, router choices and losses as one
    process, with experts and expert FFN width cut; at learning rate 0 the same nested checkpoint
    to the bit."""
    one, one_frozen = moe_one_process
    two, _ = run(tmp_path, layout, "train.iters=4", *MOE, *MOE_LAYOUTS[layout], common=HYBRID)
    assert_same_run(one, two, MOE_REL)
    trained = [s for h in one["history"] for s in h["sizes"]]
    assert any(s["moe_experts"] < 4 for s in trained) and any(s["moe_ffn"] < 64 for s in trained), "no MoE cut: vacuous"
    _, two_frozen = run(tmp_path, "frozen", *FROZEN, *MOE, *MOE_LAYOUTS[layout], common=HYBRID)
    assert one_frozen.keys() == two_frozen.keys() and any(".local_experts.3." in k for k in one_frozen)
    for key in one_frozen:
        assert torch.equal(two_frozen[key], one_frozen[key]), key
