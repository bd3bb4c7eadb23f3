"""The local layers' SDPA attention against megatron's own DotProductAttention math: the same
model, weights and batch built with `attention_backend=auto` (SDPA) and `unfused` (megatron's
baddbmm/softmax/bmm) give the same loss and gradients to fp32 rounding, and the cases SDPA does
not mean the same for run megatron's math."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from megatron_ext.config.schema import ModelConfig, ParallelConfig
from megatron_ext.models.gpt import build_gpt_model, layer_spec, transformer_config

VOCAB, BATCH = 256, 2

# name -> ModelConfig fields; each differs from the tiny LLaMA in how attention is called.
MODELS = {
    "llama": {},
    "gqa": dict(num_attention_heads=8, num_query_groups=2),
    "head_dim_64": dict(head_dim=64),
    "qk_layernorm": dict(qk_layernorm=True),
    "mla_value_heads_differ": dict(
        multi_latent_attention=True, q_lora_rank=32, kv_lora_rank=16, qk_head_dim=16, qk_pos_emb_head_dim=8,
        v_head_dim=24,
    ),
    "bf16": dict(precision="bf16"),
}


def loss_and_grads(model: ModelConfig, tokens: torch.Tensor) -> tuple[torch.Tensor, dict]:
    torch.manual_seed(0)
    config = transformer_config(model, ParallelConfig(), on_cpu=True)
    gpt = build_gpt_model(model, config, layer_spec(model, use_te=False), VOCAB, True, True)
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    loss = gpt(tokens, positions, None, labels=tokens.roll(-1, 1)).float().mean()
    loss.backward()
    return loss.detach(), {n: p.grad.float() for n, p in gpt.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", list(MODELS))
def test_sdpa_equals_megatrons_unfused_attention(one_rank_world, name):
    model = dataclasses.replace(ModelConfig(seq_length=64), **MODELS[name])
    tokens = torch.randint(0, VOCAB, (BATCH, model.seq_length), generator=torch.Generator().manual_seed(1))
    calls = []
    sdpa = F.scaled_dot_product_attention

    def counted(*args, **kwargs):
        calls.append(1)
        return sdpa(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(F, "scaled_dot_product_attention", counted)
        fast, fast_grads = loss_and_grads(dataclasses.replace(model, attention_backend="auto"), tokens)
        assert len(calls) == model.num_layers
        reference, grads = loss_and_grads(dataclasses.replace(model, attention_backend="unfused"), tokens)
        assert len(calls) == model.num_layers  # the unfused model never calls SDPA
    tol = dict(rtol=2e-2, atol=2e-2) if model.precision == "bf16" else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fast, reference, **tol)
    assert fast_grads.keys() == grads.keys()
    for n in grads:
        torch.testing.assert_close(fast_grads[n], grads[n], **tol, msg=lambda m, n=n: f"{n}: {m}")


# name -> (ModelConfig fields, whether to train): the cases where SDPA's meaning differs.
MEGATRON_MATH = {
    "attention_dropout_in_training": (dict(attention_dropout=0.1), True),
    "softmax_offsets": (dict(softmax_type="learnable"), True),
    "sliding_window": (dict(window_size=[16, 0]), True),
}


@pytest.mark.parametrize("name", list(MEGATRON_MATH))
def test_cases_sdpa_does_not_mean_run_megatrons_math(one_rank_world, monkeypatch, name):
    fields, train = MEGATRON_MATH[name]
    model = dataclasses.replace(ModelConfig(seq_length=32), **fields)

    def refuse(*args, **kwargs):
        raise AssertionError("SDPA called where megatron's math must run")

    monkeypatch.setattr(F, "scaled_dot_product_attention", refuse)
    tokens = torch.randint(0, VOCAB, (BATCH, model.seq_length), generator=torch.Generator().manual_seed(1))
    loss, _ = loss_and_grads(model, tokens)
    assert torch.isfinite(loss)


def test_a_batch_mask_runs_megatrons_math(one_rank_world, monkeypatch):
    """A mask that comes with the batch (packed samples) may leave a query no key; only megatron's
    softmax has a meaning for it."""
    model = ModelConfig(seq_length=16)
    torch.manual_seed(0)
    gpt = build_gpt_model(model, transformer_config(model, ParallelConfig(), on_cpu=True),
                          layer_spec(model, use_te=False), VOCAB, True, True)
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **k: pytest.fail("SDPA with a batch mask"))
    tokens = torch.randint(0, VOCAB, (BATCH, 16))
    mask = torch.ones(1, 1, 16, 16, dtype=torch.bool).triu(1)
    assert torch.isfinite(gpt(tokens, torch.arange(16).expand_as(tokens), mask, labels=tokens).float().mean())
