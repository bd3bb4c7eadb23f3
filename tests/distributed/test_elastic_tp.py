"""Elastic distillation at TP=2 (two gloo ranks) is the TP=1 run: the same importance orders, the
same budgets and router choices, the same losses, and the same logits of every submodel after
training, also at FFN widths that leave one TP rank with a part of its block or none of it. The
micro-batches hold two samples each, which draw their budgets apart (some micro-batches mix two).

Tolerance: the model is fp64 and the two runs differ only in summation order (row-parallel
outputs and the vocabulary's partition sum are all-reduced in two halves): logits measured
1e-14 relative apart. The router is fp32 (its parameters after three Adam steps measured 3e-7
relative apart), and megatron's loss reduction is fp32. A wrong shard, a missing reduction or a
gradient counted twice is off by 1e-2 relative or more (measured, before the fixes they check).

This file is also the worker script torchrun starts.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.unit.test_elastic_router import batch  # noqa: E402
from tests.unit.test_elastic_slicing import POSITIONS, TOKENS, build_parent  # noqa: E402

GRID = {"hidden": [32, 48, 64], "heads": [2, 4], "ffn": [32, 48, 64, 80, 96, 112, 128]}
BUDGETS = [1.0, 0.75, 0.5]
# Fixed sizes checked besides the router's: FFN 80 leaves rank 1 16 of its 64 neurons, 48 none.
PROBES = [{"hidden": 48, "heads": 2, "ffn": 80}, {"hidden": 32, "heads": 4, "ffn": 48}]
REL_MODEL = 1e-10  # fp64 model
REL = 1e-5  # fp32 router and loss sums


def distil() -> dict:
    """Calibrate, reorder, warm the router up and distil three steps (with CE) in the current
    megatron world; the orders, losses, router and full-vocabulary logits of every probe."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from megatron_ext.elastic.distill import CurriculumConfig, Distiller, train_plain
    from megatron_ext.elastic.importance import calibrate
    from megatron_ext.elastic.permute import reorder
    from megatron_ext.elastic.router import BudgetRouter, RouterConfig
    from megatron_ext.elastic.space import ElasticSpace

    student, teacher = build_parent().double(), build_parent().double()
    space = ElasticSpace(student)
    calibrate(space.axes, [TOKENS], lambda t: student(t, POSITIONS, None))
    orders = reorder(space.axes)
    for axis in ElasticSpace(teacher).axes:
        axis.permute(torch.tensor(orders[axis.name]))
    teacher.eval().requires_grad_(False)
    router = BudgetRouter(BUDGETS, GRID, RouterConfig(anneal_steps=20))
    curriculum = CurriculumConfig(budgets=BUDGETS, uniform_steps=2, ce_weight=0.5, budget_draw="sample")
    distiller = Distiller(space, teacher, router, curriculum, vocab=100)
    distiller.warm_up_router(40)
    drawn = []
    batches = lambda step: [batch(4 * step + i) for i in range(4)]  # noqa: E731
    record = lambda step, loss: drawn.append(list(distiller.drawn))  # noqa: E731
    losses = train_plain(distiller, student, batches, steps=3, lr=3e-3, on_step=record)
    grads = {n: p.grad.clone() for n, p in router.named_parameters()}
    logits = {}
    with torch.no_grad():
        for i, sizes in enumerate(PROBES + [router.select(b) for b in range(3)]):
            with space.at(sizes):
                logits[i] = gather_from_tensor_model_parallel_region(student(TOKENS, POSITIONS, None))
    return {
        "orders": orders,
        "losses": losses,
        "drawn": drawn,
        "selected": [router.select(b) for b in range(3)],
        "router": {k: v.clone() for k, v in router.state_dict().items()},
        "router_grads": grads,
        "logits": logits,
    }


def worker(out: str) -> None:
    import torch.distributed as dist

    from megatron_ext.models.convert.world import model_parallel_world

    with model_parallel_world(tp=2):
        result = distil()
        if dist.get_rank() == 0:
            torch.save(result, Path(out) / "tp2.pt")


if __name__ == "__main__":
    worker(*sys.argv[1:])


@pytest.mark.slow  # two torchrun workers importing megatron on the shared cores
@pytest.mark.distributed
def test_tp2_distillation_equals_tp1(one_rank_world, tmp_path):
    sys.path.insert(0, str(Path(__file__).parent))
    from _torchrun import torchrun

    torchrun(__file__, 2, str(tmp_path), timeout=300)
    tp2 = torch.load(tmp_path / "tp2.pt")
    tp1 = distil()
    assert tp2["orders"] == tp1["orders"]
    assert any(o != sorted(o) for o in tp1["orders"].values()), "nothing reordered: vacuous"
    assert tp2["drawn"] == tp1["drawn"]
    assert any(len(set(micro)) > 1 for step in tp1["drawn"] for micro in step), "no micro-batch mixes budgets"
    assert tp2["selected"] == tp1["selected"]
    assert tp2["losses"] == pytest.approx(tp1["losses"], rel=REL)
    for key in "router_grads", "router":  # relative to the largest entry of any tensor
        scale = max(float(v.abs().max()) for v in tp1[key].values())
        for name, v in tp1[key].items():
            assert float((tp2[key][name] - v).abs().max()) <= REL * scale, (key, name)
    for i, want in tp1["logits"].items():
        assert float((tp2["logits"][i] - want).abs().max()) <= REL_MODEL * float(want.abs().max()), i
