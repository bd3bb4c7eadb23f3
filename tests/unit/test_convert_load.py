"""load_logical checks every source before it copies anything; gather_logical is its inverse
on a whole (TP1/PP1) model."""

from __future__ import annotations

import pytest
import torch

from megatron_ext.config.schema import ModelConfig
from megatron_ext.models.convert import llama
from megatron_ext.models.convert.load import gather_logical, load_logical
from megatron_ext.models.convert.world import build_model
from megatron_ext.models.logical import LogicalName

CFG = ModelConfig(
    num_layers=2, hidden_size=32, ffn_hidden_size=48, num_attention_heads=4, num_query_groups=2,
    vocab_size=100, tie_embeddings=False,
)


def random_logical(seed: int) -> dict[LogicalName, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    hf = {name: torch.randn(shape, generator=g) for name, shape in llama.expected_hf_shapes(CFG).items()}
    view = llama.HFAsLogical(hf, CFG, padded_vocab=128)
    return {name: view[name] for name in view}


@pytest.fixture
def model(one_rank_world):
    return build_model(CFG, padded_vocab=128)


def snapshot(chunks) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in chunks[0].state_dict().items() if v is not None and torch.is_tensor(v)}


def test_gather_returns_what_was_loaded(model):
    tensors = random_logical(0)
    load_logical(model, tensors)
    gathered = gather_logical(model)
    assert set(gathered) == set(tensors)
    assert all(torch.equal(gathered[n], tensors[n]) for n in tensors)


@pytest.mark.parametrize("broken", ["missing", "shape"])
def test_bad_source_names_the_tensor_and_copies_nothing(model, broken):
    load_logical(model, random_logical(0))
    before = snapshot(model)
    tensors = random_logical(1)
    name = LogicalName(llama.FC2, (1,))
    if broken == "missing":
        del tensors[name]
        error, match = KeyError, r"linear_fc2.weight \(layer 1\)"
    else:
        tensors[name] = tensors[name][:, :-1]
        error, match = ValueError, r"linear_fc2.weight \(layer 1\) has shape \(32, 47\), the model expects \(32, 48\)"
    with pytest.raises(error, match=match):
        load_logical(model, tensors)
    after = snapshot(model)
    assert all(torch.equal(before[k], after[k]) for k in before)
