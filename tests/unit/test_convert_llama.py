"""Hugging Face LLaMA <-> megatron logical tensors: fused QKV order, SwiGLU halves, vocab
padding, tied embeddings, config mapping; and a tiny LLaMA gives transformers' logits in
megatron-core once mapped."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_ext.config.schema import ModelConfig
from megatron_ext.models.convert import llama
from megatron_ext.models.convert.hf_config import model_config_from_hf
from megatron_ext.models.convert.llama import HFAsLogical, logical_names, logical_to_hf
from megatron_ext.models.logical import LogicalName

CFG = ModelConfig(
    num_layers=2, hidden_size=16, ffn_hidden_size=24, num_attention_heads=4, num_query_groups=2, vocab_size=50
)


def random_hf(cfg: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=g) for name, shape in llama.expected_hf_shapes(cfg).items()}


def test_fused_qkv_is_grouped_per_kv_head():
    # head_dim 4: label every row by (tensor, row) and read megatron's order back.
    q = torch.arange(16.0)[:, None]  # 4 heads x 4 rows
    k = 100 + torch.arange(8.0)[:, None]  # 2 groups
    v = 200 + torch.arange(8.0)[:, None]
    rows = llama.fuse_qkv(q, k, v, CFG)[:, 0].tolist()
    group0 = list(range(8)) + [100, 101, 102, 103] + [200, 201, 202, 203]
    group1 = list(range(8, 16)) + [104, 105, 106, 107] + [204, 205, 206, 207]
    assert rows == group0 + group1
    assert all(torch.equal(a, b) for a, b in zip(llama.split_qkv(llama.fuse_qkv(q, k, v, CFG), CFG), (q, k, v)))


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_hf_to_logical_and_back_is_exact(tied):
    cfg = dataclasses.replace(CFG, tie_embeddings=tied)
    hf = random_hf(cfg)
    logical = HFAsLogical(hf, cfg, padded_vocab=64)
    assert set(logical) == set(logical_names(cfg))
    embedding = logical[LogicalName(llama.EMBEDDING)]
    assert embedding.shape == (64, 16) and not embedding[50:].any()  # zero padding rows
    fc1 = logical[LogicalName(llama.FC1, (1,))]
    assert torch.equal(fc1[:24], hf["model.layers.1.mlp.gate_proj.weight"])  # gate first: SwiGLU's act half
    back = logical_to_hf({name: logical[name] for name in logical}, cfg, vocab_size=50)
    assert set(back) == set(hf) and all(torch.equal(back[n], hf[n]) for n in hf)
    assert ("lm_head.weight" in back) == (not tied)


def test_shape_check_names_the_tensor():
    shapes = {n: t.shape for n, t in random_hf(CFG).items()}
    llama.check_hf_shapes(shapes, CFG, "x")
    with pytest.raises(ValueError, match=r"x: missing tensor model.layers.1.mlp.up_proj.weight"):
        llama.check_hf_shapes({n: s for n, s in shapes.items() if "1.mlp.up" not in n}, CFG, "x")
    with pytest.raises(ValueError, match=r"x: tensor model.norm.weight has shape \(15,\), expected \(16,\)"):
        llama.check_hf_shapes({**shapes, "model.norm.weight": (15,)}, CFG, "x")


@pytest.mark.model
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_tiny_llama_logits_match_transformers(one_rank_world, tied):
    """The mapping checked against megatron's own forward: QKV grouping (2 query heads per KV
    head), SwiGLU halves, RoPE convention and norms."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from megatron_ext.models.convert.load import load_logical
    from megatron_ext.models.convert.world import build_model

    torch.manual_seed(0)
    hf_config = LlamaConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=100, rope_theta=500.0, tie_word_embeddings=tied,
    )
    reference = LlamaForCausalLM(hf_config).eval()
    cfg = model_config_from_hf(hf_config.to_dict())
    (model,) = chunks = build_model(cfg, padded_vocab=128)
    load_logical(chunks, HFAsLogical(reference.state_dict(), cfg, 128))
    tokens = torch.randint(0, 100, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(tokens).logits
        got = model.eval()(tokens, torch.arange(24)[None], None)[..., :100]
    assert (got - expected).abs().max() < 1e-4
