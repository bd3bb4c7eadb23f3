"""Axes of the hybrid model's single-sublayer layers (megatron's MambaStack builds attention
layers without an MLP and MLP layers without attention): the dense axes of `dense_axes.py` on
each half alone. Importing this module registers them together with the Mamba (and MoE)
adapters, so `discover()` recognises every layer of a hybrid MambaModel.
"""

from __future__ import annotations

from typing import Optional

from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.transformer_layer import TransformerLayer
from torch import nn

import megatron_ext.elastic.mamba_axes  # noqa: F401  (registers the Mamba adapter)
import megatron_ext.elastic.moe_axes  # noqa: F401  (registers the MoE adapter)
from megatron_ext.elastic.axes import (
    LayerAxes,
    Touch,
    register_layer_adapter,
    resize_norm,
    set_input_size,
    set_output_size,
)
from megatron_ext.elastic.dense_axes import FfnAxis, HeadsAxis


@register_layer_adapter
def attention_only_layer(layer: nn.Module) -> Optional[LayerAxes]:
    if not isinstance(layer, TransformerLayer) or not isinstance(layer.mlp, IdentityOp):
        return None
    if not isinstance(layer.self_attention, SelfAttention):
        return None
    attn = layer.self_attention
    return LayerAxes(
        axes=[HeadsAxis(attn, layer.layer_number - 1)],
        hidden=[
            Touch(layer.input_layernorm, "weight", 0, resize_norm, owned=True),
            Touch(attn.linear_qkv, "weight", 1, set_input_size),
            Touch(attn.linear_proj, "weight", 0, set_output_size),
        ],
        norms=[layer.input_layernorm],
    )


@register_layer_adapter
def mlp_only_layer(layer: nn.Module) -> Optional[LayerAxes]:
    if not isinstance(layer, TransformerLayer) or not isinstance(layer.self_attention, IdentityOp):
        return None
    if not isinstance(layer.mlp, MLP):
        return None
    mlp = layer.mlp
    return LayerAxes(
        axes=[FfnAxis(mlp, layer.layer_number - 1)],
        hidden=[
            Touch(layer.pre_mlp_layernorm, "weight", 0, resize_norm, owned=True),
            Touch(mlp.linear_fc1, "weight", 1, set_input_size),
            Touch(mlp.linear_fc2, "weight", 0, set_output_size),
        ],
        norms=[layer.pre_mlp_layernorm],
    )
