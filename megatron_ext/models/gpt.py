"""GPT decoders in megatron-core's GPTModel space (LLaMA, GPT-3, Qwen, DeepSeek, Mixtral, ...).

`ModelConfig` says what to build; this module passes every field to megatron's TransformerConfig,
layer spec and GPTModel. The layout comes from `ParallelConfig`. Plugins change layers through
the ModuleSpec (`layer_spec` hook), never by editing this file.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
import math
from typing import Callable, Optional, Union

import torch
import torch.nn.functional as F
from megatron.core.activations import squared_relu
from megatron.core.fusions.fused_bias_geglu import quick_gelu
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
    get_gpt_mtp_block_spec,
)
from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.enums import AttnBackend
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    LayerNormImpl,
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_config import MLATransformerConfig
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group
from megatron.core.utils import get_pg_rank

from megatron_ext.config.moe_pattern import moe_layer_pattern
from megatron_ext.config.schema import ModelConfig, ParallelConfig
from megatron_ext.models.context_parallel import ContextParallelAttention
from megatron_ext.models.mla import MLACoreAttention
from megatron_ext.models.moe_layers import megatron_moe_layer_freq
from megatron_ext.models.norm import LocalNorm
from megatron_ext.models.sdpa import UNFUSED_BACKENDS
from megatron_ext.platform import optional

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# model.activation -> (megatron's activation_func, gated_linear_unit)
ACTIVATIONS = {
    "swiglu": (F.silu, True),
    "gelu": (F.gelu, False),
    "squared_relu": (squared_relu, False),
    "quick_geglu": (quick_gelu, True),
}

_log = logging.getLogger(__name__)


def padded_vocab_size(vocab_size: int, model: ModelConfig, tp: int) -> int:
    """The embedding rows, padded so each TP rank holds an equal, aligned slice.

    Megatron-LM pads to a multiple of `make_vocab_size_divisible_by * tp`, so the padded size
    (and, through the softmax over padding rows, the loss) changes with tp. The least common
    multiple gives the same size for every tp that divides the alignment (all powers of two up
    to it for the default 128), so layouts stay interchangeable; checkpoints keep the size too.
    """
    multiple = math.lcm(model.make_vocab_size_divisible_by, tp)
    return int(math.ceil(vocab_size / multiple) * multiple)


def uses_grouped_gemm(model: ModelConfig, use_te: bool) -> bool:
    """Grouped GEMM experts (Transformer Engine's TEGroupedMLP) where they can run. Without TE,
    megatron's SequentialMLP computes the same experts one GEMM at a time (the legacy
    GroupedMLP needs the CUDA-only grouped_gemm package)."""
    if model.num_experts is None or not model.moe_grouped_gemm:
        return False
    if not use_te:
        _notice(
            "model.moe_grouped_gemm: no Transformer Engine on this device; the experts run as "
            "megatron's SequentialMLP (same math, one GEMM per expert)"
        )
    return use_te


@functools.cache
def _notice(text: str) -> None:
    """A one-line notice, once per process, on the first rank only."""
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        _log.warning(text)


def _yarn_settings(model: ModelConfig) -> dict:
    """YaRN's settings under the names MLATransformerConfig (and, prefixed, GPTModel) use."""
    return {
        "rotary_scaling_factor": model.yarn_rotary_scaling_factor,
        "original_max_position_embeddings": model.yarn_original_max_position_embeddings,
        "beta_fast": model.yarn_beta_fast,
        "beta_slow": model.yarn_beta_slow,
        "mscale": model.yarn_mscale,
        "mscale_all_dim": model.yarn_mscale_all_dim,
    }


def _position_fields(model: ModelConfig) -> dict:
    """TransformerConfig fields of the position embedding; MLA takes its RoPE from its config."""
    if not model.multi_latent_attention:
        return {}
    return {
        "rope_type": model.position_embedding_type,
        "rotary_base": model.rotary_base,
        "rotary_percent": model.rotary_percent,
        **_yarn_settings(model),
    }


