"""The Virtual Parameter Space: what each rank holds, computed in one process from values."""

from __future__ import annotations

import dataclasses

import torch
from megatron.core.tensor_parallel import get_cuda_rng_tracker

from megatron_ext.config.store import MODEL_PRESETS
from megatron_ext.reshard.boxes import numel
from megatron_ext.parallel.layout import ParallelLayout as L
from megatron_ext.reshard.vps import STEP, layout_pieces, rank_pieces

TINY = dataclasses.replace(MODEL_PRESETS["llama_tiny"], vocab_size=256)


def _by_state(pieces) -> dict[str, int]:
    total: dict[str, int] = {}
    for p in pieces:
        total[p.state] = total.get(p.state, 0) + numel(p.box)
    return total


def test_distributed_optimizer_splits_moments_over_dp_and_keeps_weights_whole():
    one, two = layout_pieces(TINY, L(dp=1)), layout_pieces(TINY, L(dp=2))
    weights = _by_state(one)["param"]
    assert _by_state(two)["param"] == 2 * weights  # both replicas hold every weight
    assert _by_state(two)["exp_avg"] == _by_state(one)["exp_avg"] == weights  # one owner each
    assert "main_param" not in _by_state(one)  # fp32: megatron's main params are the weights


def test_swiglu_halves_are_separate_boxes_of_one_parameter():
    pieces = rank_pieces(TINY, L(tp=2), 1)
    fc1 = [p for p in pieces if p.state == "param" and p.name.key.endswith("linear_fc1.weight")]
    ffn, hidden = TINY.ffn_hidden_size, TINY.hidden_size
    layer0 = [p for p in fc1 if p.name.index == (0,)]
    # TP rank 1 holds the second half of the gate rows and of the up rows, one after the other.
    assert [(p.box, p.offset) for p in layer0] == [
        (((ffn // 2, ffn), (0, hidden)), 0),
        (((ffn + ffn // 2, 2 * ffn), (0, hidden)), ffn // 2 * hidden),
    ]


def test_bf16_runs_carry_fp32_main_params_and_the_step():
    bf16 = dataclasses.replace(TINY, precision="bf16")
    pieces = rank_pieces(bf16, L(dp=2), 0)
    dtypes = {p.state: p.dtype for p in pieces}
    assert dtypes == {
        "param": "bfloat16",
        "main_param": "float32",
        "exp_avg": "float32",
        "exp_avg_sq": "float32",
        "step": "float32",
    }
    assert [p.name for p in pieces if p.state == "step"] == [STEP]


def test_without_distributed_optimizer_every_replica_holds_whole_moments():
    pieces = layout_pieces(TINY, L(dp=2, distributed_optimizer=False))
    assert _by_state(pieces)["exp_avg"] == _by_state(pieces)["param"]


def test_standby_ranks_hold_nothing():
    assert rank_pieces(TINY, L(tp=2, world=4), 3) == ()


def test_inside_a_job_computing_pieces_leaves_rng_and_parallel_state_alone(one_rank_world):
    from megatron.core import parallel_state

    torch_state, tracker = torch.get_rng_state(), get_cuda_rng_tracker().get_states()
    pieces = layout_pieces(dataclasses.replace(TINY, num_layers=2), L(tp=2, pp=2))
    assert {p.rank for p in pieces} == {0, 1, 2, 3}
    assert torch.equal(torch.get_rng_state(), torch_state)
    assert all(torch.equal(tracker[k], v) for k, v in get_cuda_rng_tracker().get_states().items())
    assert parallel_state.get_tensor_model_parallel_world_size() == 1
