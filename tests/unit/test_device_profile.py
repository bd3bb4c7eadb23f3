"""The device's choices of megatron's TransformerConfig: on the CPU host initialisation and no
fusions (their kernels are CUDA's) with layout-independent weights; on CUDA Megatron-LM's
defaults, each fusion only where the model can take it. Every preset's CUDA config is built
here (megatron's TransformerConfig checks its fusions when it is constructed), so a preset that
a GPU would refuse fails on the CPU first."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_ext.config.schema import ParallelConfig
from megatron_ext.config.store import MODEL_PRESETS
from megatron_ext.models.arch import architecture
from megatron_ext.models.init import layout_independent


@pytest.mark.parametrize("preset", sorted(MODEL_PRESETS))
def test_every_preset_takes_the_cuda_profile(preset):
    model = MODEL_PRESETS[preset]
    cpu = architecture(model).transformer_config(model, ParallelConfig(), on_cpu=True)
    cuda = architecture(model).transformer_config(model, ParallelConfig(), on_cpu=False)
    assert cpu.use_cpu_initialization and not cuda.use_cpu_initialization
    assert not any((cpu.bias_activation_fusion, cpu.bias_dropout_fusion, cpu.masked_softmax_fusion, cpu.apply_rope_fusion))
    assert cuda.bias_dropout_fusion and cuda.masked_softmax_fusion
    # Megatron-LM's --bias-swiglu-fusion / --bias-gelu-fusion, where megatron's kernels apply.
    fusable = (model.activation == "swiglu" and model.activation_func_clamp_value is None) or (
        model.activation == "gelu" and model.add_bias_linear)
    assert cuda.bias_activation_fusion == fusable


def test_layout_independent_weights_are_the_cpu_default_and_an_option_on_cuda():
    model = MODEL_PRESETS["llama_tiny"]
    assert layout_independent(model, on_cpu=True) and not layout_independent(model, on_cpu=False)
    assert layout_independent(dataclasses.replace(model, layout_independent_init=True), on_cpu=False)
    assert not layout_independent(dataclasses.replace(model, layout_independent_init=False), on_cpu=True)
