"""`elastic.budget_share`: consecutive global micro-batches that draw one budget and router sample
together, which expert parallelism needs (`expert_parallel.py`; the EP runs themselves:
`tests/distributed/test_elastic_expert_parallel.py`, -m slow).

References: the draws as computed directly from their formula (sha256 of (seed, step, key),
multinomial, the router's sample from the same generator: `old_choose` of the per-micro-batch
draw, keyed by the window instead of the micro-batch) and a brute force over micro-batch slots for
the windows of an EP group. Layouts as megatron deals them: replica r's m-th micro-batch is the
global (m * dp + r)-th, an EP group is ep consecutive data-parallel ranks."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from megatron_ext.elastic.config import ElasticConfig
from megatron_ext.elastic.distill import CurriculumConfig, check_budget_share, draw_budget, draw_generator
from megatron_ext.elastic.expert_parallel import peers_share_windows
from megatron_ext.elastic.plugin import ElasticPlugin
from megatron_ext.elastic.space import ElasticSpace
from tests.unit.test_elastic_budget_draw import distiller, old_choose
from tests.unit.test_elastic_slicing import build_parent, world  # noqa: F401

# (dp, ep, budget_share): EP inside the replicas, windows of one EP group or several.
LAYOUTS = [(2, 2, 2), (2, 2, 4), (4, 2, 2), (4, 2, 6), (4, 4, 4)]
STEPS, MICRO_BATCHES, SAMPLES = (0, 1, 3), 4, 3


def ep_groups(dp: int, ep: int) -> list[list[int]]:
    return [list(range(g, g + ep)) for g in range(0, dp, ep)]


def draws(d, dp: int, step: int, micro_batches: int = MICRO_BATCHES) -> dict[int, tuple]:
    """Every replica's draws of one step by global micro-batch index: (budgets, sizes, gates)."""
    out = {}
    for r in range(dp):
        d.micro_batch_index = lambda m, r=r: m * dp + r
        d.begin_step(step)
        for m in range(micro_batches):
            budgets = d.draw(SAMPLES)
            c = d.micro_choice
            out[m * dp + r] = budgets, c.sizes, {k: float(g.detach()) for k, g in c.gates.items()}
    return out


@pytest.mark.usefixtures("world")
@pytest.mark.parametrize("dp, ep, share", LAYOUTS)
def test_micro_batch_draws_are_shared_by_windows_and_the_ep_peers(dp, ep, share):
    d, cfg = distiller(ElasticSpace(build_parent()), None, budget_share=share)
    seen = set()
    for step in STEPS:
        got = draws(d, dp, step)
        single = draws(d, 1, step, dp * MICRO_BATCHES)  # one process: the global micro-batches in order
        assert got == single
        for g, (budgets, sizes, _) in got.items():
            budget, choice = old_choose(d, cfg, step, g // share)  # the formula, keyed by the window
            assert budgets == [budget] * SAMPLES and sizes == choice.sizes
            seen.add((step, g // share, budget, tuple(sizes.values())))
        for m in range(MICRO_BATCHES):
            for peers in ep_groups(dp, ep):
                assert all(got[m * dp + r] == got[m * dp + peers[0]] for r in peers), (step, m, peers)
        d.begin_step(step)
        assert d.micro_batch_choices(len(got)) == [(got[g][0][0], got[g][1]) for g in range(len(got))]
    assert len({x[2:] for x in seen}) > 1, "every window drew alike: vacuous"


@pytest.mark.usefixtures("world")
@pytest.mark.parametrize("dp, ep, share", LAYOUTS)
def test_sample_draws_repeat_row_by_row_in_a_window(dp, ep, share):
    """Per sample: micro-batch g's row i draws from the key (g // share) * samples + i (the global
    sample index when budget_share is 1), so a window's micro-batches, the EP peers' among them,
    carry the same budgets row by row and run the same budget groups."""
    d, cfg = distiller(ElasticSpace(build_parent()), None, budget_share=share, budget_draw="sample")
    rows = set()
    for step in STEPS:
        for r in range(dp):
            d.micro_batch_index = lambda m, r=r: m * dp + r
            d.begin_step(step)
            for m in range(MICRO_BATCHES):
                window = (m * dp + r) // share
                want = [
                    draw_budget(cfg, step, draw_generator(cfg.seed, step, window * SAMPLES + i)) for i in range(SAMPLES)
                ]
                assert d.draw(SAMPLES) == want
                rows.add(tuple(want))
    assert any(len(set(r)) > 1 for r in rows), "no micro-batch mixes budgets: vacuous"


def test_the_ep_groups_windows_against_a_brute_force():
    """`peers_share_windows` looks at `share` slots; a brute force over 60 slots agrees, and
    megatron's EP groups share windows exactly when budget_share is a multiple of ep."""
    for dp in 1, 2, 4, 6, 8:
        for share in range(1, 9):
            for peers in [list(range(a, b)) for a in range(dp) for b in range(a + 1, dp + 1)] + [[0, 2], [1, 3]]:
                if max(peers) >= dp:
                    continue
                brute = all(len({(m * dp + r) // share for r in peers}) == 1 for m in range(60))
                assert peers_share_windows(share, dp, peers) == brute, (dp, share, peers)
    for dp, ep in (2, 2), (4, 2), (6, 2), (6, 3), (8, 4):
        for share in range(1, 13):
            ok = all(peers_share_windows(share, dp, peers) for peers in ep_groups(dp, ep))
            assert ok == (share % ep == 0), (dp, ep, share)


def trainer(ep: int, pp: int = 1) -> SimpleNamespace:
    parallel = SimpleNamespace(vpp=None, pp=pp, cp=1, ep=ep)
    return SimpleNamespace(cfg=SimpleNamespace(parallel=parallel, model=SimpleNamespace(arch="hybrid"), plugins=["elastic"]))


@pytest.mark.parametrize("ep, share", [(2, 1), (2, 3), (4, 2), (4, 6)])
def test_an_ep_group_split_across_windows_is_refused_at_setup(ep, share):
    with pytest.raises(ValueError, match=f"elastic.budget_share={share} must be a multiple of parallel.ep={ep}"):
        ElasticPlugin(ElasticConfig(budget_share=share)).setup(trainer(ep))


def test_shared_draws_are_accepted_and_bad_values_refused():
    for ep, share in (1, 1), (1, 3), (2, 2), (2, 4), (4, 4), (4, 8):
        ElasticPlugin(ElasticConfig(budget_share=share)).setup(trainer(ep))
    ElasticPlugin(ElasticConfig(budget_share=2, budget_draw="sample")).setup(trainer(2, pp=2))
    assert ElasticConfig().budget_share == CurriculumConfig().budget_share == 1
    for bad in 0, -2, 2.0, True, None:
        with pytest.raises(ValueError, match=rf"elastic.budget_share={bad!r}: must be a positive integer"):
            check_budget_share(bad)
        with pytest.raises(ValueError, match="elastic.budget_share"):
            ElasticPlugin(ElasticConfig(budget_share=bad)).setup(trainer(1))
