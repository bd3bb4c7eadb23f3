"""Megatron-LM's operation count for --log-throughput, against one derived from the weights of
the megatron model actually built: 6 operations per weight element per token (a multiply-add
forward, twice that backward), routed experts at top-k of their number, plus the causal half of
the attention scores and their product with the values."""

from __future__ import annotations

import pytest

from megatron_ext.config.schema import ModelConfig, ParallelConfig
from megatron_ext.models.arch import architecture
from megatron_ext.config.moe_pattern import moe_layer_pattern
from megatron_ext.training.flops import flops_per_iteration

VOCAB, GBS = 384, 3

CASES = {
    "mha": dict(),
    "gqa": dict(num_query_groups=2),
    "head_dim_apart_from_hidden": dict(head_dim=48),
    "moe_every_layer": dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=96),
}


def _gemm_weights(model) -> tuple[int, int]:
    """(dense, expert) elements of the weights that multiply activations (the router's scores
    and the embedding lookup are not GEMMs Megatron-LM counts; the output layer is counted
    apart, tied or not)."""
    dense = expert = 0
    for name, p in model.named_parameters():
        if p.dim() < 2 or "embedding" in name or "router" in name or "output_layer" in name:
            continue
        if "experts" in name:
            expert += p.numel()
        else:
            dense += p.numel()
    return dense, expert


@pytest.mark.parametrize("fields", CASES.values(), ids=CASES.keys())
def test_flops_match_the_built_model(one_rank_world, fields):
    m = ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=160, num_attention_heads=4, seq_length=16, **fields)
    arch = architecture(m)
    config = arch.transformer_config(m, ParallelConfig(), True)
    model = arch.build(m, config, arch.spec(m, True), VOCAB, pre_process=True, post_process=True)
    dense, expert = _gemm_weights(model)
    routed = expert * m.moe_router_topk / m.num_experts if m.num_experts else 0
    tokens = GBS * m.seq_length
    query = (m.head_dim or m.hidden_size // m.num_attention_heads) * m.num_attention_heads
    reference = 6 * tokens * (dense + routed + m.hidden_size * VOCAB) + 6 * GBS * m.seq_length**2 * query * m.num_layers
    assert flops_per_iteration(m, VOCAB, GBS) == pytest.approx(reference, rel=1e-12)


def test_moe_layer_pattern_reads_megatron_expressions():
    m = ModelConfig(num_layers=8, num_experts=4, moe_layer_freq="([0]+[1]*3)*2")
    assert moe_layer_pattern(m) == [0, 1, 1, 1, 0, 1, 1, 1]
    assert moe_layer_pattern(ModelConfig(num_layers=4, num_experts=4, moe_layer_freq="2")) == [1, 0, 1, 0]
