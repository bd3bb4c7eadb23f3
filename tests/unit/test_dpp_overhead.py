"""DPP runtime terms (`dpp/tools/overhead.py`, the cost model's loop and p2p terms): at their defaults
plans and simulated times equal those of the code before the terms existed (numbers from commit
bb60274); set, each op, transfer and step gains exactly its term in the simulator (against a
hand-computed two-stage step); the fits recover known terms; a per-chunk cost makes the DPP
planner choose fewer chunks."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from megatron_ext.dpp.planning.costmodel import LLAMA_7B, LLAMA_13B, CostModel, analytic_gpu
from megatron_ext.dpp.planning.plan import Chunk, Segment, StepPlan
from megatron_ext.dpp.planning.planner import plan_step_info
from megatron_ext.dpp.planning.schedule import one_f_one_b
from megatron_ext.dpp.planning.simulate import simulate
from megatron_ext.dpp.tools.overhead import OpSample, StepSample, fit_loop, fit_p2p
from tests.unit._dpp_cases import TOY

REPO = Path(__file__).resolve().parents[2]
GPU_LENGTHS = [32768, 1200, 9000, 500, 20000, 64, 3000, 15000]
CPU_LENGTHS = [4096, 33, 2693, 627, 743, 1055, 73, 1030]

# case -> (predicted iter_s, bubble ratio, chunks), computed by the code of commit bb60274
BEFORE = {
    "analytic_gpu dpp": (10.059370386136742, 0.16295675023387535, 17),
    "analytic_gpu 13B recompute": (61.845482558874586, 0.48222783730065755, 4),
    "measured json dpp": (1.8156821158170777, 0.05853027662785948, 24),
}


def _case(name: str) -> tuple:
    if name == "analytic_gpu dpp":
        m = analytic_gpu(LLAMA_7B)
        return plan_step_info(GPU_LENGTHS, m, 4, 80e9, "dpp", k_candidates=(1, 2, 4, 8)), m
    if name == "analytic_gpu 13B recompute":  # a budget that makes the ILP recompute
        m = analytic_gpu(LLAMA_13B)
        return plan_step_info([65536, 4000, 30000, 800, 12000, 2500, 300, 9000], m, 4, 60e9, "dpp", k_candidates=(1, 2, 4, 8)), m
    m = CostModel.from_json(REPO / "scripts/bench/results/dpp_measured_runtime_cal.costmodel.json")
    return plan_step_info(CPU_LENGTHS, m, 2, 2e9, "dpp"), m


@pytest.mark.parametrize("name", BEFORE)
def test_defaults_give_the_earlier_plans_and_times(name):
    (plan, info), m = _case(name)
    assert (m.chunk_fwd_s, m.chunk_bwd_s, m.step_fixed_s, m.runtime_fwd_scale, m.runtime_bwd_scale) == (0.0, 0.0, 0.0, 1.0, 1.0)
    assert (info.predicted_iter_s, simulate(plan, m).bubble_ratio, len(plan.chunks)) == BEFORE[name]


def test_each_term_enters_its_op_transfer_and_step():
    terms = dict(chunk_fwd_s=3e-3, chunk_bwd_s=5e-3, step_fixed_s=7e-3, runtime_fwd_scale=1.3, runtime_bwd_scale=1.2,
                 p2p_latency_s=2e-4, p2p_s_token=1e-6)
    m = dataclasses.replace(TOY, **terms)
    chunk = Chunk(0, "packed", (Segment(0, 0, 300),))
    plan = StepPlan(2, (300,), (chunk,), (one_f_one_b([(0,)], 2, {(0, 0): 1, (1, 0): 2}),))
    # By hand: one chunk through two stages of 2 layers, forward then backward, with 1 and 2
    # layers recomputed on stages 0 and 1; the head on stage 1.
    f, b, n = TOY.layer_forward_s(chunk), TOY.layer_backward_s(chunk), 300
    head_f, head_b = TOY.head_s_token * n, 2.0 * TOY.head_s_token * n
    hop = 2e-4 + 1e-6 * n
    f0, f1 = 1.3 * 2 * f + 3e-3, 1.3 * (2 * f + head_f) + 3e-3
    b1, b0 = 1.2 * (2 * b + head_b + 2 * f) + 5e-3, 1.2 * (2 * b + f) + 5e-3
    sim = simulate(plan, m, (2, 2))
    assert sim.iter_s == pytest.approx(f0 + hop + f1 + b1 + hop + b0 + 7e-3, rel=1e-12)
    busy = f0 + f1 + b1 + b0
    assert sim.bubble_ratio == pytest.approx(1 - busy / (2 * (sim.iter_s - 7e-3)), rel=1e-12)


@pytest.mark.parametrize("noise", [0.0, 0.02])
def test_loop_fit_recovers_known_terms(noise):
    rng = np.random.default_rng(1)
    truth = {"F": (1.25, 4e-3), "B": (1.4, 9e-3)}
    ops = [OpSample(0, 0, kind, i, (scale * t + fixed) * (1 + noise * rng.standard_normal()), t)
           for kind, (scale, fixed) in truth.items() for i, t in enumerate(np.linspace(5e-3, 0.3, 40))]
    steps = [StepSample(0, 2.0 + fixed, 2.0) for fixed in (0.01, 0.012, 0.5)]  # one step hit by a burst
    got = fit_loop(ops, steps)
    tol = 1e-9 + 3 * noise
    assert (got["runtime_fwd_scale"], got["runtime_bwd_scale"]) == pytest.approx((1.25, 1.4), rel=tol)
    assert (got["chunk_fwd_s"], got["chunk_bwd_s"]) == pytest.approx((4e-3, 9e-3), rel=1e-6 + 300 * noise, abs=1e-12)
    assert got["step_fixed_s"] == pytest.approx(0.012)


def test_p2p_fit_recovers_latency_and_per_token_cost():
    assert fit_p2p([(n, 1.5e-4 + 2e-7 * n) for n in (16, 256, 1024, 4096)]) == pytest.approx((1.5e-4, 2e-7))
    # never below 0: a falling cost is a constant
    assert fit_p2p([(16, 1e-4), (4096, 1e-4 - 2e-9)]) == pytest.approx((1e-4 - 1e-9, 0.0), rel=1e-9, abs=1e-15)


def test_a_per_chunk_cost_makes_dpp_choose_fewer_chunks():
    lengths = [4000, 3000, 1200, 700, 300, 90]
    few = dataclasses.replace(TOY, chunk_fwd_s=0.05, chunk_bwd_s=0.1)
    chunks = [len(plan_step_info(lengths, m, 2, 1e12, "dpp_no_ckpt", k_candidates=(1, 2, 4, 8))[0].chunks) for m in (TOY, few)]
    assert chunks[1] < chunks[0]


# --- the in-step scale per chunk size -----------------------------------------------------------

SIZED = dict(runtime_scale_tokens=(128, 512, 2048), runtime_fwd_scales=(1.6, 1.4, 1.2), runtime_bwd_scales=(1.8, 1.5, 1.3))


def test_a_scale_per_chunk_size_enters_each_op_at_its_chunk_size():
    m = dataclasses.replace(TOY, chunk_fwd_s=3e-3, **SIZED)
    # 256 tokens lie halfway between 128 and 512 in log(tokens); beyond the ends the nearest
    for n, fwd, bwd in ((256, 1.5, 1.65), (64, 1.6, 1.8), (512, 1.4, 1.5), (4096, 1.2, 1.3)):
        chunk = Chunk(0, "packed", (Segment(0, 0, n),))
        f, b = TOY.layer_forward_s(chunk), TOY.layer_backward_s(chunk)
        assert m.forward_s(chunk, 2, False) == pytest.approx(fwd * 2 * f + 3e-3, rel=1e-12)
        assert m.backward_s(chunk, 2, 1, False) == pytest.approx(bwd * (2 * b + f), rel=1e-12)
    # one step through the simulator: each op at its own chunk's scale
    chunks = (Chunk(0, "packed", (Segment(0, 0, 128),)), Chunk(1, "packed", (Segment(1, 0, 2048),)))
    plan = StepPlan(2, (128, 2048), chunks, (one_f_one_b([(0,), (1,)], 2),))
    ops = sum((dataclasses.replace(TOY, p2p_latency_s=0, p2p_s_token=0, runtime_fwd_scale=sf, runtime_bwd_scale=sb)
               .forward_s(c, 2, last) + dataclasses.replace(TOY, runtime_bwd_scale=sb).backward_s(c, 2, 0, last))
              for c, sf, sb in ((chunks[0], 1.6, 1.8), (chunks[1], 1.2, 1.3)) for last in (False, True))
    sim = simulate(plan, dataclasses.replace(m, chunk_fwd_s=0.0), (2, 2))
    assert sum(e.end - e.start for e in sim.events) == pytest.approx(ops, rel=1e-12)


def test_equal_scales_per_size_are_the_single_scale_and_survive_json(tmp_path):
    single = dataclasses.replace(TOY, runtime_fwd_scale=1.3, runtime_bwd_scale=1.2)
    sized = dataclasses.replace(TOY, runtime_scale_tokens=(100, 1000), runtime_fwd_scales=(1.3, 1.3),
                                runtime_bwd_scales=(1.2, 1.2))
    lengths = [4000, 3000, 1200, 700, 300, 90]
    (p1, i1), (p2, i2) = (plan_step_info(lengths, m, 2, 1e12, "dpp_no_ckpt", k_candidates=(1, 2, 4, 8)) for m in (single, sized))
    assert p1 == p2 and i1.predicted_iter_s == pytest.approx(i2.predicted_iter_s, rel=1e-12)
    m = dataclasses.replace(TOY, **SIZED)
    m.to_json(tmp_path / "c.json")
    assert CostModel.from_json(tmp_path / "c.json") == m and hash(m) == hash(CostModel.from_json(tmp_path / "c.json"))


@pytest.mark.parametrize("bad", [dict(runtime_scale_tokens=(128,)), dict(SIZED, runtime_scale_tokens=(512, 128, 2048)),
                                 dict(SIZED, runtime_fwd_scales=(1.0, 1.0))])
def test_malformed_scales_per_size_are_refused(bad):
    with pytest.raises(ValueError, match="runtime_"):
        dataclasses.replace(TOY, **bad)


@pytest.mark.parametrize("noise", [0.0, 0.02])
def test_loop_fit_recovers_known_scales_per_size(noise):
    rng = np.random.default_rng(2)
    truth = dataclasses.replace(TOY, chunk_fwd_s=4e-3, chunk_bwd_s=9e-3, **SIZED)
    ops = []
    for kind in ("F", "B"):
        for i, n in enumerate(np.geomspace(64, 4096, 120).astype(int)):
            t = 1e-4 * n
            fixed = truth.chunk_fwd_s if kind == "F" else truth.chunk_bwd_s
            measured = (truth.runtime_scale(kind, n) * t + fixed) * (1 + noise * rng.standard_normal())
            ops.append(OpSample(0, 0, kind, i, measured, t, int(n)))
    got = fit_loop(ops, [StepSample(0, 2.01, 2.0)], SIZED["runtime_scale_tokens"])
    assert got["runtime_scale_tokens"] == SIZED["runtime_scale_tokens"]
    tol = 1e-9 + 3 * noise
    assert got["runtime_fwd_scales"] == pytest.approx(SIZED["runtime_fwd_scales"], rel=tol)
    assert got["runtime_bwd_scales"] == pytest.approx(SIZED["runtime_bwd_scales"], rel=tol)
    assert (got["chunk_fwd_s"], got["chunk_bwd_s"]) == pytest.approx((4e-3, 9e-3), rel=1e-6 + 300 * noise, abs=1e-12)


def test_a_chunk_size_without_ops_near_it_is_left_out_of_the_fit():
    ops = [OpSample(0, 0, kind, i, 1.5e-4 * n, 1e-4 * n, n) for kind in ("F", "B") for i, n in enumerate((128, 256, 512))]
    got = fit_loop(ops, [StepSample(0, 2.0, 2.0)], (128, 512, 2048))
    assert got["runtime_scale_tokens"] == (128, 512)
    assert got["runtime_fwd_scales"] == pytest.approx((1.5, 1.5)) and got["chunk_fwd_s"] == pytest.approx(0.0, abs=1e-12)
