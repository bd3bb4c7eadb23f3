"""`lora.max_pass_tokens: auto` (pass_size.py): the knee of measured pass rates, and where the
cap comes from (a calibration file, else the device's default); bad values refused by name."""

from __future__ import annotations

import json

import pytest

from megatron_ext.lora.planning import pass_size


@pytest.mark.parametrize(
    "rates,fraction,expected",
    [
        ({128: 50.0, 256: 80.0, 512: 95.0, 1024: 100.0, 2048: 90.0}, 0.9, 512),  # first within 90% of the best
        ({128: 50.0, 256: 80.0, 512: 95.0, 1024: 100.0, 2048: 90.0}, 1.0, 1024),  # the best itself
        ({512: 10.0, 128: 9.5, 256: 3.0}, 0.9, 128),  # the smallest qualifying size, in any order
        ({4096: 7.0}, 0.9, 4096),
    ],
    ids=["knee", "best", "unordered", "single"],
)
def test_knee_is_the_smallest_size_near_the_best_rate(rates, fraction, expected):
    brute = min(s for s in rates if all(rates[s] >= fraction * r for r in rates.values()))
    assert pass_size.knee(rates, fraction) == brute == expected


def _cost_file(tmp_path, **fields):
    path = tmp_path / "cost.json"
    path.write_text(json.dumps({"coefficients": [0.0] * 6, **fields}))
    return str(path)


@pytest.mark.parametrize(
    "value,file_fields,cuda,expected",
    [
        ("auto", None, False, pass_size.CPU_PASS_TOKENS),
        ("auto", None, True, None),
        ("auto", {"pass_tokens": 3072}, True, 3072),  # a calibration wins on any device
        ("auto", {"pass_tokens": None}, False, pass_size.CPU_PASS_TOKENS),  # calibrated without the pass scan
        ("auto", {}, False, pass_size.CPU_PASS_TOKENS),  # a file written before pass_tokens existed
        (512, {"pass_tokens": 3072}, False, 512),  # an explicit cap is the user's
        (None, {"pass_tokens": 3072}, False, None),
    ],
    ids=["cpu", "cuda", "calibrated", "calibrated-none", "old-file", "explicit", "one-pass"],
)
def test_resolve(tmp_path, value, file_fields, cuda, expected):
    cost = None if file_fields is None else _cost_file(tmp_path, **file_fields)
    assert pass_size.resolve(value, cost, cuda) == expected


@pytest.mark.parametrize("value", [0, -3, "big", 1.5, True])
def test_bad_settings_are_refused_by_name(value):
    with pytest.raises(ValueError, match=r"lora.max_pass_tokens must be 'auto', null or >= 1 tokens"):
        pass_size.resolve(value, None, False)


@pytest.mark.parametrize("stored", [0, "many", 2.5])
def test_a_bad_calibrated_size_names_the_file(tmp_path, stored):
    path = _cost_file(tmp_path, pass_tokens=stored)
    with pytest.raises(ValueError, match=rf"lora.cost_model={path}: pass_tokens must be a positive integer"):
        pass_size.resolve("auto", path, False)


def test_the_calibration_file_carries_the_knee(tmp_path):
    from megatron_ext.config import compose_config
    from megatron_ext.lora.calibrate import save_fit
    from megatron_ext.lora.planning.costmodel import Fit, LinearCostModel
    from megatron_ext.lora.planning.workload import shapes_of

    shapes = shapes_of(compose_config(["model=llama_tiny", "model.vocab_size=256"]).model)
    path = save_fit(tmp_path / "fit.json", Fit(LinearCostModel(shapes, (1.0,) * 6), 0, 0, 0), 3,
                    pass_size.knee({256: 1.0, 512: 2.0, 1024: 2.1}))
    assert pass_size.resolve("auto", str(path), True) == 512
