"""Hybrid Mamba2 / attention / MLP / MoE decoder (Nemotron-H, Nemotron Nano) on megatron-core's
MambaModel.

The layer pattern is megatron's `hybrid_override_pattern`: one symbol per layer, `M` Mamba2,
`*` self-attention, `-` MLP, `E` MoE (e.g. "M*M-ME"). Every layer is built through megatron's
ModuleSpec from megatron's own modules (MambaLayer, TransformerLayer, MLPLayer, MoE, local
column/row parallel linears); the Mamba mixer is megatron's `MambaMixer` with its CUDA kernels
when `mamba_ssm` is installed on a CUDA machine, else our pure-PyTorch `TorchMambaMixer`.

Two megatron-core 0.16 obstacles are avoided through the spec, without patching megatron:
`mamba_layer_specs` / `mamba_mixer` import triton at module level (never imported here on the
CPU path), and `MambaStack` builds its final norm as Transformer Engine's TENorm (`HybridStack`
builds it with torch's RMSNorm instead). Like Nemotron-H, the hybrid has no position embedding:
the Mamba layers carry position.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.mamba import MambaModel
from megatron.core.ssm.mamba_block import MambaStack, MambaStackSubmodules
from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules
from megatron.core.ssm.mlp_layer import MLPLayer
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from megatron_ext.config.schema import ModelConfig, ParallelConfig
from megatron_ext.models.gpt import transformer_config
from megatron_ext.models.mamba2 import MixerSubmodules, TorchMambaMixer
from megatron_ext.models.norm import LocalNorm
from megatron_ext.platform import optional


class HybridStack(MambaStack):
    """megatron's MambaStack with a final RMSNorm that needs no Transformer Engine (0.16
    hard-codes TENorm there). Same module name, `final_norm`, so checkpoints keep their keys."""

    def __init__(self, config: TransformerConfig, submodules: MambaStackSubmodules, post_layer_norm: bool = True, **kwargs) -> None:
        super().__init__(config, submodules, post_layer_norm=False, **kwargs)
        self.post_layer_norm = post_layer_norm
        if self.post_process and post_layer_norm:
            self.final_norm = LocalNorm(config=config, hidden_size=config.hidden_size, eps=config.layernorm_epsilon)


def hybrid_transformer_config(model: ModelConfig, parallel: ParallelConfig, on_cpu: bool) -> TransformerConfig:
    """The GPT builder's config (same norms, activations, init, fusions off on CPU) plus the
    Mamba sizes; one layer per pattern symbol."""
    config = transformer_config(model, parallel, on_cpu)
    return dataclasses.replace(
        config,
        num_layers=len(model.hybrid_pattern),
        mamba_state_dim=model.mamba_state_dim,
        mamba_head_dim=model.mamba_head_dim,
        mamba_num_groups=model.mamba_num_groups,
        mamba_num_heads=model.mamba_num_heads,
    )


def use_mamba_kernels(model: ModelConfig, on_cpu: bool) -> bool:
    """megatron's MambaMixer (mamba_ssm kernels) rather than ours: only where it can run."""
    return model.spec != "local" and not on_cpu and optional.HAVE_MAMBA_SSM


def mixer_spec(model: ModelConfig, kernels: bool) -> ModuleSpec:
    if kernels:
        # Imported only here: the module imports triton and mamba_ssm at import time.
        from megatron.core.ssm.mamba_mixer import MambaMixer, MambaMixerSubmodules

        return ModuleSpec(
            module=MambaMixer,
            params={"chunk_size": model.mamba_chunk_size},
            submodules=MambaMixerSubmodules(in_proj=ColumnParallelLinear, out_proj=RowParallelLinear),
        )
    return ModuleSpec(
        module=TorchMambaMixer,
        params={"chunk_size": model.mamba_chunk_size},
        submodules=MixerSubmodules(in_proj=ColumnParallelLinear, out_proj=RowParallelLinear),
    )


def hybrid_stack_spec(model: ModelConfig, on_cpu: bool) -> ModuleSpec:
    """The MambaStack spec: megatron's local GPT layer pieces cut into one-sublayer layers.
    Norm keys are mapped to where megatron's Transformer Engine spec keeps them (fused into
    the next linear), so checkpoints match those of megatron's own hybrid models."""
    dense = get_gpt_layer_local_spec(normalization="RMSNorm").submodules
    norm = LocalNorm  # torch's RMSNorm, sequence-parallel capable
    moe_mlp = None
    if model.num_experts:
        moe_mlp = get_gpt_layer_local_spec(num_experts=model.num_experts, normalization="RMSNorm").submodules.mlp
    bda = get_bias_dropout_add
    layers = MambaStackSubmodules(
        mamba_layer=ModuleSpec(
            module=MambaLayer,
            submodules=MambaLayerSubmodules(
                norm=norm,
                mixer=mixer_spec(model, use_mamba_kernels(model, on_cpu)),
                mamba_bda=bda,
                sharded_state_dict_keys_map={"norm.": "mixer.in_proj.layer_norm_"},
            ),
        ),
        attention_layer=ModuleSpec(
            module=TransformerLayer,
            submodules=TransformerLayerSubmodules(
                input_layernorm=norm,
                self_attention=dense.self_attention,
                self_attn_bda=bda,
                sharded_state_dict_keys_map={"input_layernorm.": "self_attention.linear_qkv.layer_norm_"},
            ),
        ),
        mlp_layer=ModuleSpec(
            module=MLPLayer,
            submodules=TransformerLayerSubmodules(
                pre_mlp_layernorm=norm,
                mlp=dense.mlp,
                mlp_bda=bda,
                sharded_state_dict_keys_map={"pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"},
            ),
        ),
    )
    if moe_mlp is not None:
        layers.moe_layer = ModuleSpec(
            module=TransformerLayer,
            submodules=TransformerLayerSubmodules(pre_mlp_layernorm=norm, mlp=moe_mlp, mlp_bda=bda),
        )
    return ModuleSpec(module=HybridStack, submodules=layers)


def build_hybrid_model(
    model: ModelConfig,
    config: TransformerConfig,
    spec: ModuleSpec,
    vocab_size: int,
    pre_process: bool,
    post_process: bool,
    vp_stage: Optional[int] = None,
    pg_collection=None,
) -> MambaModel:
    if vp_stage is not None:
        raise ValueError("the hybrid model has no interleaved pipeline (megatron's MambaStack)")
    return MambaModel(
        config=config,
        mamba_stack_spec=spec,
        vocab_size=vocab_size,
        max_sequence_length=model.seq_length,
        pre_process=pre_process,
        post_process=post_process,
        hybrid_override_pattern=model.hybrid_pattern,
        share_embeddings_and_output_weights=model.tie_embeddings,
        position_embedding_type="none",
        pg_collection=pg_collection,
    )

