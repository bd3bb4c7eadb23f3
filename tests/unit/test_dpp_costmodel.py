"""DPP cost model: the calibration's least-squares fits recover known parameters from synthetic
measurements; activation bytes are linear in the recompute count (the ILP's assumption) and
keep K/V only for slices later slices attend to; a fitted model survives a JSON round trip;
models written before the separate q*p / q^2 coefficients and the head's fixed and backward
terms give the same numbers; `slice_tokens` inverts the forward time exactly."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from megatron_ext.dpp.planning.costmodel import CostModel, analytic_gpu, LLAMA_7B
from megatron_ext.dpp.planning.plan import Chunk, Segment
from megatron_ext.dpp.tools.calibrate import HeadSample, Sample, fit_backward, fit_head, fit_memory, fit_time, head_errors, relative_errors
from tests.unit._dpp_cases import TOY

REPO = Path(__file__).resolve().parents[2]

# name -> (gamma, alpha, beta (q*p), beta_self (q^2), per prefix token, bwd ratio, noise)
FITS = {
    "exact, causal half": (2e-4, 3e-5, 5e-8, 2.5e-8, 0.0, 2.2, 0.0),
    "1% noise": (5e-4, 1e-5, 2e-8, 1e-8, 0.0, 1.9, 0.01),
    "attention-heavy": (1e-4, 1e-6, 4e-7, 2e-7, 0.0, 2.5, 0.0),
    # a kernel that computes the masked half too: the q^2 term as large as the q*p one
    "full square": (3e-3, 1e-5, 2e-8, 2e-8, 0.0, 2.0, 0.0),
    "self far below prefix": (1e-3, 7e-6, 3e-8, 2e-9, 0.0, 1.8, 0.0),
    "full square, 1% noise": (3e-3, 1e-5, 2e-8, 2.4e-8, 0.0, 2.0, 0.01),
    # the cached prefix's K/V joined to every slice (this machine's calibration: ~3e-7 s)
    "per prefix token": (3e-3, 8e-6, 1.6e-8, 1.1e-8, 3e-7, 1.8, 0.0),
    "per prefix token, 1% noise": (3e-3, 8e-6, 1.6e-8, 1.1e-8, 3e-7, 1.8, 0.01),
}


@pytest.mark.parametrize("name", FITS)
def test_time_fit_recovers_known_parameters(name):
    gamma, alpha, beta, beta_self, per_prefix, ratio, noise = FITS[name]
    rng = np.random.default_rng(0)
    samples = []
    for q in (64, 128, 256, 512, 1024):
        for p in (0, 256, 1024, 2048):
            t = gamma + alpha * q + beta * q * p + beta_self * q * q + per_prefix * p
            samples.append(Sample(q, p, t * (1 + noise * rng.standard_normal()), ratio * t * (1 + noise * rng.standard_normal()), 1.0))
    g, a, b, bs, pp, r = fit_time(samples)
    bg, ba, bb, bbs, bpp = fit_backward(samples)
    assert (ba, bb, bbs) == pytest.approx((ratio * alpha, ratio * beta, ratio * beta_self), rel=1e-6 + 5 * noise)
    assert bg == pytest.approx(ratio * gamma, rel=1e-6 + 30 * noise)
    # gamma is a small part of most samples, so noise moves it most
    assert (a, b, bs, r) == pytest.approx((alpha, beta, beta_self, ratio), rel=1e-6 + 5 * noise)
    assert g == pytest.approx(gamma, rel=1e-6 + 30 * noise)
    # the prefix term is small beside q * p on most samples: noise moves it most too
    assert (pp, bpp) == pytest.approx((per_prefix, ratio * per_prefix), rel=1e-6 + 30 * noise, abs=1e-11 + 3e-6 * noise)
    fitted = CostModel(alpha=a, beta=b, beta_self=bs, gamma=g, bwd_ratio=r, bwd_alpha=ba, bwd_beta=bb, bwd_beta_self=bbs,
                       bwd_gamma=bg, prefix_s_token=pp, bwd_prefix_s_token=bpp, act_bytes_token=1.0)
    errors = relative_errors(fitted, samples)
    assert errors["fwd_mean"] <= 2 * noise + 1e-9 and errors["bwd_mean"] <= 2 * noise + 1e-9


# name -> (forward fixed s, s/token, backward fixed s, s/token, noise)
HEAD_FITS = {
    "per token only": (0.0, 4e-6, 0.0, 6e-6, 0.0),
    "fixed-dominated": (1.2e-3, 2e-6, 5e-4, 2.5e-6, 0.0),
    "backward below forward": (3e-4, 9e-6, 1e-4, 5e-6, 0.0),
    "1% noise": (1e-3, 4e-6, 2e-3, 1.2e-5, 0.01),
}


@pytest.mark.parametrize("name", HEAD_FITS)
def test_head_fit_recovers_known_parameters(name):
    fg, fwd, bg, bwd, noise = HEAD_FITS[name]
    rng = np.random.default_rng(1)
    samples = [HeadSample(n, (fg + fwd * n) * (1 + noise * rng.standard_normal()), (bg + bwd * n) * (1 + noise * rng.standard_normal()))
               for n in (64, 128, 256, 512, 1024)]
    got = fit_head(samples)
    assert got == pytest.approx((fg, fwd, bg, bwd), rel=1e-6 + 30 * noise, abs=1e-12)
    model = CostModel(alpha=0.0, beta=0.0, gamma=0.0, bwd_ratio=2.0, head_gamma=got[0], head_s_token=got[1],
                      head_bwd_gamma=got[2], head_bwd_s_token=got[3])
    errors = head_errors(model, samples)
    assert errors["fwd_max"] <= 4 * noise + 1e-9 and errors["bwd_max"] <= 4 * noise + 1e-9
    n = samples[-1].tokens
    assert errors["bwd_by_ratio_max"] >= abs(2.0 * (fg + fwd * n) / (bg + bwd * n) - 1) * (1 - 10 * noise)


CHUNKS = {
    "split": Chunk(0, "split", (Segment(0, 0, 4096),)),
    "tail": Chunk(1, "split", (Segment(0, 4096, 2048),)),
    "hybrid": Chunk(2, "hybrid", (Segment(0, 6144, 1000), Segment(1, 0, 300), Segment(2, 0, 7))),
}
# (model, chunk) -> (forward_s(8 layers, last), backward_s(8 layers, 3 recomputed, last)), as the
# cost model computed them before beta_self, bwd_beta_self and the head_gamma / head_bwd_* terms existed
BEFORE = {
    ("analytic_gpu", "split"): (0.11128214574545454, 0.26194863236923077),
    ("analytic_gpu", "tail"): (0.07351190049417249, 0.17341753178554775),
    ("analytic_gpu", "hybrid"): (0.055495346511657245, 0.1310527106225286),
    ("measured json", "split"): (1.5364196266299073, 4.138281114275053),
    ("measured json", "tail"): (1.7412915086590066, 4.60568929219221),
    ("measured json", "hybrid"): (1.1162742902462233, 2.941360572832685),
}


def _model(name: str) -> CostModel:
    if name == "analytic_gpu":
        return analytic_gpu(LLAMA_7B)
    return CostModel.from_json(REPO / "scripts/bench/results/dpp_measured.costmodel.json")


@pytest.mark.parametrize("model,chunk", BEFORE)
def test_models_without_the_new_fields_give_the_same_numbers(model, chunk):
    m, c = _model(model), CHUNKS[chunk]
    assert (m.beta_self, m.bwd_beta_self, m.head_gamma, m.head_bwd_s_token, m.head_bwd_gamma) == (None, None, 0.0, None, None)
    assert (m.prefix_s_token, m.bwd_prefix_s_token, m.runtime_scale_tokens) == (0.0, 0.0, None)
    assert (m.forward_s(c, 8, True), m.backward_s(c, 8, 3, True)) == BEFORE[model, chunk]
    # the defaults spelled out: the same model up to rounding
    spelled = dataclasses.replace(m, beta_self=m.beta / 2, bwd_beta_self=None if m.bwd_beta is None else m.bwd_beta / 2,
                                  head_bwd_s_token=m.bwd_ratio * m.head_s_token, head_bwd_gamma=0.0)
    assert (spelled.forward_s(c, 8, True), spelled.backward_s(c, 8, 3, True)) == pytest.approx(BEFORE[model, chunk], rel=1e-13)


SLICE_MODELS = {
    "toy, causal half": TOY,
    "toy, full square": dataclasses.replace(TOY, beta_self=TOY.beta),
    "toy, no t0, self only": dataclasses.replace(TOY, t0=0.0, beta_self=3e-9, beta=0.0),
    "linear (no attention)": dataclasses.replace(TOY, beta=0.0, beta_self=0.0),
    "analytic_gpu": analytic_gpu(LLAMA_7B),
    # this machine's calibration: a prefix term of ~20 tokens' dense work per prefix token
    "per prefix token, no t0": dataclasses.replace(TOY, t0=0.0, prefix_s_token=2e-5),
}


@pytest.mark.parametrize("name", SLICE_MODELS)
@pytest.mark.parametrize("prefix", [0, 700, 20000])
def test_slice_tokens_is_the_exact_inverse_by_brute_force(name, prefix):
    m = SLICE_MODELS[name]
    times = [m.layer_forward_s(Chunk(0, "split", (Segment(0, prefix, n),))) for n in range(1, 1500)]
    # exactly at a slice's time (the boundary rounding decides), just off it, and below any slice
    targets = [times[k] * f for k in (0, 9, 499, 1200) for f in (1.0, 1 - 1e-15, 1 + 1e-15)] + [times[0] * 0.999]
    for target in targets:
        expected = sum(1 for t in times if t <= target)  # times rise with the length
        assert m.slice_tokens(target, prefix) == expected, target


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


def test_a_recomputed_block_keeps_its_other_inputs_once():
    model = dataclasses.replace(TOY, ckpt_block_bytes_token=32.0)
    chunk = Chunk(0, "packed", (Segment(0, 0, 50),))
    for r in range(5):
        added = model.activation_bytes(chunk, [50], 4, r, last=False) - TOY.activation_bytes(chunk, [50], 4, r, last=False)
        assert added == (32.0 * 50 if r else 0.0)


def test_padding_costs_dense_work_and_token_bytes_but_no_attention():
    """A padded chunk takes what its segments take plus, per padding token, the dense parts'
    time (forward and backward) and a token's bytes; its attention terms do not grow."""
    # the chunk attention's memory terms (fit_activation_bytes): no per-pair or per-key bytes
    model = dataclasses.replace(TOY, t0=0.0, bwd_alpha=3e-6, bwd_beta=5e-9, bwd_gamma=2e-4, act_bytes_attn=0.0,
                                act_bytes_key=0.0)
    lengths = [300, 50]
    plain = Chunk(0, "hybrid", (Segment(0, 200, 100), Segment(1, 0, 50)))
    pad = dataclasses.replace(plain, padding=3)
    assert pad.tokens == plain.tokens + 3 and pad.sequence_tokens == plain.tokens
    assert model.layer_forward_s(pad) == pytest.approx(model.layer_forward_s(plain) + 3 * model.alpha)
    assert model.layer_backward_s(pad) == pytest.approx(model.layer_backward_s(plain) + 3 * model.bwd_alpha)
    assert model.attention_backward_bytes(pad) == model.attention_backward_bytes(plain)
    for r in (0, 2):
        kept = model.activation_bytes(pad, lengths, 4, r, last=True) - model.activation_bytes(plain, lengths, 4, r, last=True)
        per_token = (4 - r) * model.act_bytes_token + r * model.ckpt_bytes_token + model.head_bytes_token
        assert kept == pytest.approx(3 * per_token)


