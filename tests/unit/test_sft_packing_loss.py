"""A packed SFT sample trains as its conversations one by one: megatron's GPTModel, through the
trainer's own forward_step, gives a packed batch the loss sum (and the gradients) of the same
conversations each in a sample of its own, to fp32 rounding. RoPE and learned absolute
positions (which read the restarted position ids)."""

from __future__ import annotations

import dataclasses

import numpy
import pytest
import torch

from megatron_ext.config.store import MODEL_PRESETS
from megatron_ext.data.datasets import _collate
from megatron_ext.data.sft.dataset import Conversations, SFTDataset
from megatron_ext.training.step import forward_step

SEQ = 48
MODELS = {
    "llama_rope": dataclasses.replace(MODEL_PRESETS["llama_tiny"], seq_length=SEQ, vocab_size=96),
    "gpt3_learned_positions": dataclasses.replace(
        MODEL_PRESETS["gpt3_tiny"], seq_length=SEQ, vocab_size=96, hidden_dropout=0.0, attention_dropout=0.0
    ),
}


def _conversations(lengths: list[int], vocab: int) -> Conversations:
    rng = numpy.random.default_rng(0)
    ids = rng.integers(0, vocab, size=sum(lengths))
    assistant = numpy.concatenate([numpy.arange(n) >= n // 2 for n in lengths])  # the second half answers
    return Conversations(ids, assistant, numpy.cumsum([0, *lengths]), [f"c:{i}" for i in range(len(lengths))])


def _loss_and_grads(model, samples: list[dict]) -> tuple[float, int, dict[str, torch.Tensor]]:
    model.zero_grad()
    output, loss_func = forward_step(iter([_collate(samples)]), model)
    loss_sum, tokens, _ = loss_func(output)
    loss_sum.backward()
    return float(loss_sum), int(tokens), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("name", MODELS)
def test_packed_batch_has_the_loss_and_gradients_of_its_conversations_alone(one_rank_world, name):
    from megatron_ext.models.convert.world import build_model
    from megatron_ext.models.gpt import padded_vocab_size

    cfg = MODELS[name]
    model = build_model(cfg, padded_vocab_size(cfg.vocab_size, cfg, 1))[0]
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape) * 0.2)
    conversations = _conversations([11, 17, 9, 20, 6, 14], cfg.vocab_size)
    everyone = list(range(len(conversations)))
    packed = SFTDataset(conversations, everyone, SEQ, num_samples=1, seed=0, pack=True, pad=0)
    alone = SFTDataset(conversations, everyone, SEQ, num_samples=1, seed=0, pack=False, pad=0)
    assert any(len(s) > 2 for s in packed.samples)  # conversations really share samples
    assert sorted(i for s in packed.samples for i in s) == everyone == sorted(i for s in alone.samples for i in s)

    packed_loss, packed_tokens, packed_grads = _loss_and_grads(model, [packed[i] for i in range(len(packed))])
    alone_loss, alone_tokens, alone_grads = _loss_and_grads(model, [alone[i] for i in range(len(alone))])
    assert packed_tokens == alone_tokens == sum(int(conversations.piece(i)[1][1:].sum()) for i in everyone)
    assert packed_loss == pytest.approx(alone_loss, rel=1e-5)
    for key, grad in alone_grads.items():
        torch.testing.assert_close(packed_grads[key], grad, rtol=1e-4, atol=1e-6, msg=key)
