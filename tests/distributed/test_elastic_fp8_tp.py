"""FP8 quantisation-aware distillation at TP=2 is the one-process run, for a LLaMA-style (GPT)
parent, a dense hybrid (Mamba2 / attention / MLP) one and the MoE hybrid (with sequence
parallelism, experts and expert FFN width cut: the experts' scales reduce over the expert TP
group); so is the MoE hybrid at EP=2 and TP=2 x EP=2 (`elastic.budget_share=2`, the reference
with the same value: an EP rank's experts' codes and scales join under their global indices);
so is the GPT parent at PP=2 (one layer per stage, untied embeddings: each stage quantises its own
layers' whole weights, and the export gathers their codes and scales under global layer numbers),
and at PP=2 x VPP=2 (4 layers, two one-layer chunks per rank, untied: every chunk is quantised,
and each chunk's codes and scales join under its layers' global numbers; quantising a rank's
first chunk only put the KD loss 5.7e-4 relative off at step 1, and exporting its scales only
dropped layers 2 and 3's scales from the checkpoint, measured).

Each decoder linear's per-tensor scale is the whole logical tensor's (the shards' amax reduced
with MAX over the weight's TP group), so both TP ranks fake-quantise their blocks on the grid one
process uses for the whole tensor, and the nested checkpoint's FP8 codes are the joined weights
quantised with it. A scale of one shard (its own amax) quantises a rank's block on another grid:
other losses, other codes and scales (all four tests fail with per-shard scales, measured: the
KD losses 3e-4 (GPT) / 1.5e-3 (hybrid) relative off at step 1, up to 6e-2 / 1.4e-2 later; the
MoE hybrid's 1.3e-3, TP=2 x EP=2's 2.1e-3 off; at EP=2, expert scales shared over the EP group put
the losses 2.9e-5 relative off and the expert scales fail the checkpoint's comparison).

Tolerance: fp32 runs that differ in summation order only (row-parallel outputs and the
vocabulary's partition sum all-reduced in two halves): KD losses (about 0.002-0.01) measured up to
4.5e-5 (GPT, with Adam's eps at 1e-5; at the default 1e-8 5.3e-5 on one machine, 2.0e-4 on another)
/ 2.3e-5 (hybrid) / 3.2e-5 (MoE hybrid) / 6.0e-8 (EP=2) / 6.0e-6 (TP=2 x EP=2) relative apart
over four steps; PP=2 and PP=2 x VPP=2 compute what one process does in the same
order (KD losses equal to the bit, measured). Budgets, sizes and router choices
are compared exactly, and at learning rate 0 the nested FP8 checkpoint (codes, scales and every
other tensor) and the standalone FP8 checkpoints sliced from it to the bit.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from test_elastic_hybrid_tp import DENSE, HYBRID, MOE, MOE_LAYOUTS, TP2
from test_elastic_expert_parallel import DRAWS, SHARED
from test_elastic_expert_parallel import LAYOUTS as EP_LAYOUTS
from test_elastic_plugin import COMMON, TRAINED_TP_EPS, VIRTUAL, VIRTUAL_LAYOUT, assert_same_run, run

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

FP8_RUN = ["elastic.fp8=true"]
FROZEN = ["optim.lr=0.0", "optim.min_lr=0.0", "train.iters=2"]
# Per parent and layout: the common overrides, the parent's own, the layout's.
LAYOUTS = {
    # Adam's eps above the near-zero KD gradients' entries, as the BF16 TP test (TRAINED_TP_EPS).
    "gpt": (COMMON, [TRAINED_TP_EPS], TP2),
    "hybrid": (HYBRID, DENSE, TP2),
    "moe_hybrid": (HYBRID, MOE, MOE_LAYOUTS["tp2_sp"]),
    "moe_hybrid_ep2": (HYBRID, [*SHARED, *DRAWS["sample"]], EP_LAYOUTS["ep2"][1]),
    "moe_hybrid_tp2_ep2": (HYBRID, [*SHARED, *DRAWS["micro_batch"]], EP_LAYOUTS["tp2_ep2"][1]),
    # One layer per stage; untied, so no embedding gradient summed over the stages.
    "gpt_pp2": (COMMON, ["model.tie_embeddings=false"], ["launcher.nproc=2", "parallel.pp=2"]),
    # 4 layers, two one-layer chunks per rank (the interleaved schedule), untied.
    "gpt_pp2_vpp2": (COMMON, [*VIRTUAL, "model.tie_embeddings=false"], VIRTUAL_LAYOUT),
}
REL = {
    "gpt": 1e-4,
    "hybrid": 5e-5,
    "moe_hybrid": 1e-4,
    "moe_hybrid_ep2": 5e-7,
    "moe_hybrid_tp2_ep2": 2e-5,
    "gpt_pp2": 1e-12,
    "gpt_pp2_vpp2": 1e-12,
}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality, FP8 codes included (compared as their bytes)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype == torch.float8_e4m3fn:
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return torch.equal(a, b)


def assert_same_state(one: dict, two: dict) -> None:
    assert one.keys() == two.keys()
    for key in one:
        assert same_bits(two[key], one[key]), key


@pytest.mark.parametrize("parent", list(LAYOUTS))
def test_fp8_distillation_equals_one_process(tmp_path, parent):
    """Four QAD steps: the same budgets per sample, sizes, router choices and losses."""
    common, extra, tp2 = LAYOUTS[parent]
    one, _ = run(tmp_path, "one", "train.iters=4", *FP8_RUN, *extra, common=common)
    two, _ = run(tmp_path, "tp", "train.iters=4", *FP8_RUN, *extra, *tp2, common=common)
    assert_same_run(one, two, REL[parent])


@pytest.mark.parametrize("parent", list(LAYOUTS))
def test_fp8_nested_checkpoint_equals_one_process(one_rank_world, tmp_path, parent):
    """At learning rate 0 the student stays the reordered parent: the gathered nested FP8
    checkpoint (codes and scales) equals one process's to the bit, and so does every budget's
    standalone FP8 checkpoint sliced from it."""
    from megatron_ext.elastic.fp8 import FP8, SCALE_SUFFIX
    from megatron_ext.elastic.slicing import slice_nested_fp8

    common, extra, tp2 = LAYOUTS[parent]
    report, one = run(tmp_path, "one", *FROZEN, *FP8_RUN, *extra, common=common)
    _, two = run(tmp_path, "tp", *FROZEN, *FP8_RUN, *extra, *tp2, common=common)
    scaled = [k.removesuffix(SCALE_SUFFIX) for k in one if k.endswith(SCALE_SUFFIX)]
    assert scaled and all(one[k].dtype == FP8 for k in scaled), "no FP8 tensor: vacuous"
    assert_same_state(one, two)
    for budget in report["choices"]:
        subs = [slice_nested_fp8(tmp_path / n / "nested", budget, tmp_path / f"{n}_{budget}") for n in ("one", "tp")]
        sub_one, sub_two = (load_file(str(s / "model.safetensors")) for s in subs)
        assert_same_state(sub_one, sub_two)
    assert any(sub_one[k].numel() < one[k].numel() for k in scaled), "the last budget cuts nothing: vacuous"