def test_analytic_model_round_trips_through_json(tmp_path):
    m = analytic_gpu(LLAMA_7B)
    m.to_json(tmp_path / "m.json", note="x")
    assert CostModel.from_json(tmp_path / "m.json") == m


def test_calibration_times_the_runtime_layer_and_the_head(one_rank_world):
    from megatron_ext.dpp.tools.calibrate import default_vocab, measure

    samples, head, shape, rounds = measure("llama_tiny", (16, 32), (0, 24), repeats=3, vocab=default_vocab("llama_tiny"))
    assert [(s.q, s.prefix) for s in samples] == [(16, 0), (16, 24), (32, 0), (32, 24)]
    # every round kept; a sample is each point's median round
    assert sorted(rounds) == ["head 16", "head 32", "layer 16 0", "layer 16 24", "layer 32 0", "layer 32 24"]
    assert all(len(f) == len(b) == 3 for f, b in rounds.values())
    assert [(s.fwd_s, s.bwd_s) for s in samples] == [tuple(sorted(x)[1] for x in rounds[f"layer {s.q} {s.prefix}"])
                                                     for s in samples]
    assert [h.tokens for h in head] == [16, 32] and all(h.fwd_s > 0 and h.bwd_s > 0 for h in head)
    assert shape["padded_vocab"] == 384  # the byte tokenizer's 258 ids, padded to 128
    # ChunkCoreAttention saves only the slice's own q/k/v (the prefix's K/V live in the chunk
    # cache), where megatron's DotProductAttention would save the prefix and the scores too
    by_point = {(s.q, s.prefix): s.act_bytes for s in samples}
    assert by_point[16, 0] == by_point[16, 24] and by_point[32, 0] == by_point[32, 24] == 2 * by_point[16, 0]


