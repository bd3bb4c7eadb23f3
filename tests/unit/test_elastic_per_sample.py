"""Per-sample budgets (budget_draw="sample"): a micro-batch whose samples drew different budgets trains exactly as each
sample alone at its budget, and the draw does not depend on the data-parallel layout or the
micro-batch size.

The reference runs every sample on its own through the elastic model at its budget's sizes and
computes the KD and CE losses with torch's own `kl_div` / `cross_entropy`, then takes the mean
over the loss tokens; the Distiller's path groups the micro-batch by budget (`grouped.py`). The
model and the router are fp64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_ext.elastic.distill import CurriculumConfig, Distiller, in_sample_order
from megatron_ext.elastic.router import BudgetRouter, RouterConfig, apply_choice
from megatron_ext.elastic.space import ElasticSpace
from tests.unit.test_elastic_router import BUDGETS, GRID, batch
from tests.unit.test_elastic_slicing import build_parent, world  # noqa: F401

VOCAB, TEMPERATURE, CE = 100, 2.0, 0.5
# Seed 6 draws budgets [2, 0, 2, 1] for the four samples of step 30 (past the router's
# annealing: each budget's sizes are its selected ones): three groups, one of them not
# contiguous, two hidden sizes (asserted below: a change of the draw cannot make the test vacuous).
SEED, STEP = 6, 30


def micro_batch() -> dict:
    """Four samples, some of their tokens masked out (prompt-like spans)."""
    a, b = batch(7), batch(8)
    mb = {k: torch.cat([a[k], b[k]]) for k in a}
    mb["loss_mask"][0, :9] = 0.0
    mb["loss_mask"][3, 4:20] = 0.0
    return mb


def distiller(space: ElasticSpace, teacher) -> Distiller:
    router = BudgetRouter(BUDGETS, GRID, RouterConfig(anneal_steps=100), seed=0).double()
    cfg = CurriculumConfig(BUDGETS, temperature=TEMPERATURE, ce_weight=CE, seed=SEED, budget_draw="sample")
    d = Distiller(space, teacher, router, cfg, VOCAB)
    d.warm_up_router(20)  # the budgets' sizes differ (a fresh router picks at random)
    d.begin_step(STEP)
    return d


def grads(*modules) -> dict[str, torch.Tensor]:
    out = {}
    for i, m in enumerate(modules):
        for n, p in m.named_parameters():
            if p.grad is not None:
                out[f"{i}.{n}"] = p.grad.clone()
                p.grad = None
    return out


def alone(d: Distiller, student, teacher, mb: dict) -> tuple[torch.Tensor, list[int]]:
    """Per-token losses [b, s] of every sample run alone at its budget (torch's losses); the
    mean over the loss tokens is backpropagated. Also the budgets."""
    budgets = d.draw(len(mb["tokens"]))
    rows = []
    for i, budget in enumerate(budgets):
        apply_choice(d.space, d.choice(budget))
        one = {k: v[i : i + 1] for k, v in mb.items()}
        s = student(one["tokens"], one["position_ids"], None)[0, :, :VOCAB]
        with torch.no_grad():
            t = teacher(one["tokens"], one["position_ids"], None)[0, :, :VOCAB]
        kd = F.kl_div(
            F.log_softmax(s / TEMPERATURE, -1), F.log_softmax(t / TEMPERATURE, -1), log_target=True, reduction="none"
        ).sum(-1)
        rows.append(kd * TEMPERATURE**2 + CE * F.cross_entropy(s, one["labels"][0], reduction="none"))
    per_token = torch.stack(rows)
    ((per_token * mb["loss_mask"]).sum() / mb["loss_mask"].sum()).backward()
    return per_token.detach(), budgets


def test_mixed_budget_micro_batch_equals_each_sample_alone(world):  # noqa: F811
    student, teacher = build_parent().double(), build_parent().double().eval().requires_grad_(False)
    space = ElasticSpace(student)
    mb = micro_batch()

    grouped = distiller(space, teacher)
    per_token, _ = grouped.forward_step(iter([mb]), student)
    # The mean over the loss tokens in fp64 (megatron's loss_func sums in fp32).
    ((per_token * mb["loss_mask"]).sum() / mb["loss_mask"].sum()).backward()
    got = grads(student, grouped.router)
    space.clear_gates()

    reference = distiller(space, teacher)
    want_per_token, budgets = alone(reference, student, teacher, mb)
    want = grads(student, reference.router)
    space.clear_gates()

    assert grouped.drawn == [budgets] and budgets == [2, 0, 2, 1], budgets
    sizes = [reference.choice(b).sizes for b in range(3)]
    assert len({tuple(s.values()) for s in sizes}) == 3 and len({s["hidden"] for s in sizes}) == 2, sizes
    # Running every sample at the first group's sizes, or leaving the groups' losses in group
    # order, puts tokens 0.9 (relative) or more apart (measured).
    torch.testing.assert_close(per_token, want_per_token, rtol=1e-12, atol=1e-12)
    assert got.keys() == want.keys() and any(k.startswith("1.") for k in got)
    for name, w in want.items():
        assert w.abs().max() > 0, name
        # Summation order only: measured 9e-14 of the largest entry at worst (a router net's:
        # the softmax's backward cancels).
        assert float((got[name] - w).abs().max()) <= 1e-12 * float(w.abs().max()), name


def draws(d: Distiller, dp: int, micro_batch_size: int, samples: int, step: int) -> list[int]:
    """The step's budgets in global sample order, drawn as `dp` replicas with this micro-batch
    size do (replica r's m-th micro-batch is the global (m * dp + r)-th, as megatron's sampler
    deals them and the plugin numbers them)."""
    per_rank = []
    for r in range(dp):
        d.micro_batch_index = lambda m, r=r: m * dp + r
        d.begin_step(step)
        for _ in range(samples // (dp * micro_batch_size)):
            d.draw(micro_batch_size)
        per_rank.append(torch.tensor(d.drawn))
    return in_sample_order(per_rank)


def test_budget_draw_is_layout_independent_and_follows_the_curriculum(world):  # noqa: F811
    cfg = CurriculumConfig(budgets=BUDGETS, uniform_steps=1, skew=[0.6, 0.3, 0.1], seed=3, budget_draw="sample")
    d = Distiller(ElasticSpace(build_parent()), None, BudgetRouter(BUDGETS, GRID, RouterConfig()), cfg, VOCAB)
    for step in 0, 1:
        one = draws(d, 1, 1, 16, step)
        assert len(set(one)) == 3, one
        for dp in 1, 2, 4:
            for mbs in 1, 2, 4, 8:
                if 16 % (dp * mbs) == 0:
                    assert draws(d, dp, mbs, 16, step) == one, (step, dp, mbs)
    assert draws(d, 1, 1, 16, 0) != draws(d, 1, 1, 16, 1)
    # Stage 1 uniform, stage 2 skewed: frequencies over 3000 samples within 3 standard errors.
    for step, probs in (0, [1 / 3] * 3), (1, cfg.skew):
        counts = torch.bincount(torch.tensor(draws(d, 1, 50, 3000, step)), minlength=3) / 3000
        assert counts.tolist() == pytest.approx(probs, abs=3 * (0.25 / 3000) ** 0.5), (step, counts)