def _mla_fields(model: ModelConfig) -> dict:
    if not model.multi_latent_attention:
        return {}
    return {
        "q_lora_rank": model.q_lora_rank,
        "kv_lora_rank": model.kv_lora_rank,
        "qk_head_dim": model.qk_head_dim,
        "qk_pos_emb_head_dim": model.qk_pos_emb_head_dim,
        "v_head_dim": model.v_head_dim,
        **_position_fields(model),
    }


def _aux_loss_coeff(model: ModelConfig, parallel: ParallelConfig) -> float:
    """megatron's aux-loss coefficient that gives the load-balancing loss model.moe_aux_loss_coeff's
    weight under every layout.

    With per-token loss (calculate_per_token_loss, below) megatron-core 0.16's router weights
    each rank's share of the load-balancing loss by that rank's own token count, while the
    gradients are divided by the whole batch's. Sequence (TP) and context parallelism split a
    micro-batch's tokens over tp * cp ranks, so the loss would weigh 1 / (tp * cp) of what it
    weighs on one rank; the coefficient makes up for it. (The logged loss divides the
    coefficient out again.)"""
    return model.moe_aux_loss_coeff * parallel.tp * parallel.cp


def _dispatcher_fields(model: ModelConfig, on_cuda: bool) -> dict:
    """The token dispatcher. flex needs DeepEP's or HybridEP's CUDA kernels; without them the
    all-to-all dispatcher moves the same tokens to the same experts."""
    if model.moe_token_dispatcher != "flex":
        return {"moe_token_dispatcher_type": model.moe_token_dispatcher}
    # optional: DeepEP / HybridEP, which fused_a2a probes when imported
    from megatron.core.transformer.moe import fused_a2a

    backend = model.moe_flex_dispatcher_backend
    if on_cuda and {"deepep": fused_a2a.HAVE_DEEP_EP, "hybridep": fused_a2a.HAVE_HYBRIDEP}[backend]:
        return {"moe_token_dispatcher_type": "flex", "moe_flex_dispatcher_backend": backend}
    _notice(
        f"model.moe_token_dispatcher: flex needs {backend}'s CUDA kernels, not on this machine; "
        "tokens go through the alltoall dispatcher (same routing and math)"
    )
    return {"moe_token_dispatcher_type": "alltoall"}


def _z_loss_coeff(model: ModelConfig, parallel: ParallelConfig) -> Optional[float]:
    """megatron's z-loss coefficient that gives the router z-loss model.moe_z_loss_coeff's weight
    under every layout: megatron-core 0.16 divides it by tp * cp while each of those ranks sums
    the z-loss over its own share of the tokens only (the aux loss's case, above)."""
    if model.moe_z_loss_coeff is None:
        return None
    return model.moe_z_loss_coeff * parallel.tp * parallel.cp


def _moe_fields(model: ModelConfig, parallel: ParallelConfig, use_te: bool, on_cpu: bool) -> dict:
    if model.num_experts is None:
        return {"num_moe_experts": None}
    return {
        "num_moe_experts": model.num_experts,
        "moe_router_topk": model.moe_router_topk,
        "moe_ffn_hidden_size": model.moe_ffn_hidden_size,
        **_dispatcher_fields(model, on_cuda=not on_cpu),
        "moe_router_force_load_balancing": model.moe_router_force_load_balancing,
        "moe_aux_loss_coeff": _aux_loss_coeff(model, parallel),
        "moe_z_loss_coeff": _z_loss_coeff(model, parallel),
        "moe_router_load_balancing_type": model.moe_router_load_balancing_type,
        "moe_router_pre_softmax": model.moe_router_pre_softmax,
        "moe_router_score_function": model.moe_router_score_function,
        "moe_router_enable_expert_bias": model.moe_router_enable_expert_bias,
        "moe_router_num_groups": model.moe_router_num_groups,
        "moe_router_group_topk": model.moe_router_group_topk,
        "moe_router_topk_scaling_factor": model.moe_router_topk_scaling_factor,
        "moe_shared_expert_intermediate_size": model.moe_shared_expert_intermediate_size,
        "moe_layer_freq": megatron_moe_layer_freq(model),
        "moe_grouped_gemm": model.moe_grouped_gemm and use_te,
    }


