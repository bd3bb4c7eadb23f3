"""DPP cost model: the calibration's least-squares fits recover known parameters from synthetic
measurements; activation bytes are linear in the recompute count (the ILP's assumption) and
keep K/V only for slices later slices attend to; a fitted model survives a JSON round trip."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_ext.dpp.calibrate import Sample, fit_backward, fit_memory, fit_time, relative_errors
from megatron_ext.dpp.costmodel import CostModel, analytic_gpu, LLAMA_7B
from megatron_ext.dpp.plan import Chunk, Segment
from tests.unit._dpp_cases import TOY

# name -> (gamma, alpha, beta, bwd ratio, noise)
FITS = {
    "exact": (2e-4, 3e-5, 5e-8, 2.2, 0.0),
    "1% noise": (5e-4, 1e-5, 2e-8, 1.9, 0.01),
    "attention-heavy": (1e-4, 1e-6, 4e-7, 2.5, 0.0),
}


@pytest.mark.parametrize("name", FITS)
def test_time_fit_recovers_known_parameters(name):
    gamma, alpha, beta, ratio, noise = FITS[name]
    rng = np.random.default_rng(0)
    samples = []
    for q in (64, 128, 256, 512, 1024):
        for p in (0, 256, 1024, 2048):
            t = gamma + alpha * q + beta * q * (p + q / 2)
            samples.append(Sample(q, p, t * (1 + noise * rng.standard_normal()), ratio * t * (1 + noise * rng.standard_normal()), 1.0))
    g, a, b, r = fit_time(samples)
    bg, ba, bb = fit_backward(samples)
    assert (ba, bb) == pytest.approx((ratio * alpha, ratio * beta), rel=1e-6 + 5 * noise)
    assert bg == pytest.approx(ratio * gamma, rel=1e-6 + 30 * noise)
    # gamma is a small part of most samples, so noise moves it most
    assert (a, b, r) == pytest.approx((alpha, beta, ratio), rel=1e-6 + 5 * noise)
    assert g == pytest.approx(gamma, rel=1e-6 + 30 * noise)
    errors = relative_errors(CostModel(alpha=a, beta=b, gamma=g, bwd_ratio=r, act_bytes_token=1.0), samples)
    assert errors["fwd_mean"] <= 2 * noise + 1e-9


def test_memory_fit_recovers_known_parameters():
    per_token, per_pair, per_key = 11792.0, 33.0, 512.0
    samples = [Sample(q, p, 0.0, 0.0, per_token * q + per_pair * q * (q + p) + per_key * p)
               for q in (64, 256, 1024) for p in (0, 512, 2048)]
    assert fit_memory(samples) == pytest.approx((per_token, per_pair, per_key), rel=1e-9)


def test_activation_bytes_are_linear_in_recompute_and_keep_kv_of_continued_slices():
    lengths = [300, 50]
    first = Chunk(0, "split", (Segment(0, 0, 200),))
    tail = Chunk(1, "hybrid", (Segment(0, 200, 100), Segment(1, 0, 50)))
    for c, continued in ((first, 200), (tail, 0)):
        a = [TOY.activation_bytes(c, lengths, 4, r, last=False) for r in range(5)]
        assert np.allclose(np.diff(a), a[1] - a[0])
        per_recomputed = TOY.layer_act_bytes(c) - TOY.ckpt_bytes_token * c.tokens - TOY.kv_bytes_token * continued
        assert a[0] - a[1] == pytest.approx(per_recomputed)


def test_analytic_model_round_trips_through_json(tmp_path):
    m = analytic_gpu(LLAMA_7B)
    m.to_json(tmp_path / "m.json", note="x")
    assert CostModel.from_json(tmp_path / "m.json") == m
