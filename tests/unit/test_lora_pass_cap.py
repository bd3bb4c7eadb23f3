"""The planner under the runtime's cap on a pass's tokens (`lora.max_pass_tokens`): a step splits
into passes as the runtime splits it (hand-listed here), its activations are its largest pass's,
the planner's bound holds every capped step the queue can form, and the planner packs more jobs
where the cap lets them fit, each pass of a step costing a pass."""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest

from megatron_ext.config.schema import ModelConfig
from megatron_ext.lora.job import LoraJob
from megatron_ext.lora.planning import planner
from megatron_ext.lora.planning.costmodel import LinearCostModel
from megatron_ext.lora.planning.memory import FP32, Hardware, MemoryModel
from megatron_ext.lora.planning.simulate import simulate
from megatron_ext.lora.planning.workload import shapes_of, split_passes

SHAPES = shapes_of(ModelConfig(name="tiny", num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, vocab_size=256))
UNCAPPED = MemoryModel(SHAPES, FP32, fused_attention=False)
COST = LinearCostModel(SHAPES, (2e-3, 5e-4, 3e-3, 6e-3, 2e-3, 0.4))


def capped(tokens: int | None) -> MemoryModel:
    return dataclasses.replace(UNCAPPED, max_pass_tokens=tokens)


def job(name: str, batch: int = 1, seq: int = 64, rank: int = 8, targets=("linear_qkv", "linear_fc2")) -> LoraJob:
    return LoraJob(name, rank=rank, micro_batch_size=batch, global_batch_size=batch, seq_length=seq, steps=10, target_modules=targets)


# name -> (micro-batches as (samples, length) in slot order, cap, passes)
SPLITS = {
    "no cap: one pass": ([(2, 8), (1, 16)], None, [[0, 1]]),
    "no micro-batches": ([], 10, []),
    "cap below every micro-batch": ([(2, 8), (1, 16)], 1, [[0], [1]]),
    "padding counts": ([(2, 8), (1, 16)], 32, [[0], [1]]),  # 16 + 16 real tokens, padded 3 x 16
    "exactly at the cap": ([(2, 8), (1, 16)], 48, [[0, 1]]),
    "greedy in order, an oversized one alone": ([(1, 8), (1, 8), (4, 8), (1, 8), (1, 8)], 16, [[0, 1], [2], [3, 4]]),
}


@pytest.mark.parametrize("name", sorted(SPLITS))
def test_a_step_splits_into_passes_of_whole_micro_batches(name):
    sizes, cap, passes = SPLITS[name]
    assert split_passes(sizes, cap) == passes


# Micro-batches of 64 (a: 2 x 32), 64 (b: 1 x 64) and 32 (c: 1 x 32) tokens.
STEP = (job("a", batch=2, seq=32, rank=8), job("b", seq=64, rank=16), job("c", seq=32, rank=4, targets=("linear_fc1",)))
# name -> (cap, the step's passes by job index); each pass pads to its own longest sequence.
CAPPED_STEPS = {
    "no cap": (None, [[0, 1, 2]]),
    "b with c, a alone": (128, [[0], [1, 2]]),
    "below every micro-batch": (1, [[0], [1], [2]]),
}


@pytest.mark.parametrize("name", sorted(CAPPED_STEPS))
def test_a_capped_steps_activations_are_its_largest_passes(name):
    cap, passes = CAPPED_STEPS[name]
    largest = max(UNCAPPED.activation_bytes([STEP[i] for i in p], 1, 1) for p in passes)
    memory = capped(cap).per_device(STEP, 1, 1)
    assert memory.activations == largest
    assert memory.adapters == UNCAPPED.per_device(STEP, 1, 1).adapters


def test_the_planners_bound_holds_every_capped_step_of_the_queue():
    rng = random.Random(3)
    for _ in range(30):
        queue = [job(f"j{k}", batch=rng.choice((1, 2, 4)), seq=rng.choice((16, 32, 64)), rank=rng.choice((4, 16)),
                     targets=rng.choice((("linear_qkv",), ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"))))
                 for k in range(4)]
        memory, slots = capped(rng.choice((1, 48, 128, 512))), rng.randint(1, 4)
        bound = memory.activation_bound(queue, slots, 1, 1)
        assert bound <= UNCAPPED.activation_bound(queue, slots, 1, 1)
        for size in range(1, slots + 1):
            for active in itertools.permutations(queue, size):
                assert memory.step_activation_bytes(active, 1, 1) <= bound


def test_with_equal_jobs_the_bound_is_two_jobs_under_a_cap_of_two():
    same = [job(f"s{i}", batch=4, seq=32) for i in range(8)]
    two = UNCAPPED.activation_bytes(same[:2], 1, 1)
    memory = capped(2 * 4 * 32)
    assert memory.step_activation_bytes(same, 1, 1) == memory.activation_bound(same, 8, 1, 1) == two
    assert UNCAPPED.activation_bound(same, 8, 1, 1) == 4 * two


def test_a_cap_lets_more_jobs_share_a_device_and_each_pass_costs_a_pass():
    jobs = tuple(job(f"s{i}", batch=2, seq=64) for i in range(8))
    per_job = UNCAPPED.per_device(jobs[:1], 1, 1).total - UNCAPPED.base_bytes(1)
    hardware = Hardware(1, UNCAPPED.base_bytes(1) + 3 * per_job)
    memory = capped(2 * 2 * 64)
    loose, tight = planner.Problem(jobs, hardware, memory, COST), planner.Problem(jobs, hardware, UNCAPPED, COST)
    assert loose.fits(jobs, 8, (1, 1)) and not tight.fits(jobs, 8, (1, 1))
    assert loose.pass_time(jobs, 1, 1) == pytest.approx(4 * COST.pass_time(jobs[:2], 1, 1), rel=1e-12)
    assert tight.pass_time(jobs, 1, 1) == pytest.approx(COST.pass_time(jobs, 1, 1), rel=1e-12)
    eight = planner.pack_all(loose)
    assert eight is not None and max(simulate(eight, jobs, 1, memory, loose).peak_bytes) <= hardware.usable_bytes
    assert max(simulate(planner.plan(loose).plan, jobs, 1, memory, loose).peak_bytes) <= hardware.usable_bytes
