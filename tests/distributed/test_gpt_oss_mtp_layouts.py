"""gpt-oss's attention and activation and DeepSeek-V3's multi-token prediction train the same at
TP=2 and at PP=2 as on one rank.

The cases run in the model-space harness (test_model_space_layouts.py: a few fp32 SGD steps on
one rank, then at TP=2 and PP=2 from the same initial weights; every loss and every trained
weight, put together from the ranks' shards, must equal the one-rank run's; so must each step's
gradient norm and MTP losses). Learnable softmax offsets drawn per TP rank instead of from the
layout-independent initialisation, a window placed by a stage's local layer number instead of
the global one, a z-loss weighed by a rank's share of the tokens, or an MTP layer whose embedding
copy on the last stage drifts from the first stage's shows as a different loss or weight.

MTP with a zero scaling factor must train exactly as the model without MTP (the term is scaled,
and nothing else of the objective changed); with the default factor it must not.
tests/unit/test_gpt_oss_mtp.py checks each feature against a direct computation.
"""

from __future__ import annotations

import sys

import pytest
import torch

import test_model_space_layouts as harness

UNTIED = dict(tie_embeddings=False)
GPT_OSS = dict(
    window_size=[7, 0],
    window_attn_skip_freq=2,
    softmax_type="learnable",
    activation="quick_geglu",
    glu_linear_offset=1.0,
    # Small enough to bind on the tiny model's pre-activations (~0.2).
    activation_func_clamp_value=0.1,
)
CASES = {
    "gpt_oss": GPT_OSS,
    "gpt_oss_moe": dict(GPT_OSS, **harness.MOE),
    "sliding_window_every_layer": dict(window_size=[5, 0]),
    "softmax_off_by_one": dict(softmax_type="off-by-one"),
    "moe_z_loss": dict(harness.MOE, moe_z_loss_coeff=0.1),
    # megatron-core 0.16 builds MTP under PP with untied embeddings only (config/validate.py).
    # Four layers: also at PP=2 with two virtual stages each (MTP on the last one).
    "mtp": dict(UNTIED, mtp_num_layers=2, num_layers=4),
    # Compared bitwise with the model without MTP, so both run megatron's unfused attention:
    # torch's SDPA rounds the decoder's gradients differently (by an ulp) once a zero-weighted
    # MTP branch shares the graph (tests/unit/test_sdpa_attention.py holds SDPA to megatron's
    # math to rounding).
    "mtp_scale_0": dict(UNTIED, mtp_num_layers=1, mtp_loss_scaling_factor=0.0, attention_backend="unfused"),
    # DeepSeek-V3's combination.
    "mtp_mla_moe": dict(UNTIED, **harness.MLA, **harness.MOE, moe_layer_freq="[0,1]", mtp_num_layers=1),
}
BASELINES = {"untied_baseline": UNTIED, "untied_unfused_baseline": dict(UNTIED, attention_backend="unfused")}
SAME_AS_BASELINE = {"mtp_scale_0"}
harness.ALL_CASES.update({**CASES, **BASELINES})


# MTP rolls its labels across context-parallel ranks, and sits on the last virtual stage.
MTP_LAYOUTS = {**harness.LAYOUTS, "cp2": dict(cp=2), "vpp2": dict(pp=2, vpp=2)}
HARNESS_LAYOUTS = harness.layouts


def layouts(case: str) -> dict:
    return MTP_LAYOUTS if case == "mtp" else HARNESS_LAYOUTS(case)


harness.layouts = layouts


def baseline(case: str) -> str:
    if case == "mtp_scale_0":
        return "untied_unfused_baseline"
    return "untied_baseline" if case.startswith("mtp") else harness.baseline(case)

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    from _torchrun import torchrun

    out = tmp_path_factory.mktemp("gpt_oss_mtp")
    torchrun(__file__, 1, str(out), *CASES, *harness.BASELINES, *BASELINES)
    torchrun(__file__, 2, str(out), *CASES)
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_option_equals_one_rank_at_tp2_and_pp2(launched, case):
    harness.check(launched, case)


@pytest.mark.parametrize("case", list(CASES))
def test_option_changes_the_model(launched, case):
    same = harness.reference_losses(launched, case) == harness.reference_losses(launched, baseline(case))
    assert same == (case in SAME_AS_BASELINE)


def run_recording_step_metrics(case: str, parallel: dict, cache: str) -> dict:
    """The harness's run, plus the `mtp_k loss` metrics and the gradient norm of each step."""
    from megatron_ext.training.trainer import Trainer

    recorded, train_step = [], Trainer.train_step

    def recording(self):
        metrics = train_step(self)
        recorded.append({k: v for k, v in metrics.items() if k.startswith("mtp_") or k == "grad_norm"})
        return metrics

    Trainer.train_step = recording
    try:
        return {**HARNESS_RUN(case, parallel, cache), "step_metrics": recorded}
    finally:
        Trainer.train_step = train_step


def step_metrics(out, case: str, world: int, layout: str, name_start: str) -> list:
    steps = torch.load(out / f"{case}_world{world}_rank0.pt")[layout]["step_metrics"]
    return [{k: v for k, v in step.items() if k.startswith(name_start)} for step in steps]


def mtp_losses(out, case: str, world: int, layout: str) -> list:
    return step_metrics(out, case, world, layout, "mtp_")


@pytest.mark.parametrize("case", list(CASES))
def test_gradient_norm_equals_one_rank(launched, case):
    """Clipping sees the whole model's gradient under every layout."""
    reference = step_metrics(launched, case, 1, "reference", "grad_norm")
    for layout in layouts(case):
        got = step_metrics(launched, case, 2, layout, "grad_norm")
        expected = pytest.approx([s["grad_norm"] for s in reference], rel=harness.LOSS_RTOL)
        assert [s["grad_norm"] for s in got] == expected, f"{case} {layout}"


@pytest.mark.parametrize("case", [c for c in CASES if c.startswith("mtp")])
def test_mtp_losses_are_reported_as_on_one_rank(launched, case):
    reference = mtp_losses(launched, case, 1, "reference")
    layers = CASES[case]["mtp_num_layers"]
    assert [sorted(step) for step in reference] == [[f"mtp_{k + 1} loss" for k in range(layers)]] * harness.STEPS
    # Near ln(vocab) at the start, as the next-token loss: predicting from random weights.
    assert all(3.0 < value < 8.0 for value in reference[0].values()), reference[0]
    # Under CP megatron averages each rank's own per-token mean (its share of the rolled loss
    # mask differs), as Megatron-LM logs it: the trained weights are checked there, not the log.
    for layout in (name for name in layouts(case) if not name.startswith("cp")):
        got = mtp_losses(launched, case, 2, layout)
        for step, expected in zip(got, reference):
            assert step == pytest.approx(expected, rel=harness.LOSS_RTOL), f"{case} {layout}"


if __name__ == "__main__":
    HARNESS_RUN, harness.run = harness.run, run_recording_step_metrics
    harness.worker(sys.argv[1], *sys.argv[2:])
