"""gpt-oss's attention and activation, and multi-token prediction, against direct computations.

The attention of each built layer is compared with attention written out here (causal mask, the
sliding window of keys i-L..i where the layer is windowed, a sink logit per head in the softmax's
denominator); the gated MLP with x·sigmoid(1.702x) of the clamped gate times the clamped linear
half plus its offset. Multi-token prediction must add its loss to the objective scaled by
mtp_loss_scaling_factor: the trunk's gradient is the next-token gradient (equal to the same
weights without MTP) plus the factor times a non-zero MTP gradient. The TP=2 / PP=2 equality of
all of them is tests/distributed/test_gpt_oss_mtp_layouts.py.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import pytest
import torch

from megatron_ext.config.schema import Config, ModelConfig, ParallelConfig
from megatron_ext.config.validate import violations
from megatron_ext.models.gpt import build_gpt_model, layer_spec, transformer_config

VOCAB = 256
BASE = ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, seq_length=16)
SEQ, BATCH = 16, 2


def build(model: ModelConfig):
    config = transformer_config(model, ParallelConfig(), on_cpu=True)
    return build_gpt_model(model, config, layer_spec(model, use_te=False), VOCAB, True, True)


def attention_by_hand(q, k, v, window: Optional[tuple], offset: Optional[torch.Tensor]) -> torch.Tensor:
    """[s, b, heads, d] queries, keys, values -> [s, b, heads * d]."""
    s, b, heads, d = q.shape
    scores = torch.einsum("ibnd,jbnd->bnij", q, k) / math.sqrt(d)
    query, key = torch.arange(s)[:, None], torch.arange(s)[None, :]
    hidden = key > query
    if window is not None:
        hidden |= key < query - window[0]
    scores = scores.masked_fill(hidden, float("-inf"))
    if offset is not None:
        sink = offset.reshape(1, heads, 1, 1).expand(b, heads, s, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return torch.einsum("bnij,jbnd->ibnd", probs, v).reshape(s, b, heads * d)


# name -> (ModelConfig fields, the window each of the two layers must apply)
ATTENTION_CASES = {
    "window_skips_every_second_layer": (dict(window_size=[3, 0], window_attn_skip_freq=2), [(3, 0), None]),
    "window_every_layer": (dict(window_size=[3, 0]), [(3, 0), (3, 0)]),
    "learnable_sinks": (dict(softmax_type="learnable"), [None, None]),
    "off_by_one": (dict(softmax_type="off-by-one"), [None, None]),
    "gpt_oss": (dict(window_size=[5, 0], window_attn_skip_freq=2, softmax_type="learnable"), [(5, 0), None]),
}


@pytest.mark.parametrize("case", list(ATTENTION_CASES))
def test_attention_equals_direct_computation(one_rank_world, case):
    fields, windows = ATTENTION_CASES[case]
    model = build(dataclasses.replace(BASE, **fields))
    torch.manual_seed(0)
    heads, d = BASE.num_attention_heads, BASE.hidden_size // BASE.num_attention_heads
    q, k, v = (torch.randn(SEQ, BATCH, heads, d) for _ in range(3))
    for layer, window in zip(model.decoder.layers, windows):
        core = layer.self_attention.core_attention
        offset = core.softmax_offset
        if fields.get("softmax_type") == "learnable":
            assert offset.abs().sum() > 0, "the sinks were not initialised"
        expected = attention_by_hand(q, k, v, window, None if offset is None else offset.detach())
        got = core(q, k, v, None)
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)


def test_windowed_attention_differs_from_full(one_rank_world):
    """The window binds at this sequence length: the direct computation above is not vacuous."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(SEQ, BATCH, 4, 16) for _ in range(3))
    assert not torch.allclose(attention_by_hand(q, k, v, (3, 0), None), attention_by_hand(q, k, v, None, None))


def test_quick_geglu_with_offset_and_clamp_equals_direct_computation(one_rank_world):
    clamp, offset = 0.1, 1.0
    fields = dict(activation="quick_geglu", glu_linear_offset=offset, activation_func_clamp_value=clamp)
    mlp = build(dataclasses.replace(BASE, **fields)).decoder.layers[0].mlp
    torch.manual_seed(0)
    x = torch.randn(SEQ, BATCH, BASE.hidden_size)
    fc1 = x @ mlp.linear_fc1.weight.t()
    assert (fc1.abs() > clamp).any() and (fc1.abs() < clamp).any(), "the clamp must bind on some values only"
    gate, linear = fc1.chunk(2, dim=-1)
    gate, linear = gate.clamp(max=clamp), linear.clamp(-clamp, clamp)
    expected = (gate * torch.sigmoid(1.702 * gate) * (linear + offset)) @ mlp.linear_fc2.weight.t()
    got, _ = mlp(x)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)


def trunk_gradients(model, tokens, labels, loss_mask) -> dict:
    """Gradient of the summed next-token loss (what megatron's schedule back-propagates) for
    every parameter outside the MTP block."""
    model.zero_grad(set_to_none=True)
    kwargs = {"loss_mask": loss_mask} if model.config.mtp_num_layers else {}
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    losses = model(tokens, positions, None, labels=labels, **kwargs)
    (losses * loss_mask).sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if not n.startswith("mtp.")}