def test_layers_are_timed_by_cpu_time_on_the_cpu():
    import time

    import torch

    from megatron_ext.dpp.tools.calibrate import device_clock
    from megatron_ext.platform.device import wall_clock

    assert device_clock(torch.device("cpu")) is time.process_time
    assert wall_clock(torch.device("cpu")) is time.perf_counter


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a GPU")
def test_calibration_times_layers_on_the_gpu(one_rank_world):
    import torch

    from megatron_ext.dpp.tools.calibrate import default_vocab, measure

    samples, head, _, _ = measure("llama_tiny", (64, 128), (0, 64), repeats=2, vocab=default_vocab("llama_tiny"),
                                  device=torch.device("cuda", 0))
    assert all(s.fwd_s > 0 and s.bwd_s > 0 for s in samples) and all(h.fwd_s > 0 for h in head)


def test_rounds_reduce_to_their_min_or_median():
    from megatron_ext.dpp.tools.calibrate import reduce_rounds

    timed = {("layer", 64, 0): ([0.3, 0.1, 0.2, 0.9], [0.5, 0.7, 0.4], 100)}
    assert reduce_rounds(timed, "min") == {("layer", 64, 0): (0.1, 0.4, 100)}
    assert reduce_rounds(timed, "median") == {("layer", 64, 0): (0.25, 0.5, 100)}
    with pytest.raises(ValueError, match="statistic 'mean'"):
        reduce_rounds(timed, "mean")