def _attention_fields(model: ModelConfig) -> dict:
    """Sliding windows and the softmax's extra denominator term (gpt-oss), as megatron's
    DotProductAttention reads them."""
    return {
        "window_size": tuple(model.window_size) if model.window_size is not None else None,
        "window_attn_skip_freq": model.window_attn_skip_freq,
        "softmax_type": model.softmax_type,
    }


def transformer_config(model: ModelConfig, parallel: ParallelConfig, on_cpu: bool) -> TransformerConfig:
    dtype = DTYPES[model.precision]
    activation, gated = ACTIVATIONS[model.activation]
    config_class = MLATransformerConfig if model.multi_latent_attention else TransformerConfig
    return config_class(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        ffn_hidden_size=model.ffn_hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        kv_channels=model.head_dim or model.hidden_size // model.num_attention_heads,
        normalization=model.normalization,
        layernorm_epsilon=model.norm_epsilon,
        gated_linear_unit=gated,
        activation_func=activation,
        glu_linear_offset=model.glu_linear_offset,
        activation_func_clamp_value=model.activation_func_clamp_value,
        **_attention_fields(model),
        # Transformer Engine's kernel choice (megatron exports it as NVTE_* variables for the
        # process); the local layers take theirs from the spec (`layer_spec`).
        attention_backend=AttnBackend[model.attention_backend] if use_transformer_engine(model, on_cpu) else AttnBackend.auto,
        mtp_num_layers=model.mtp_num_layers,
        mtp_loss_scaling_factor=model.mtp_loss_scaling_factor,
        add_bias_linear=model.add_bias_linear,
        add_qkv_bias=model.add_qkv_bias,
        qk_layernorm=model.qk_layernorm,
        hidden_dropout=model.hidden_dropout,
        attention_dropout=model.attention_dropout,
        init_method_std=model.init_method_std,
        tensor_model_parallel_size=parallel.tp,
        pipeline_model_parallel_size=parallel.pp,
        virtual_pipeline_model_parallel_size=parallel.vpp,
        num_layers_in_first_pipeline_stage=parallel.first_stage_layers,
        num_layers_in_last_pipeline_stage=parallel.last_stage_layers,
        context_parallel_size=parallel.cp,
        expert_model_parallel_size=parallel.ep,
        sequence_parallel=parallel.sequence_parallel,
        **_moe_fields(model, parallel, use_transformer_engine(model, on_cpu), on_cpu),
        **_mla_fields(model),
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=model.precision == "bf16",
        fp16=model.precision == "fp16",
        perform_initialization=True,
        **device_fields(model, use_transformer_engine(model, on_cpu), on_cpu),
        persist_layer_norm=False,  # Apex's LayerNorm only (LocalNorm refuses it; TE's ignores it)
        cross_entropy_loss_fusion=False,  # Megatron-LM's default
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


def device_fields(model: ModelConfig, use_te: bool, on_cpu: bool) -> dict:
    """The TransformerConfig fields that are the device's choice. On the CPU: weights drawn on the
    host (the layout-independent initialisation redraws them anyway, models/init.py) and every
    fusion off (their kernels are CUDA's). On CUDA: Megatron-LM's defaults, each fusion where its
    kernel is installed and the model can take it (as Megatron-LM's argument checks switch them)."""
    if on_cpu:
        return {
            "use_cpu_initialization": True,
            "gradient_accumulation_fusion": False,
            "bias_activation_fusion": False,
            "bias_dropout_fusion": False,
            "masked_softmax_fusion": False,
            "apply_rope_fusion": False,
        }
    plain_glu = model.glu_linear_offset == 0 and model.activation_func_clamp_value is None
    return {
        "use_cpu_initialization": False,
        # Apex's wgrad kernel (Megatron-LM switches the fusion off without it).
        "gradient_accumulation_fusion": optional.HAVE_WGRAD_ACCUMULATION,
        # --bias-swiglu-fusion, and --bias-gelu-fusion where fc1 has a bias (megatron's jit kernels).
        "bias_activation_fusion": (model.activation == "swiglu" and plain_glu)
        or (model.activation == "gelu" and model.add_bias_linear),
        "bias_dropout_fusion": True,
        # megatron falls back to torch's softmax where its fused kernel is not built.
        "masked_softmax_fusion": True,
        # Transformer Engine's fused RoPE; megatron's MLA takes it with YaRN only.
        "apply_rope_fusion": use_te and model.position_embedding_type == "rope" and not model.multi_latent_attention,
    }


def use_transformer_engine(model: ModelConfig, on_cpu: bool) -> bool:
    if model.spec == "te":
        if on_cpu or not optional.HAVE_TE:
            raise RuntimeError("model.spec=te needs Transformer Engine and a CUDA device")
        return True
    return model.spec == "auto" and optional.HAVE_TE and not on_cpu


def layer_spec(model: ModelConfig, use_te: bool) -> ModuleSpec:
    """The layer spec of an MoE layer when the model has experts (dense layers of a mixed
    `moe_layer_freq` are derived from it in `decoder_spec`), else of a dense layer."""
    grouped = uses_grouped_gemm(model, use_te)
    if use_te:
        return get_gpt_layer_with_transformer_engine_spec(
            num_experts=model.num_experts,
            moe_grouped_gemm=grouped,
            qk_layernorm=model.qk_layernorm,
            multi_latent_attention=model.multi_latent_attention,
        )
    spec = get_gpt_layer_local_spec(
        num_experts=model.num_experts,
        qk_layernorm=model.qk_layernorm,
        multi_latent_attention=model.multi_latent_attention,
        normalization=model.normalization,
    )
    attention = spec.submodules.self_attention.submodules
    attention.core_attention = ModuleSpec(
        module=MLACoreAttention if model.multi_latent_attention else ContextParallelAttention,
        params={"sdpa": model.attention_backend not in UNFUSED_BACKENDS},
    )
    for norm in ("q_layernorm", "k_layernorm", "kv_layernorm"):
        if model.qk_layernorm and hasattr(attention, norm):
            setattr(attention, norm, LocalNorm)
    spec.submodules.input_layernorm = LocalNorm
    spec.submodules.pre_mlp_layernorm = LocalNorm
    return spec


def _dense_like(spec: ModuleSpec, model: ModelConfig, use_te: bool) -> ModuleSpec:
    """`spec` (an MoE layer, as plugins left it) with megatron's dense MLP in place of the MoE."""
    dense = copy.copy(spec)
    dense.submodules = copy.copy(spec.submodules)
    dense.submodules.mlp = layer_spec(dataclasses.replace(model, num_experts=None), use_te).submodules.mlp
    return dense


def decoder_spec(
    config: TransformerConfig,
    spec: ModuleSpec,
    vp_stage: Optional[int] = None,
    pg_collection=None,
    model: Optional[ModelConfig] = None,
) -> Union[ModuleSpec, TransformerBlockSubmodules]:
    """The decoder's spec: a layer spec whose norms are LocalNorm becomes megatron's block
    submodules with a LocalNorm final norm too, and a model whose `moe_layer_freq` mixes dense
    and MoE layers gets one spec per layer; any other spec is passed on as it is.

    Given a bare layer spec, megatron's TransformerBlock takes its final norm from the module-level
    `LayerNormImpl` (WrappedTorchNorm without TE or Apex, which refuses sequence parallelism).
    Plugins still rewrite the layer spec alone; the block is assembled here, once they are done.
    """
    local = getattr(spec.submodules, "input_layernorm", None) is LocalNorm
    pattern = moe_layer_pattern(model) if model is not None and model.num_experts is not None else []
    mixed = 0 in pattern
    if not local and not mixed:
        return spec
    # The same stage as TransformerBlock computes; None falls back to megatron's global state,
    # as TransformerBlock does when it is given no process groups.
    pp_rank = get_pg_rank(pg_collection.pp) if pg_collection is not None else None
    layers = get_num_layers_to_build(config, vp_stage, pp_rank)
    if mixed:
        offset = get_transformer_layer_offset(config, vp_stage, pp_rank)
        dense = _dense_like(spec, model, use_te=not local)
        specs = [spec if moe else dense for moe in pattern[offset : offset + layers]]
    else:
        specs = [spec] * layers
    # Otherwise the final norm megatron's TransformerBlock gives a bare layer spec.
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=LocalNorm if local else LayerNormImpl)


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
    # MLA applies its own RoPE / YaRN (from its config); GPTModel must build none.
    position = "rope" if model.multi_latent_attention else model.position_embedding_type
    if position == "yarn":
        _set_yarn_attributes(config, model)
    decoder = decoder_spec(config, spec, vp_stage, pg_collection, model)
    gpt = (MTPGPTModel if model.mtp_num_layers else GPTModel)(
        config=config,
        transformer_layer_spec=decoder,
        mtp_block_spec=mtp_spec(config, spec, vp_stage, pg_collection),
        vocab_size=vocab_size,
        max_sequence_length=model.max_position_embeddings or model.seq_length,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=model.tie_embeddings,
        position_embedding_type=position,
        rotary_percent=model.rotary_percent,
        rotary_base=int(model.rotary_base),
        rope_scaling=model.rope_scaling == "llama3",
        rope_scaling_factor=model.rope_scaling_factor,
        pg_collection=pg_collection,
        vp_stage=vp_stage,
    )
    if pre_process and position == "learned_absolute":
        # megatron builds the position table as a plain torch Embedding in the default dtype;
        # Megatron-LM's Float16Module casts it with the rest of the model. Left in fp32, it
        # would turn a bf16/fp16 model's hidden states into fp32 at the first layer.
        gpt.embedding.position_embeddings.to(config.params_dtype)
    _mark_softmax_offsets_tensor_parallel(gpt)
    return gpt


