"""The router's distillation gradient is that of the mean KD loss over the loss tokens only: the
plugin's path (megatron's backward of each micro-batch's masked loss sum, then
`Distiller.average_router_grads`) against a brute-force loop over the unmasked tokens, each one's
KL computed on its own with torch's `kl_div`."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core import parallel_state

from megatron_ext.elastic.distill import CurriculumConfig, Distiller
from megatron_ext.elastic.router import BudgetRouter, RouterConfig, apply_choice
from megatron_ext.elastic.space import ElasticSpace
from tests.unit.test_elastic_router import BUDGETS, GRID, batch
from tests.unit.test_elastic_slicing import build_parent, world  # noqa: F401

VOCAB = 100


def distiller(space: ElasticSpace, teacher) -> Distiller:
    router = BudgetRouter(BUDGETS, GRID, RouterConfig(), seed=0)
    d = Distiller(space, teacher, router, CurriculumConfig(budgets=BUDGETS, skew=None, seed=2, budget_draw="sample"), vocab=VOCAB)
    d.begin_step(0)
    return d  # seed 2: both micro-batches cut every axis (every router net gets a gradient)


def masked_batches() -> list[dict]:
    """Two micro-batches, a third and a half of their tokens masked out (prompt-like spans)."""
    out = []
    for i, masked in enumerate([(0, 11), (5, 21)]):
        b = batch(100 + i)
        b["loss_mask"][:, masked[0] : masked[1]] = 0.0
        out.append(b)
    return out


def test_router_gradient_is_the_mean_over_loss_tokens(world):  # noqa: F811
    student, teacher = build_parent(), build_parent().eval().requires_grad_(False)
    space = ElasticSpace(student)
    micro = masked_batches()

    plugin_side = distiller(space, teacher)
    for b in micro:  # what megatron's schedule does with calculate_per_token_loss
        per_token, reduce = plugin_side.forward_step(iter([b]), student)
        reduce(per_token)[0].backward()
    one = parallel_state.get_data_parallel_group()
    plugin_side.average_router_grads(parallel_state.get_tensor_and_data_parallel_group(), one)
    got = {n: p.grad.clone() for n, p in plugin_side.router.named_parameters()}
    assert 0 < plugin_side.loss_tokens < sum(b["loss_mask"].numel() for b in micro), "no masking: vacuous"

    brute = distiller(space, teacher)
    total, count = 0.0, 0
    for b in micro:
        # The same draws: same seed, step and sample index; each sample alone at its budget.
        for i, budget in enumerate(brute.draw(len(b["tokens"]))):
            apply_choice(space, brute.choice(budget))
            s = student(b["tokens"][i : i + 1], b["position_ids"][i : i + 1], None)[0, :, :VOCAB]
            with torch.no_grad():
                t = teacher(b["tokens"][i : i + 1], b["position_ids"][i : i + 1], None)[0, :, :VOCAB]
            for j in b["loss_mask"][i].nonzero().flatten().tolist():
                total = total + F.kl_div(
                    F.log_softmax(s[j], -1), F.log_softmax(t[j], -1), log_target=True, reduction="sum"
                )
                count += 1
    (total / count).backward()
    space.clear_gates()
    for name, want in ((n, p.grad) for n, p in brute.router.named_parameters()):
        assert want.abs().max() > 0, name
        # fp32 sums in another order: measured 2e-6 of the largest entry; dividing by all tokens
        # instead of the loss tokens is off by a factor of 1.7.
        assert float((got[name] - want).abs().max()) <= 1e-5 * float(want.abs().max()), name
