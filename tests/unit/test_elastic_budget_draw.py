"""`budget_draw="micro_batch"` (the default) is the draw the elastic plugin had before per-sample
budgets: one budget per micro-batch from (seed, step, global micro-batch index), and the router's
Gumbel sample of its sizes from that same generator right after. Checked against a direct
computation of that formula (sha256 seed, multinomial, router sample), and one forward step
against the old forward step (the whole micro-batch at that choice): bitwise. A value other than
"micro_batch" or "sample" is refused."""

from __future__ import annotations

import hashlib
from types import SimpleNamespace

import pytest
import torch

from megatron_ext.config.schema import Config
from megatron_ext.elastic.config import ElasticConfig
from megatron_ext.elastic.distill import CurriculumConfig, Distiller, check_budget_draw
from megatron_ext.elastic.plugin import ElasticPlugin
from megatron_ext.elastic.router import BudgetRouter, RouterConfig, apply_choice
from megatron_ext.elastic.space import ElasticSpace
from megatron_ext.elastic.vocab_loss import ce_per_token, kd_per_token
from tests.unit.test_elastic_router import BUDGETS, GRID, batch
from tests.unit.test_elastic_slicing import build_parent, world  # noqa: F401

VOCAB, SEED = 100, 4


def old_generator(seed: int, step: int, micro_batch: int) -> torch.Generator:
    """The generator of the per-micro-batch draw as it was (before 8c1d2fe)."""
    digest = hashlib.sha256(f"{seed}/{step}/{micro_batch}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


def old_choose(d: Distiller, cfg: CurriculumConfig, step: int, micro_batch: int):
    """The old `Distiller.choose`: the budget, then the router's sample, from one generator."""
    g = old_generator(cfg.seed, step, micro_batch)
    probs = [1 / len(cfg.budgets)] * len(cfg.budgets) if step < cfg.uniform_steps else cfg.skew
    budget = int(torch.multinomial(torch.tensor(probs), 1, generator=g))
    return budget, d.router.sample(budget, step, g)


def distiller(space: ElasticSpace, teacher, **kw) -> tuple[Distiller, CurriculumConfig]:
    cfg = CurriculumConfig(budgets=BUDGETS, uniform_steps=2, skew=[0.5, 0.3, 0.2], seed=SEED, ce_weight=0.5, **kw)
    d = Distiller(space, teacher, BudgetRouter(BUDGETS, GRID, RouterConfig(), seed=0), cfg, VOCAB)
    return d, cfg


def test_default_is_micro_batch_and_bad_values_are_refused():
    assert CurriculumConfig().budget_draw == "micro_batch"
    assert ElasticConfig().budget_draw == "micro_batch"
    cfg = SimpleNamespace(parallel=SimpleNamespace(vpp=None, pp=1, cp=1, ep=1), model=SimpleNamespace(arch="gpt"),
                          plugins=["elastic"])
    with pytest.raises(ValueError, match="elastic.budget_draw='per_token'"):  # refused before the model is built
        ElasticPlugin(ElasticConfig(budget_draw="per_token")).setup(SimpleNamespace(cfg=cfg))
    ElasticPlugin(ElasticConfig(budget_draw="sample")).setup(SimpleNamespace(cfg=cfg))
    for bad in "token", "Sample", "", None:
        with pytest.raises(ValueError, match=f"elastic.budget_draw={bad!r}: must be one of 'micro_batch', 'sample'"):
            CurriculumConfig(budget_draw=bad)
        with pytest.raises(ValueError, match="elastic.budget_draw"):
            check_budget_draw(bad)
    check_budget_draw("sample")


def test_micro_batch_draw_and_router_sample_are_the_old_ones(world):  # noqa: F811
    d, cfg = distiller(ElasticSpace(build_parent()), None)
    seen = set()
    for step in 0, 1, 2, 3, 7:  # stage 1 (uniform) and stage 2 (skewed)
        for dp in 1, 2:
            for r in range(dp):
                d.micro_batch_index = lambda m, r=r, dp=dp: m * dp + r
                d.begin_step(step)
                for m in range(4):
                    budgets = d.draw(3)
                    budget, choice = old_choose(d, cfg, step, m * dp + r)
                    assert budgets == [budget] * 3 and d.drawn[-1] == budgets
                    assert d.micro_choice.sizes == choice.sizes
                    for k in choice.sizes:
                        assert torch.equal(d.micro_choice.soft_sizes[k], choice.soft_sizes[k])
                        assert torch.equal(d.micro_choice.gates[k], choice.gates[k])
                    seen.add((budget, tuple(choice.sizes.values())))
        d.begin_step(step)
        want = [(b, c.sizes) for b, c in (old_choose(d, cfg, step, j) for j in range(8))]
        assert d.micro_batch_choices(8) == want
    # Not vacuous: every budget drawn, and one budget at different sizes in different micro-batches.
    assert {b for b, _ in seen} == {0, 1, 2}
    assert any(sum(b == x for x, _ in seen) > 1 for b in range(3)), seen


def test_micro_batch_forward_step_is_the_old_one(world):  # noqa: F811
    student, teacher = build_parent(), build_parent().eval().requires_grad_(False)
    space = ElasticSpace(student)
    mb = batch(3)

    def grads():
        out = {}
        for i, m in enumerate((student, d.router)):
            for n, p in m.named_parameters():
                if p.grad is not None:
                    out[f"{i}.{n}"], p.grad = p.grad.clone(), None
        return out

    d, cfg = distiller(space, teacher)
    results = []
    for old in False, True:
        d.begin_step(5)
        per_token = []
        for m in range(3):
            if old:  # the old forward step: the whole micro-batch at the micro-batch's choice
                _, choice = old_choose(d, cfg, 5, m)
                apply_choice(space, choice)
                logits = student(mb["tokens"], mb["position_ids"], None)
                with torch.no_grad():
                    t = teacher(mb["tokens"], mb["position_ids"], None)
                loss = kd_per_token(logits, t, cfg.temperature, VOCAB) + 0.5 * ce_per_token(logits, mb["labels"], VOCAB)
            else:
                loss, _ = d.forward_step(iter([mb]), student)
            loss.sum().backward()
            per_token.append(loss.detach())
        space.clear_gates()
        results.append((per_token, grads()))
        if not old:
            drawn = d.drawn
    (got, got_grads), (want, want_grads) = results
    assert len({x for row in drawn for x in row}) > 1, drawn  # the micro-batches differ
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert got_grads.keys() == want_grads.keys() and any(k.startswith("1.") for k in got_grads)
    for k in want_grads:
        assert torch.equal(got_grads[k], want_grads[k]), k


def test_elastic_with_live_reshard_is_refused_before_launch():
    """The refusal follows from the two plugins' capabilities (config/capabilities.py)."""
    from megatron_ext.config.validate import ConfigError, validate
    from megatron_ext.reshard.plugin import ReshardPlugin
    from megatron_ext.training.trainer import Trainer

    with pytest.raises(ConfigError, match="frozen teacher"):
        validate(Config(plugins=["reshard", "elastic"]), 1, "cpu")
    validate(Config(plugins=["elastic"]), 1, "cpu")
    with pytest.raises(ConfigError, match="frozen teacher"):  # a Trainer built without train.run()
        Trainer(Config(plugins=["reshard", "elastic"]), [ReshardPlugin(), ElasticPlugin(ElasticConfig())])