class MTPGPTModel(GPTModel):
    """GPTModel with multi-token prediction, whose checkpoint state works without metadata.

    On a pipeline stage with MTP and no embedding of its own, megatron-core 0.16's GPTModel reads
    `metadata["dp_cp_group"]` for the embedding copy without first filling in a None metadata,
    as its parent class does."""

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        return super().sharded_state_dict(prefix, sharded_offsets, ensure_metadata_has_dp_cp_group(metadata))


def mtp_spec(config: TransformerConfig, spec: ModuleSpec, vp_stage: Optional[int], pg_collection):
    """megatron's multi-token-prediction block on the stage that builds it (the last one), its
    layers made like the decoder's; None elsewhere and without MTP."""
    if not config.mtp_num_layers:
        return None
    local = getattr(spec.submodules, "input_layernorm", None) is LocalNorm
    pp_rank = get_pg_rank(pg_collection.pp) if pg_collection is not None else None
    block = get_gpt_mtp_block_spec(config, spec, use_transformer_engine=not local, vp_stage=vp_stage, pp_rank=pp_rank)
    if block is not None and local:
        # The local backend's norm is WrappedTorchNorm, which refuses sequence parallelism.
        for layer in block.layer_specs:
            for norm in ("enorm", "hnorm", "layer_norm"):
                setattr(layer.submodules, norm, LocalNorm)
    return block


def _mark_softmax_offsets_tensor_parallel(gpt: GPTModel) -> None:
    """megatron-core 0.16 splits the learnable softmax offsets (one per head) over TP ranks but
    does not mark them so; unmarked, the gradient norm counts TP rank 0's heads only."""
    for name, param in gpt.named_parameters():
        if name.endswith("core_attention.softmax_offset"):
            set_tensor_model_parallel_attributes(param, is_parallel=True, dim=0, stride=1)


def _set_yarn_attributes(config: TransformerConfig, model: ModelConfig) -> None:
    """megatron-core 0.16's GPTModel reads YaRN's settings from `config.yarn_*` attributes
    that TransformerConfig does not declare (Megatron-LM sets them after building its config)."""
    # Rounding the correction range as Megatron-LM (and transformers' default) does.
    settings = {**_yarn_settings(model), "correction_range_round_to_int": True}
    for name, value in settings.items():
        setattr(config, f"yarn_{name}", value)


ModelProvider = Callable[[bool, bool, Optional[int]], GPTModel]
