"""The planner's memory and cost models: the memory model counts what the packed runtime
really allocates (megatron's frozen GPTModel, the adapters and AdamW state of layers.py /
optim.py); the cost-model fit recovers a known model; both cost models are monotone (adding a
job never makes a pass faster), which the planner's lower bound relies on."""

from __future__ import annotations

import random

import pytest
import torch

from megatron_ext.config.schema import ModelConfig
from megatron_ext.lora.job import LoraJob
from megatron_ext.lora.planning.costmodel import A100_80GB, GpuCostModel, LinearCostModel, Sample, fit
from megatron_ext.lora.planning.memory import FP32, MemoryModel
from megatron_ext.lora.planning.workload import replica_work, shapes_of

VOCAB = 128
MODEL = ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2, vocab_size=VOCAB)
SHAPES = shapes_of(MODEL)
LLAMA_8B = ModelConfig(name="llama3_8b", num_layers=32, hidden_size=4096, ffn_hidden_size=14336,
                       num_attention_heads=32, num_query_groups=8, vocab_size=128256)
TARGETS = {
    "all": ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"),
    "attention": ("linear_qkv", "linear_proj"),
    "mlp out": ("linear_fc2",),
}


@pytest.mark.parametrize("targets", sorted(TARGETS))
def test_memory_model_counts_the_runtimes_parameters_and_adam_state(one_rank_world, targets):
    from megatron_ext.lora.runtime.base import build_base
    from megatron_ext.lora.runtime.layers import install_job
    from megatron_ext.lora.runtime.optim import JobOptimizer

    model, wrappers, _ = build_base(MODEL, VOCAB)
    base = sum(p.numel() for p in model.parameters())
    assert base == SHAPES.base_parameters()
    job = LoraJob("j", rank=6, target_modules=TARGETS[targets])
    params = install_job(wrappers, 0, job)
    assert sum(p.numel() for p in params) == SHAPES.adapter_parameters_per_device(6, job.target_modules, 1)
    optimizer = JobOptimizer(job, params, [False] * len(params))
    for p in params:
        p.grad = torch.ones_like(p)
    grads = sum(p.grad.numel() * p.grad.element_size() for p in params)
    optimizer.step()
    state = sum(t.numel() * t.element_size() for s in optimizer.optimizer.state.values() for t in s.values() if t.dim())
    held = sum(p.numel() * p.element_size() for p in params) + grads + state
    assert held == MemoryModel(SHAPES, FP32).adapter_bytes(job, 1)
    assert not any(p.requires_grad for n, p in model.named_parameters() if ".adapters." not in n)


def test_adapter_shards_over_tp_add_up_to_the_whole_adapter():
    """Per device, one factor of each adapted linear is split and the other replicated: tp
    devices hold the whole adapter once plus tp - 1 extra copies of the replicated factors."""
    shapes = shapes_of(LLAMA_8B)
    for tp in (1, 2, 4, 8):
        per_device = shapes.adapter_parameters_per_device(16, TARGETS["all"], tp)
        replicated = shapes.layers * sum(16 * (i if t in ("linear_qkv", "linear_fc1") else o) for t, (i, o) in shapes.linears.items())
        assert tp * per_device == shapes.adapter_parameters(16, TARGETS["all"]) + (tp - 1) * replicated


def test_fit_recovers_a_known_cost_model_and_predicts_held_out_packs():
    truth = LinearCostModel(SHAPES, (3e-3, 1e-3, 2e-2, 4e-2, 1e-2, 0.0))
    rng = random.Random(0)

    def sample(i: int) -> Sample:
        jobs = tuple(
            LoraJob(f"j{k}", rank=rng.choice((2, 8, 32)), micro_batch_size=(b := rng.choice((1, 2, 4))), global_batch_size=b,
                    seq_length=rng.choice((16, 64, 128)), target_modules=TARGETS[rng.choice(sorted(TARGETS))])
            for k in range(rng.randint(1, 6))
        )
        return Sample(jobs, 1, 1, truth.pass_time(jobs, 1, 1))

    samples = [sample(i) for i in range(30)]
    result = fit(SHAPES, samples[:20], samples[20:])
    assert result.heldout_error < 1e-6 and result.train_error < 1e-6
    assert result.model.coefficients == pytest.approx(truth.coefficients, rel=1e-4, abs=1e-9)


COSTS = {
    "a100 roofline, 8B": (GpuCostModel(shapes_of(LLAMA_8B), A100_80GB), (1, 2, 8)),
    "linear": (LinearCostModel(SHAPES, (3e-3, 1e-3, 2e-2, 4e-2, 1e-2, 0.5)), (1, 2)),
}


@pytest.mark.parametrize("name", sorted(COSTS))
def test_a_pass_with_one_more_job_is_never_faster(name):
    cost, tps = COSTS[name]
    rng = random.Random(1)
    for _ in range(40):
        jobs = [
            LoraJob(f"j{k}", rank=rng.choice((4, 16, 64)), micro_batch_size=(b := rng.choice((1, 4))), global_batch_size=b * rng.choice((1, 2)),
                    seq_length=rng.choice((128, 512, 2048)), target_modules=TARGETS[rng.choice(sorted(TARGETS))])
            for k in range(rng.randint(2, 6))
        ]
        tp, dp = rng.choice(tps), rng.choice((1, 2))
        assert cost.pass_time(jobs, tp, dp) >= cost.pass_time(jobs[:-1], tp, dp)


def test_dp_splits_a_jobs_samples_and_never_loses_one():
    for batch, micro in ((1, 1), (4, 1), (4, 4), (8, 2), (12, 4)):
        job = LoraJob("j", micro_batch_size=micro, global_batch_size=batch)
        for dp in (1, 2, 4, 8):
            work = replica_work(job, dp)
            assert work.samples_per_pass <= micro
            assert dp * work.samples_per_pass * work.passes_per_step >= batch
