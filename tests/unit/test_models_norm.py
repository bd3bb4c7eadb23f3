"""LocalNorm: megatron's WrappedTorchNorm without sequence parallelism, marked for megatron's TP
gradient all-reduce with it; and the GPT model built with it throughout."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.torch_norm import WrappedTorchNorm

from megatron_ext.config.schema import ModelConfig, ParallelConfig
from megatron_ext.models.gpt import build_gpt_model, layer_spec, transformer_config
from megatron_ext.models.norm import LocalNorm


def _config(normalization: str, sequence_parallel: bool = False) -> TransformerConfig:
    config = transformer_config(ModelConfig(), ParallelConfig(), on_cpu=True)
    # Set after construction: TransformerConfig refuses sequence parallelism at TP=1.
    config = dataclasses.replace(config, normalization=normalization)
    config.sequence_parallel = sequence_parallel
    return config


@pytest.mark.parametrize("normalization", ["RMSNorm", "LayerNorm"])
def test_without_sp_equals_wrapped_torch_norm(normalization):
    config = _config(normalization)
    torch.manual_seed(0)
    ours, theirs = LocalNorm(config, 64, eps=1e-6), WrappedTorchNorm(config, 64, eps=1e-6)
    with torch.no_grad():
        for param in ours.parameters():
            param.uniform_(0.5, 1.5)
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(5, 3, 64)
    assert torch.equal(ours(x), theirs(x))
    assert list(ours.state_dict()) == list(theirs.state_dict())
    assert not any(getattr(p, "sequence_parallel", False) for p in ours.parameters())


@pytest.mark.parametrize("normalization", ["RMSNorm", "LayerNorm"])
def test_sp_marks_every_parameter_for_the_tp_all_reduce(normalization):
    norm = LocalNorm(_config(normalization, sequence_parallel=True), 64)
    assert all(p.sequence_parallel is True for p in norm.parameters())


def test_unsupported_normalization_is_refused():
    with pytest.raises(ValueError, match="L2Norm"):
        LocalNorm(_config("L2Norm"), 64)


def test_gpt_model_norms_are_local_with_unchanged_keys(one_rank_world):
    model_cfg = ModelConfig()
    config = transformer_config(model_cfg, ParallelConfig(), on_cpu=True)
    model = build_gpt_model(model_cfg, config, layer_spec(model_cfg, use_te=False), 256, True, True)
    norms = [model.decoder.final_layernorm] + [
        norm for layer in model.decoder.layers for norm in (layer.input_layernorm, layer.pre_mlp_layernorm)
    ]
    assert all(type(norm) is torch.nn.RMSNorm for norm in norms)
    assert model.decoder.submodules.layer_norm is LocalNorm
    keys = [k for k in model.state_dict() if "layernorm" in k and not k.endswith("_extra_state")]
    layers = model_cfg.num_layers
    assert sorted(keys) == sorted(
        ["decoder.final_layernorm.weight"]
        + [f"decoder.layers.{i}.{n}.weight" for i in range(layers) for n in ("input_layernorm", "pre_mlp_layernorm")]
    )