# what the run changes (model, parallel) -> the words the refusal must name (None: accepted);
# the cost model was calibrated for llama_tiny at TP=1
CALIBRATED_FOR = {
    "same_model": ({}, {}, None),
    "wider": ({"hidden_size": 256}, {}, "hidden 128 (this run: 256)"),
    "other_ffn": ({"ffn_hidden_size": 512}, {}, "ffn 352"),
    "moe_layers": ({"num_experts": 4, "moe_ffn_hidden_size": 176}, {}, "num_experts None (this run: 4)"),
    "tensor_parallel": ({}, {"tp": 2}, "tp 1 (this run: 2)"),
    "sequence_parallel": ({}, {"tp": 2, "sequence_parallel": True}, "sequence_parallel False (this run: True)"),
}


@pytest.mark.parametrize("case", CALIBRATED_FOR)
def test_a_cost_model_calibrated_for_another_layer_shape_is_refused(tmp_path, case):
    from megatron_ext.config.schema import ParallelConfig
    from megatron_ext.config.store import MODEL_PRESETS
    from megatron_ext.dpp.config import check_calibrated_for, layer_shape

    calibrated = MODEL_PRESETS["llama_tiny"]
    path = tmp_path / "cost.json"
    shape = dict(layer_shape(calibrated), layer_params=1, tp=1, sequence_parallel=False)
    CostModel(alpha=1e-6, beta=1e-9, gamma=1e-4).to_json(path, shape=shape)
    model, parallel, message = CALIBRATED_FOR[case]
    run = (dataclasses.replace(calibrated, **model), ParallelConfig(**parallel))
    if message is None:
        check_calibrated_for(str(path), *run)
    else:
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            check_calibrated_for(str(path), *run)


def test_a_cost_model_written_before_a_shape_field_was_recorded_is_compared_on_the_others(tmp_path):
    from megatron_ext.config.store import MODEL_PRESETS
    from megatron_ext.dpp.config import check_calibrated_for

    path = tmp_path / "old.json"
    CostModel(alpha=1e-6, beta=1e-9, gamma=1e-4).to_json(path, shape={"hidden": 128, "ffn": 352, "heads": 4, "kv_heads": 4})
    check_calibrated_for(str(path), dataclasses.replace(MODEL_PRESETS["llama_tiny"], num_experts=4))
    with pytest.raises(ValueError, match="heads 4"):
        check_calibrated_for(str(path), dataclasses.replace(MODEL_PRESETS["llama_tiny"], num_attention_heads=8))
