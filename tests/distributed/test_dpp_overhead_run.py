"""`dpp/tools/overhead.py` on 2 gloo ranks (slow: a PP=2 trainer and a dozen steps): every op of every
step of both stages is recorded, each step lasts at least the span of its ops, and, starting
from layer times a tenth of this machine's, the fitted terms bring the simulated step time far
closer to the measured one than the layers alone."""

from __future__ import annotations

import json

import pytest

from megatron_ext.dpp.planning.costmodel import CostModel
from megatron_ext.dpp.tools.overhead import synthetic_plans
from tests.distributed._torchrun import REPO, torchrun

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

# llama_tiny's 4 layers, timed about 10x too fast (the calibrated CPU model has alpha ~5e-6)
TOO_FAST = CostModel(alpha=5e-7, beta=1e-9, gamma=2e-4, bwd_ratio=2.0, num_layers=4)
ARGS = dict(seq_len=512, docs=4, seed=11, shapes=(("balanced", 1), ("balanced", 2), ("chunkflow", 4)))


def test_overhead_records_every_op_and_fits_the_steps(tmp_path):
    path = tmp_path / "cost.json"
    TOO_FAST.to_json(path)
    torchrun(str(REPO / "megatron_ext/dpp/tools/overhead.py"), 2, "--cost", str(path), "--seq-len", str(ARGS["seq_len"]),
             "--docs", str(ARGS["docs"]), "--seed", str(ARGS["seed"]), "--shapes", *(f"{m}:{k}" for m, k in ARGS["shapes"]), "--rounds", "1")
    stored = json.loads(path.read_text())
    plans = [p for seed in (11, 12) for p in synthetic_plans(TOO_FAST, 2, ARGS["seq_len"], ARGS["docs"], seed, ARGS["shapes"])]
    ops, steps = stored["overhead"]["ops"], stored["overhead"]["steps"]
    # one forward and one backward of every chunk on each of the 2 stages, one round
    assert len(ops) == sum(4 * len(p.chunks) for p in plans)
    assert len(steps) == len(plans) and all(s["measured_s"] >= s["span_s"] > 0 for s in steps)
    errors = stored["overhead"]["errors"]
    assert errors["layers_only_held_out"]["step_mean"] > 0.5
    assert errors["held_out"]["step_mean"] < 0.5 * errors["layers_only_held_out"]["step_mean"]
    cost = stored["cost_model"]
    # one scale per measured chunk size (the plans' chunks reach 512 tokens, not 2048)
    assert cost["runtime_scale_tokens"] == [128, 512] and cost["p2p_s_token"] >= 0
    assert min(cost["runtime_fwd_scales"]) > 1 and min(cost["runtime_bwd_scales"]) > 1
    assert set(errors["held_out_per_shape"]) == {"balanced k1", "balanced k1 recompute", "balanced k2",
                                                 "balanced k2 recompute", "chunkflow k4", "chunkflow k4 recompute"}
