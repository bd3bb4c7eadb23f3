"""`lora.cost_model=FILE` plans a sweep with a calibration's coefficients instead of the built-in
CPU defaults, and the plan follows them: scaled coefficients scale every predicted time and keep
the plan; a cost that is all per-pass overhead packs every job together; a cost that is all
base-GEMM work keeps a short job out of a long job's padded pass."""

from __future__ import annotations

import dataclasses

import pytest

from test_lora_sweep import TINY

from megatron_ext.config import compose_config
from megatron_ext.lora.calibrate import load_coefficients, save_fit
from megatron_ext.lora.job import LoraJob
from megatron_ext.lora.planning.costmodel import Fit, LinearCostModel
from megatron_ext.lora.planning.workload import shapes_of
from megatron_ext.lora.sweep import CPU_COEFFICIENTS, plan_sweep

JOBS = [LoraJob(f"long{i}", seq_length=32, steps=4, seed=i) for i in range(2)] + [
    LoraJob(f"short{i}", seq_length=4, steps=4, seed=10 + i) for i in range(2)
]


def planned(tmp_path, coefficients=None):
    cfg = compose_config([*TINY, "model.vocab_size=256"])
    if coefficients is not None:
        path = save_fit(tmp_path / f"fit{len(list(tmp_path.iterdir()))}.json",
                        Fit(LinearCostModel(shapes_of(cfg.model), tuple(coefficients)), 0.0, 0.0, 0.0), 1)
        assert load_coefficients(path) == tuple(coefficients)
        cfg = dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, cost_model=str(path)))
    return plan_sweep(cfg, JOBS)


def packs(schedule) -> list[set[str]]:
    return [set(p.jobs) for p in schedule.plan.packs]


def test_the_plan_follows_the_calibrated_coefficients(tmp_path):
    default = planned(tmp_path)
    tripled = planned(tmp_path, [3 * c for c in CPU_COEFFICIENTS])
    assert tripled.plan == default.plan
    assert tripled.makespan == pytest.approx(3 * default.makespan, rel=1e-12)

    overhead = planned(tmp_path, [1.0, 0, 0, 0, 0, 0])
    assert [(p.slots, set(p.jobs)) for p in overhead.plan.packs] == [(4, {j.name for j in JOBS})]
    assert overhead.makespan == pytest.approx(4.0)  # 4 steps of one micro-batch: 4 passes of 1 s

    gemm = planned(tmp_path, [0, 0, 1.0, 0, 0, 0])
    longs, shorts = {"long0", "long1"}, {"short0", "short1"}
    assert gemm.plan != overhead.plan
    for pack in gemm.plan.packs:  # a short job in a long job's pass would pay for its padding
        assert pack.slots == 1 or not (set(pack.jobs) & longs and set(pack.jobs) & shorts), packs(gemm)

@pytest.mark.parametrize(
    "content,message",
    [(None, "not a calibration file"), ('{"coefficients": [1, 2]}', "expected 6 finite"),
     ('{"coefficients": [1, 0, 0, 0, -1, 0]}', "expected 6 finite"), ('{"coeffs": []}', "not a calibration file")],
    ids=["missing", "count", "negative", "key"],
)
def test_a_bad_calibration_file_is_refused_naming_it(tmp_path, content, message):
    path = tmp_path / "fit.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=f"lora.cost_model={path}: {message}"):
        load_coefficients(path)
