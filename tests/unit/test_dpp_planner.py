"""DPP planner and baselines: every policy yields a valid plan of the whole batch that runs to
the end in the simulator; DPP plans hold split, packed and hybrid chunks when the batch calls for
them; ablations do what their names say; bad policy names and static policies without their
tuned configuration are refused."""

from __future__ import annotations

import pytest

from megatron_ext.dpp.planning.costmodel import MODEL_SHAPES, analytic_gpu
from megatron_ext.dpp.planning.planner import POLICIES, STATIC_POLICIES, plan_step, plan_step_info, tune_static
from megatron_ext.dpp.planning.simulate import check_plan, simulate
from tests.unit._dpp_cases import TOY

LENGTHS = [700, 300, 120, 90, 60, 40, 33, 20, 12, 9, 5, 3]
LAYERS = (2, 2)
BUDGET = TOY.model_state_bytes(2, True, True) + 4e6
CONTEXT = 1024


# token multiple 3: every chunk padded as sequence parallelism over 3 TP ranks needs
@pytest.mark.parametrize("multiple", [1, 3])
@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_plans_the_whole_batch(policy, multiple):
    static = (tune_static(policy, LENGTHS[::-1], TOY, 2, BUDGET, CONTEXT, LAYERS, token_multiple=multiple)
              if policy in STATIC_POLICIES else None)
    plan, info = plan_step_info(LENGTHS, TOY, 2, BUDGET, policy, layers=LAYERS, static=static, k_candidates=(1, 2, 4, 8),
                                token_multiple=multiple)
    check_plan(plan, LAYERS)
    assert all(c.padding == -sum(s.length for s in c.segments) % multiple for c in plan.chunks)
    sim = simulate(plan, TOY, LAYERS, BUDGET)
    assert sim.iter_s == pytest.approx(info.predicted_iter_s)
    rec = [o.recompute for g in plan.groups for ops in g.ops for o in ops if o.kind == "F"]
    if policy == "dpp_no_ckpt":
        assert set(rec) == {0}
    if policy == "dpp_full_ckpt":
        assert set(rec) == {2}
    if policy.startswith("dpp"):
        assert not any(sim.oom)


def test_dpp_plan_mixes_split_packed_and_hybrid_chunks():
    plan = plan_step(LENGTHS, TOY, 2, BUDGET, "dpp", layers=LAYERS, k_candidates=(4,))
    assert {c.kind for c in plan.chunks} == {"split", "packed", "hybrid"}
    # execution order: first-stage forwards run chunk 0, 1, 2, ...
    assert [o.chunk for g in plan.groups for o in g.ops[0] if o.kind == "F"] == list(range(len(plan.chunks)))


@pytest.mark.parametrize("call,msg", [
    (lambda: plan_step(LENGTHS, TOY, 2, BUDGET, "fastest", layers=LAYERS), "unknown policy"),
    (lambda: plan_step(LENGTHS, TOY, 2, BUDGET, "split", layers=LAYERS), "StaticConfig"),
    (lambda: plan_step([], TOY, 2, BUDGET, "dpp", layers=LAYERS), "at least one sequence"),
    (lambda: plan_step(LENGTHS, TOY, 2, BUDGET, "packed", layers=LAYERS, token_multiple=2,
                       static=tune_static("packed", LENGTHS, TOY, 2, BUDGET, CONTEXT, LAYERS)), "pads chunks to 1"),
])
def test_bad_requests_are_refused(call, msg):
    with pytest.raises(ValueError, match=msg):
        call()


# (cost model, lengths, pp, budget, layers): with one 128K sequence the balanced mesh's large
# first slice only fits unsliced (K=1), while two even slices fit and run 1.3x faster.
SEARCH_CASES = {
    "toy": (TOY, LENGTHS, 2, BUDGET, LAYERS),
    "13b_one_128k_sequence": (analytic_gpu(MODEL_SHAPES["llama-13b"]), [131072, 4000, 3000, 2000, 1000], 4, 80e9, None),
}


