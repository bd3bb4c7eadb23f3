"""The elastic plugin distils the MoE hybrid under expert parallelism as one process does.

Under EP the ranks of an EP group are data-parallel replicas whose experts run each other's
tokens, so they draw together: `elastic.budget_share=2` keys the budget and router draws by
windows of two consecutive global micro-batches, which hold the two EP peers' concurrent
micro-batches (`expert_parallel.py`). The reference is one process with the same budget_share,
which runs a window's micro-batches one after the other through all four experts.

hybrid_tiny ("M*M-ME": 4 experts of FFN width 64, top-2; under EP=2 two per rank). The grid cuts
the experts to 3 or 2 (EP rank 1 keeps one or none of its own: its dispatcher routes it fewer
tokens or none) and the expert FFN width to 48, and the hidden size to 48. Layouts:
  * ep2: EP=2 (2 ranks), budget_draw=sample, two-sample micro-batches that mix budgets of two
    hidden sizes: both peers run the same budget groups in the same order, one dispatcher
    exchange per group.
  * tp2_ep2: TP=2 with sequence parallelism x EP=2 (4 ranks), budget_draw=micro_batch, two
    micro-batches per replica.
  * pp2_ep2: PP=2 x EP=2 (4 ranks; the MoE layer on the second stage), budget_draw=micro_batch.
  * dp4_ep2: DP=4 over two EP groups of 2 (4 ranks), budget_draw=micro_batch: each window holds
    one EP group's two replicas; the two groups draw apart, as one process does.
Four steps: the same budgets per sample, sizes, router choices and router losses, KD losses
within REL; at learning rate 0 the nested checkpoint (the reordered parent, experts joined from
the EP ranks under their global indices) equal to the bit.

Tolerance: the Trainer runs fp32 (no fp64), and the layouts sum in other orders (the experts'
gradients gathered over the peers' tokens, DP averaging, TP's row-parallel and vocabulary sums).
KD losses measured up to 7.6e-7 (ep2), 5.1e-5 (tp2_ep2), 3.6e-6 (pp2_ep2) and 1.7e-6 (dp4_ep2)
relative apart; the trained weights are not compared (Adam's steps on near-zero gradients differ
by up to 1e-2 of a tensor's largest entry under TP, measured). With the draw unshared in the Distiller (each
micro-batch keyed by itself, as before budget_share) the three EP runs abort; with the hidden
size held at 64 an unshared EP=2 run completes, its KD losses 2e-3 to 0.15 relative off the
reference's (both measured).

Resume: the EP=2 run checkpointed at step 2 and resumed continues the uninterrupted one (budgets,
sizes, router choices, losses and the trained nested checkpoint equal to the bit, measured).
"""

from __future__ import annotations

import pytest
import torch

from test_elastic_hybrid_pp import assert_resumed_continues, straight_and_resumed
from test_elastic_hybrid_tp import HYBRID, MOE
from test_elastic_plugin import assert_same_run, mixes_hidden_sizes, run

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

# The cost-only router start: the quality start's candidates of one budget can score within the
# layouts' rounding of each other (tp2_ep2 picked 3 experts of width 64 where one process picked
# 4 of width 48), and these runs check the distillation's layout equality, not the start.
SHARED = [*MOE, "elastic.budget_share=2", "elastic.router_start=cost"]
DRAWS = {
    "sample": ["elastic.budget_draw=sample", "train.micro_batch_size=2"],
    "micro_batch": ["elastic.budget_draw=micro_batch", "train.micro_batch_size=1"],
    # DP=4 calibrates on at least one micro-batch per replica; the reference on the same four.
    "micro_batch_4_calibration": [
        "elastic.budget_draw=micro_batch",
        "train.micro_batch_size=1",
        "elastic.calibration_batches=4",
    ],
}
EP2 = ["parallel.ep=2"]
# layout: (draw, overrides, REL)
LAYOUTS = {
    "ep2": ("sample", ["launcher.nproc=2", *EP2], 1e-5),
    "tp2_ep2": ("micro_batch", ["launcher.nproc=4", *EP2, "parallel.tp=2", "parallel.sequence_parallel=true"], 2e-4),
    "pp2_ep2": ("micro_batch", ["launcher.nproc=4", *EP2, "parallel.pp=2"], 2e-5),
    # DP=4 over two EP groups: the windows pair each group's two replicas, not all four.
    "dp4_ep2": ("micro_batch_4_calibration", ["launcher.nproc=4", *EP2], 2e-5),
}
FROZEN = ["optim.lr=0.0", "optim.min_lr=0.0", "train.iters=1"]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """Per draw, one process's four steps (report) and, at learning rate 0, its nested checkpoint."""
    cache: dict[str, tuple[dict, dict]] = {}

    def get(draw: str) -> tuple[dict, dict]:
        if draw not in cache:
            tmp = tmp_path_factory.mktemp(f"one_{draw}")
            report, _ = run(tmp, "one", "train.iters=4", *SHARED, *DRAWS[draw], common=HYBRID)
            _, frozen = run(tmp, "frozen", *FROZEN, *SHARED, *DRAWS[draw], common=HYBRID)
            cache[draw] = report, frozen
        return cache[draw]

    return get


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_expert_parallel_distillation_equals_one_process(one_process, tmp_path, layout):
    draw, overrides, rel = LAYOUTS[layout]
    one, one_frozen = one_process(draw)
    common = [*SHARED, *DRAWS[draw], *overrides]
    got, _ = run(tmp_path, layout, "train.iters=4", *common, common=HYBRID)
    assert_same_run(one, got, rel)
    trained = [s for h in one["history"] for s in h["sizes"]]
    assert any(s["moe_experts"] < 4 for s in trained) and any(s["moe_ffn"] < 64 for s in trained), "no MoE cut: vacuous"
    if draw == "sample":
        assert mixes_hidden_sizes(one["history"], 2), "no micro-batch mixes hidden sizes: vacuous"
    _, frozen = run(tmp_path, "frozen", *FROZEN, *common, common=HYBRID)
    assert frozen.keys() == one_frozen.keys() and any(".local_experts.3." in k for k in frozen)
    for key in one_frozen:
        assert torch.equal(frozen[key], one_frozen[key]), key


def test_resumed_expert_parallel_run_continues_the_uninterrupted_one(tmp_path):
    """EP=2 (per sample, two-sample micro-batches), checkpointed at step 2 and resumed: each EP
    rank reloads its own experts (and their optimizer state) and both rebuild the teacher from
    the stored orders. Steps 3-4 draw the same budgets, train the same sizes (experts and expert
    FFN cut) with the same losses and router choices as the run that never stopped, and the
    nested checkpoint (experts joined from both EP ranks) is the same, all to the bit (measured)."""
    draw, overrides, _ = LAYOUTS["ep2"]
    straight, resumed = straight_and_resumed(tmp_path, 2, "train.iters=4", *SHARED, *DRAWS[draw], *overrides, common=HYBRID)
    assert [h["step"] for h in resumed[0]["history"]] == [3, 4]
    trained = [s for h in resumed[0]["history"] for s in h["sizes"]]
    assert any(s["moe_experts"] < 4 for s in trained) and any(s["moe_ffn"] < 64 for s in trained), "no MoE cut: vacuous"
    assert any(".local_experts.3." in k for k in resumed[1]), "no expert of EP rank 1 in the checkpoint: vacuous"
    assert_resumed_continues(straight, resumed, 2)
