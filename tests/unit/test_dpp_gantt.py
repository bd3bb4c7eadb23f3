"""The Gantt chart draws a simulated step and a measured timeline (TimedOp records) into one
PNG: one bar per op on its stage's row, recompute hatched."""

from __future__ import annotations

import pytest

from megatron_ext.dpp.planning.gantt import TimedOp, draw, from_events, save
from megatron_ext.dpp.planning.planner import plan_step
from megatron_ext.dpp.planning.simulate import simulate
from tests.unit._dpp_cases import TOY

matplotlib = pytest.importorskip("matplotlib")


def test_gantt_of_a_simulated_and_a_measured_step(tmp_path):
    matplotlib.use("Agg")
    from matplotlib import image, pyplot as plt

    layers = (2, 2)
    plan = plan_step([300, 120, 40, 20, 9], TOY, 2, TOY.model_state_bytes(2, True, True) + 2e6, "dpp", layers=layers,
                     k_candidates=(3,))
    sim = simulate(plan, TOY, layers)
    measured = [TimedOp(e.stage, e.kind, e.chunk, 100.0 + 2 * e.start, 100.0 + 2 * e.end) for e in sim.events]
    fig, ax = plt.subplots()
    draw(ax, from_events(sim.events), plan)
    bars = [c for c in ax.collections]
    assert len(bars) == len(sim.events) + sum(1 for e in sim.events if e.recompute_s > 0)
    assert ax.get_xlim()[1] >= sim.iter_s  # times start at zero
    plt.close(fig)
    path = tmp_path / "g.png"
    save(path, [(from_events(sim.events), plan, "simulated"), (measured, plan, "measured")])
    assert image.imread(path).shape[0] > 100
