"""The elastic plugin distils a hybrid Mamba2 / attention / MLP / MoE parent under pipeline
parallelism as one process does (its TP runs: `test_elastic_hybrid_tp.py`).

hybrid_tiny ("M*M-ME") splits into "M*M" (Mamba, attention) on the first stage and "-ME" (MLP,
Mamba, MoE) on the second: the stages hold different axis kinds, MambaStack numbers its Mamba
layers itself and its transformer layers through megatron's layer offset, and the MoE layer, the
final norm and the output layer live on the last stage. The grid allows one Mamba head count and
one expert count below the parent's, so every submodel cuts the Mamba heads of layers 0 and 2
(first stage) and 4 (second) and drops experts of layer 5: a stage that scored, permuted, cut or
costed an axis under a wrong layer number, or without the other stage's kinds, would train other
sizes or other losses than one process.
"""

from __future__ import annotations

import pytest
import torch

from test_elastic_plugin import assert_same_run, mixes_hidden_sizes, run

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

# The tiny hybrid parent's distillation run, shared with test_elastic_hybrid_tp.py.
HYBRID_RUN = [
    "experiment=none",
    "plugin=elastic",
    "logging.progress_bar=false",
    "model=hybrid_tiny",
    "model.seq_length=32",
    "train.global_batch_size=4",
    "train.eval_interval=0",
    "elastic.uniform_steps=2",
    "elastic.calibration_batches=2",
]
HYBRID = [
    *HYBRID_RUN,
    "train.iters=4",
    # The grid's largest submodel is 72% of the parent (4 of 8 Mamba heads, 2 of 4 experts).
    "elastic.budgets=[0.7,0.5,0.3]",
    "elastic.grid={hidden: [32,48,64], heads: [2,4], ffn: [64,128], mamba_heads: [4], mamba_head_dim: [8,16], "
    "moe_experts: [2], moe_ffn: [32,64]}",
]


@pytest.mark.parametrize(
    "draw, micro_batch",
    [("micro_batch", 1), ("sample", 2)],
    ids=["per-micro-batch", "per-sample-mixed-micro-batches"],
)
def test_hybrid_pipeline_distillation_equals_one_process(tmp_path, draw, micro_batch):
    """PP=2 (4 samples per step through megatron's 1F1B, 4 steps): the same calibration orders,
    budget draws, sizes, losses, router losses and choices as one process, and the same nested
    checkpoint (gathered from both stages). Per sample, two-sample micro-batches mix hidden
    sizes: the first stage sends its groups padded to the wider one's."""
    common = [f"train.micro_batch_size={micro_batch}", f"elastic.budget_draw={draw}"]
    one, one_weights = run(tmp_path, "one", *common, common=HYBRID)
    two, two_weights = run(tmp_path, "pp", *common, "launcher.nproc=2", "parallel.pp=2", common=HYBRID)
    # The stages compute what one process computes in the same order: equal to the bit
    # (measured), but for the router loss (`assert_same_run`: the costs are sums over stages).
    assert_same_run(one, two, 1e-12)
    assert len({s["hidden"] for h in one["history"] for s in h["sizes"]}) > 1, "one hidden size: a vacuous check"
    if micro_batch > 1:
        assert mixes_hidden_sizes(one["history"], micro_batch), "no micro-batch mixes hidden sizes: vacuous"
    assert one_weights.keys() == two_weights.keys()
    assert any(".mixer." in k for k in one_weights) and any(".local_experts.3." in k for k in one_weights)
    for key in one_weights:
        assert torch.equal(two_weights[key], one_weights[key]), key


def straight_and_resumed(tmp_path, at: int, *overrides: str, common: list[str] = HYBRID) -> tuple[tuple, tuple]:
    """The run that checkpoints at step `at` and goes on, and the run resumed from that
    checkpoint: (report, nested checkpoint) of each."""
    ckpt = tmp_path / "ckpt"
    straight = run(tmp_path, "straight", *overrides, f"checkpoint.save={ckpt}", f"checkpoint.interval={at}", common=common)
    resumed = run(tmp_path, "resumed", *overrides, f"checkpoint.load={ckpt}", f"checkpoint.step={at}", common=common)
    return straight, resumed


def assert_resumed_continues(straight: tuple, resumed: tuple, at: int) -> None:
    """The resumed run's steps are the straight run's after step `at`: the same budgets, sizes,
    router choices, losses and router losses (to the bit), and the same nested checkpoint."""
    (report, weights), (resumed_report, resumed_weights) = straight, resumed
    tail = [h for h in report["history"] if h["step"] > at]
    assert tail and [h["step"] for h in resumed_report["history"]] == [h["step"] for h in tail]
    for a, b in zip(tail, resumed_report["history"]):
        assert a["budgets"] == b["budgets"] and a["sizes"] == b["sizes"] and a["choices"] == b["choices"]
        assert a["loss"] == b["loss"] and a["router_loss"] == b["router_loss"]
    assert weights.keys() == resumed_weights.keys()
    for key in weights:
        assert torch.equal(resumed_weights[key], weights[key]), key


def test_resumed_pipeline_run_continues_the_uninterrupted_one(tmp_path):
    """PP=2, checkpointed at step 2 and resumed: each stage rebuilds its teacher from the stored
    calibration orders, which rank 0 writes and so must hold every stage's axes. The same
    budgets, sizes, losses and choices at steps 3-4 (measured equal to the bit), and the same
    nested checkpoint."""
    straight, resumed = straight_and_resumed(tmp_path, 2, "train.micro_batch_size=1", "launcher.nproc=2", "parallel.pp=2")
    assert [h["step"] for h in resumed[0]["history"]] == [3, 4]
    assert_resumed_continues(straight, resumed, 2)
