"""LLaMA-style GPT (RMSNorm, SwiGLU, RoPE, GQA, optional MoE) on megatron-core's GPTModel.

The architecture is fixed here; sizes come from `ModelConfig`, the layout from `ParallelConfig`.
Plugins change layers through the ModuleSpec (`layer_spec` hook), never by editing this file.
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Union

import torch
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.utils import get_pg_rank

from megatron_ext.config.schema import ModelConfig, ParallelConfig
from megatron_ext.models.context_parallel import ContextParallelAttention
from megatron_ext.models.norm import LocalNorm
from megatron_ext.platform import optional

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def padded_vocab_size(vocab_size: int, model: ModelConfig, tp: int) -> int:
    """The embedding rows, padded so each TP rank holds an equal, aligned slice.

    Megatron-LM pads to a multiple of `make_vocab_size_divisible_by * tp`, so the padded size
    (and, through the softmax over padding rows, the loss) changes with tp. The least common
    multiple gives the same size for every tp that divides the alignment (all powers of two up
    to it for the default 128), so layouts stay interchangeable; checkpoints keep the size too.
    """
    multiple = math.lcm(model.make_vocab_size_divisible_by, tp)
    return int(math.ceil(vocab_size / multiple) * multiple)


def transformer_config(model: ModelConfig, parallel: ParallelConfig, on_cpu: bool) -> TransformerConfig:
    dtype = DTYPES[model.precision]
    return TransformerConfig(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        ffn_hidden_size=model.ffn_hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        kv_channels=model.head_dim or model.hidden_size // model.num_attention_heads,
        normalization="RMSNorm",
        layernorm_epsilon=model.norm_epsilon,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=model.init_method_std,
        tensor_model_parallel_size=parallel.tp,
        pipeline_model_parallel_size=parallel.pp,
        virtual_pipeline_model_parallel_size=parallel.vpp,
        num_layers_in_first_pipeline_stage=parallel.first_stage_layers,
        num_layers_in_last_pipeline_stage=parallel.last_stage_layers,
        context_parallel_size=parallel.cp,
        expert_model_parallel_size=parallel.ep,
        sequence_parallel=parallel.sequence_parallel,
        num_moe_experts=model.num_experts,
        moe_router_topk=model.moe_router_topk,
        moe_ffn_hidden_size=model.moe_ffn_hidden_size if model.num_experts else None,
        moe_token_dispatcher_type=model.moe_token_dispatcher,
        moe_aux_loss_coeff=model.moe_aux_loss_coeff,
        moe_router_load_balancing_type="aux_loss" if model.moe_aux_loss_coeff > 0 else "none",
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=model.precision == "bf16",
        fp16=model.precision == "fp16",
        # CPU initialisation draws the full master weight from one seeded generator and slices
        # it, so every TP/PP layout starts from the same weights (and CPU equals GPU).
        use_cpu_initialization=True,
        perform_initialization=True,
        # Fusions that need apex/TE kernels.
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        cross_entropy_loss_fusion=False,
        # The loss is a sum over tokens; megatron divides gradients by the token count of the
        # whole global batch, which makes it the same per-token mean under every layout.
        calculate_per_token_loss=True,
        deallocate_pipeline_outputs=not on_cpu,
        # gloo has no grouped point-to-point: a "batched" send/recv list is just isend/irecv
        # matched per peer in posting order, and megatron's batched order differs between the
        # two sides when both pipeline neighbours are the same rank (interleaved PP=2), which
        # silently swaps activations and gradients. The unbatched path posts in matching order.
        batch_p2p_comm=not on_cpu,
    )


def use_transformer_engine(model: ModelConfig, on_cpu: bool) -> bool:
    if model.spec == "te":
        if on_cpu or not optional.HAVE_TE:
            raise RuntimeError("model.spec=te needs Transformer Engine and a CUDA device")
        return True
    return model.spec == "auto" and optional.HAVE_TE and not on_cpu


def layer_spec(model: ModelConfig, use_te: bool) -> ModuleSpec:
    if use_te:
        return get_gpt_layer_with_transformer_engine_spec(num_experts=model.num_experts)
    spec = get_gpt_layer_local_spec(num_experts=model.num_experts, normalization="RMSNorm")
    spec.submodules.self_attention.submodules.core_attention = ContextParallelAttention
    spec.submodules.input_layernorm = LocalNorm
    spec.submodules.pre_mlp_layernorm = LocalNorm
    return spec


def decoder_spec(
    config: TransformerConfig, spec: ModuleSpec, vp_stage: Optional[int] = None, pg_collection=None
) -> Union[ModuleSpec, TransformerBlockSubmodules]:
    """The decoder's spec: a layer spec whose norms are LocalNorm becomes megatron's block
    submodules with a LocalNorm final norm too; any other spec is passed on as it is.

    Given a bare layer spec, megatron's TransformerBlock takes its final norm from the module-level
    `LayerNormImpl` (WrappedTorchNorm without TE or Apex, which refuses sequence parallelism).
    Plugins still rewrite the layer spec alone; the block is assembled here, once they are done.
    """
    if getattr(spec.submodules, "input_layernorm", None) is not LocalNorm:
        return spec
    # The same stage as TransformerBlock computes; None falls back to megatron's global state,
    # as TransformerBlock does when it is given no process groups.
    pp_rank = get_pg_rank(pg_collection.pp) if pg_collection is not None else None
    layers = get_num_layers_to_build(config, vp_stage, pp_rank)
    return TransformerBlockSubmodules(layer_specs=[spec] * layers, layer_norm=LocalNorm)


def build_gpt_model(
    model: ModelConfig,
    config: TransformerConfig,
    spec: ModuleSpec,
    vocab_size: int,
    pre_process: bool,
    post_process: bool,
    vp_stage: Optional[int] = None,
    pg_collection=None,
) -> GPTModel:
    return GPTModel(
        config=config,
        transformer_layer_spec=decoder_spec(config, spec, vp_stage, pg_collection),
        vocab_size=vocab_size,
        max_sequence_length=model.seq_length,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=model.tie_embeddings,
        position_embedding_type="rope",
        rotary_base=int(model.rotary_base),
        pg_collection=pg_collection,
        vp_stage=vp_stage,
    )


ModelProvider = Callable[[bool, bool, Optional[int]], GPTModel]