@pytest.mark.parametrize("case", SEARCH_CASES)
def test_dpp_is_never_slower_than_its_even_mesh_ablation(case):
    cost, lengths, pp, budget, layers = SEARCH_CASES[case]
    times = {
        policy: plan_step_info(lengths, cost, pp, budget, policy, layers=layers, k_candidates=(1, 2, 4, 8))[1].predicted_iter_s
        for policy in ("dpp", "dpp_no_balance")
    }
    assert times["dpp"] <= times["dpp_no_balance"] * (1 + 1e-12)


def test_dpp_picks_the_even_mesh_where_the_model_makes_it_faster(monkeypatch):
    """A model whose large chunks run slower in a step (a scale per chunk size) makes the
    balanced mesh's large first slices cost more than even ones: DPP's search takes the even
    mesh, which a search of balanced meshes alone could not find."""
    import dataclasses

    from megatron_ext.dpp.planning import planner

    cost = dataclasses.replace(TOY, runtime_scale_tokens=(64, 512), runtime_fwd_scales=(1.0, 3.0), runtime_bwd_scales=(1.0, 3.0))

    def plan_time(policy: str) -> float:
        return plan_step_info(LENGTHS, cost, 2, BUDGET, policy, layers=LAYERS, k_candidates=(1, 2, 4, 8))[1].predicted_iter_s

    times = {policy: plan_time(policy) for policy in ("dpp", "dpp_no_balance")}
    monkeypatch.setitem(planner.DPP_POLICIES, "dpp", ((True,), "ilp"))
    balanced_only = plan_time("dpp")
    assert times["dpp"] == times["dpp_no_balance"] < balanced_only


def test_a_sequence_that_only_fits_coarse_slices_gets_a_pipeline_and_mesh_of_its_own(monkeypatch):
    """LLaMA-13B, PP 4: a 128K sequence fits only in two even slices, which on one mesh for the
    whole batch makes every other chunk as large and memory-bound. DPP also plans it alone in a
    pipeline of its own and the rest in another on their own mesh: that plan's time is the two
    sub-batches' times planned as batches of their own (one pipeline each), and it beats the
    best one-mesh plan."""
    from megatron_ext.dpp.planning import planner

    cost = analytic_gpu(MODEL_SHAPES["llama-13b"])
    lengths = [30000, 131072, 20000, 12000, 8000, 6000, 4000, 3000, 2000, 1000, 500]  # longest not first
    ks = (1, 2, 4, 8)
    searches = []
    search = planner._search_meshes
    monkeypatch.setattr(planner, "_search_meshes", lambda *a: searches.append(search(*a)) or searches[-1])
    plan, info = plan_step_info(lengths, cost, 4, 80e9, "dpp", k_candidates=ks)
    monkeypatch.undo()
    check_plan(plan, (10,) * 4)
    sim = simulate(plan, cost, budget_bytes=80e9)
    assert not any(sim.oom)
    assert len(plan.groups) == 2
    first = {o.chunk for o in plan.groups[0].ops[0]}
    assert {s.seq for c in first for s in plan.chunks[c].segments} == {1}
    rest = plan_step_info(lengths[:1] + lengths[2:], cost, 4, 80e9, "dpp", k_candidates=ks, max_groups=1)[1].predicted_iter_s
    even_or_balanced = plan_step_info([131072], cost, 4, 80e9, "dpp", k_candidates=ks, max_groups=1)[1].predicted_iter_s
    # The lone sequence also tries meshes between even and equal-time ones: a policy searching
    # those shares plans it as fast, and faster than the two meshes alone (55%/45% slices fit).
    monkeypatch.setitem(planner.DPP_POLICIES, "dpp", ((1.0, 0.75, 0.5, 0.25, 0.0), "ilp"))
    alone = plan_step_info([131072], cost, 4, 80e9, "dpp", k_candidates=ks, max_groups=1)[1].predicted_iter_s
    monkeypatch.undo()
    assert alone < even_or_balanced * 0.95
    assert info.predicted_iter_s == pytest.approx(alone + rest, rel=1e-12)
    one_mesh = searches[0][2]  # the whole batch on one mesh, up to two pipelines
    assert info.predicted_iter_s < one_mesh * 0.9