def test_mtp_adds_its_loss_scaled_by_the_factor(one_rank_world):
    torch.manual_seed(0)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ))
    labels = torch.roll(tokens, -1, dims=1)
    loss_mask = torch.ones(BATCH, SEQ)
    with_mtp = build(dataclasses.replace(BASE, mtp_num_layers=1))
    without = build(BASE)
    without.load_state_dict({k: v for k, v in with_mtp.state_dict().items() if not k.startswith("mtp.")})
    grads = {}
    for factor in (0.0, 0.1, 0.2):
        with_mtp.config.mtp_loss_scaling_factor = factor
        grads[factor] = trunk_gradients(with_mtp, tokens, labels, loss_mask)
    plain = trunk_gradients(without, tokens, labels, loss_mask)
    assert grads[0.0].keys() == plain.keys()
    for name in plain:
        torch.testing.assert_close(grads[0.0][name], plain[name], atol=1e-7, rtol=1e-6)
        mtp_term = grads[0.1][name] - grads[0.0][name]
        # Differences of fp32 gradients: compared on the scale of the term itself.
        error = (grads[0.2][name] - grads[0.0][name] - 2 * mtp_term).abs().max()
        assert error <= 1e-3 * mtp_term.abs().max() + 1e-9, name
    assert grads[0.1]["embedding.word_embeddings.weight"].sub(plain["embedding.word_embeddings.weight"]).abs().max() > 1e-6


# name -> (ModelConfig fields, ParallelConfig fields, words the one refusal must contain)
REFUSALS = {
    "window_under_local_cp": (dict(window_size=[7, 0]), dict(cp=2), "parallel.cp = 1"),
    "window_one_side": (dict(window_size=[7]), {}, "two numbers"),
    "skip_without_window": (dict(window_attn_skip_freq=2), {}, "needs model.window_size"),
    "clamp_without_glu": (dict(activation="gelu", activation_func_clamp_value=7.0), {}, "gated activation"),
    "softmax_type": (dict(softmax_type="sinks"), {}, "model.softmax_type"),
    "window_on_hybrid": (dict(window_size=[7, 0], arch="hybrid", hybrid_pattern="M*"), {}, "needs model.arch=gpt"),
    "mtp_zero_layers": (dict(mtp_num_layers=0), {}, "model.mtp_num_layers"),
    "mtp_hybrid": (dict(mtp_num_layers=1, arch="hybrid", hybrid_pattern="M*"), {}, "model.arch=gpt"),
    "mtp_tied_under_pp": (dict(mtp_num_layers=1), dict(pp=2), "model.tie_embeddings=false"),
    "mtp_learned_positions_under_pp": (
        dict(mtp_num_layers=1, tie_embeddings=False, position_embedding_type="learned_absolute"),
        dict(pp=2),
        "other than learned_absolute",
    ),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_rules_refuse_what_megatron_cannot_build(case):
    model, parallel, words = REFUSALS[case]
    cfg = Config(model=dataclasses.replace(BASE, **model), parallel=ParallelConfig(**parallel))
    found = [text for _, text in violations(cfg, 4, "cpu")]
    assert any(words in text for text in found), found


GPT_OSS_FLAGS = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --quick-geglu --glu-linear-offset 1.0 "
    "--activation-func-clamp-value 7.0 --softmax-type learnable --window-size 127,0 --window-attn-skip-freq 2 "
    "--moe-z-loss-coeff 1e-3 --mtp-num-layers 1 --mtp-loss-scaling-factor 0.2 --enable-gpt-oss"
)


def test_megatron_lm_flags_reach_the_model_space():
    from megatron_ext.config.mlm_args import mlm_args_to_overrides

    overrides = mlm_args_to_overrides(GPT_OSS_FLAGS.split())
    for expected in (
        "model.activation=quick_geglu",
        # Megatron-LM's 4h: the 8h/3 rule is --swiglu's only.
        "model.ffn_hidden_size=256",
        "model.glu_linear_offset=1.0",
        "model.activation_func_clamp_value=7.0",
        "model.softmax_type=learnable",
        "model.window_size=[127,0]",
        "model.window_attn_skip_freq=2",
        "model.moe_z_loss_coeff=0.001",
        "model.mtp_num_layers=1",
        "model.mtp_loss_scaling_factor=0.2",
    ):
        assert expected in overrides, expected


@pytest.mark.parametrize(
    "flags, words",
    [
        ("--window-size 127", "--window-size 127: two integers"),
        ("--window-size 127,0 --window-attn-skip-freq [1,0]*2", "per-layer patterns are not supported"),
        ("--swiglu --quick-geglu", "--swiglu and --quick-geglu are exclusive"),
    ],
)
def test_megatron_lm_flags_refused_with_the_flag(flags, words):
    from megatron_ext.config.mlm_args import MlmArgsError, mlm_args_to_overrides

    with pytest.raises(MlmArgsError) as info:
        mlm_args_to_overrides(f"--num-layers 2 {flags}".split())
    assert words in str(info.value)
