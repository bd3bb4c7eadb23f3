"""A run's config as Megatron-LM's `args` Namespace, and back: what a checkpoint's `args` holds.

Megatron-LM saves its parsed arguments in every checkpoint (`common.pt`'s `args`) and reads
them back: `check_checkpoint_args` compares the model's shape, `load_args_from_checkpoint`
(--use-checkpoint-args) takes the model's flags from them, `load_checkpoint` restores the data
position from `consumed_train_samples` and decides from the TP / PP sizes whether the RNG and a
`dp_reshardable` optimizer can be read. Megatron-Bridge rebuilds its run state from them.

`megatron_lm_args` writes those fields with Megatron-LM's names and meanings (its defaults where
this runtime has no setting); `config_overrides` reads a Megatron-LM Namespace (ours or one
Megatron-LM wrote) back into Hydra overrides of the model and the layout.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Optional

from megatron_ext.config.moe_pattern import pattern_expression
from megatron_ext.config.schema import Config, ModelConfig, ParallelConfig
from megatron_ext.config.tokenizer_spec import GPT2_FILES_PREFIX, NULL_PREFIX

# Megatron-LM argument <- model config field, the same value and meaning on both sides.
MODEL_FIELDS: dict[str, str] = {
    name: name
    for name in (
        "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "seq_length",
        "make_vocab_size_divisible_by", "norm_epsilon", "init_method_std", "normalization",
        "position_embedding_type", "rotary_percent", "add_bias_linear",
        "qk_layernorm", "hidden_dropout", "attention_dropout", "glu_linear_offset",
        "activation_func_clamp_value", "window_attn_skip_freq", "softmax_type", "mtp_num_layers",
        "mtp_loss_scaling_factor", "multi_latent_attention", "q_lora_rank", "kv_lora_rank",
        "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "num_experts", "moe_router_topk",
        "moe_ffn_hidden_size", "moe_z_loss_coeff", "moe_router_pre_softmax",
        "moe_router_score_function", "moe_router_enable_expert_bias", "moe_router_num_groups",
        "moe_router_group_topk", "moe_router_topk_scaling_factor",
        "moe_shared_expert_intermediate_size", "moe_grouped_gemm", "moe_flex_dispatcher_backend",
        "moe_router_force_load_balancing", "mamba_num_heads", "mamba_head_dim", "mamba_num_groups",
        "mamba_state_dim",
    )
} | {
    "moe_token_dispatcher_type": "moe_token_dispatcher",
    "rotary_scaling_factor": "yarn_rotary_scaling_factor",
    "mscale": "yarn_mscale",
    "mscale_all_dim": "yarn_mscale_all_dim",
    "beta_fast": "yarn_beta_fast",
    "beta_slow": "yarn_beta_slow",
    "original_max_position_embeddings": "yarn_original_max_position_embeddings",
    "rope_scaling_factor": "rope_scaling_factor",
    "hybrid_override_pattern": "hybrid_pattern",
}

# Megatron-LM argument <- parallel config field.
PARALLEL_FIELDS = {
    "tensor_model_parallel_size": "tp",
    "pipeline_model_parallel_size": "pp",
    "virtual_pipeline_model_parallel_size": "vpp",
    "expert_model_parallel_size": "ep",
    "context_parallel_size": "cp",
    "decoder_first_pipeline_num_layers": "first_stage_layers",
    "decoder_last_pipeline_num_layers": "last_stage_layers",
    "sequence_parallel": "sequence_parallel",
    "use_distributed_optimizer": "use_distributed_optimizer",
    "overlap_grad_reduce": "overlap_grad_reduce",
}

# The parallel fields that are the layout (the others are training settings).
LAYOUT = ("tp", "pp", "vpp", "ep", "cp", "first_stage_layers", "last_stage_layers")
_GATED = {"swiglu": "swiglu", "squared_relu": "squared_relu", "quick_geglu": "quick_geglu"}
_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


@dataclasses.dataclass(frozen=True)
class RunFacts:
    """What `args` records besides the config: the run's world and where it stands."""

    world_size: int
    data_parallel_size: int
    padded_vocab_size: int
    global_batch_size: int
    iteration: int
    consumed_train_samples: int
    # Megatron-LM's dist_ckpt optimizer format of this run's saves.
    fully_reshardable: bool = True
    skipped_train_samples: int = 0
    consumed_valid_samples: int = 0


def megatron_lm_args(cfg: Config, run: RunFacts) -> argparse.Namespace:
    """`cfg` as the Namespace Megatron-LM's parser and `validate_args` would have made for the
    same run, with the counters Megatron-LM's training loop keeps in it."""
    import torch  # the workers' import: this module is read by the launcher too

    m, p, o, t, c = cfg.model, cfg.parallel, cfg.optim, cfg.train, cfg.checkpoint
    args: dict[str, Any] = {name: getattr(m, field) for name, field in MODEL_FIELDS.items()}
    args |= {name: getattr(p, field) for name, field in PARALLEL_FIELDS.items()}
    args |= _model_derived(m) | _tokenizer(cfg.data.tokenizer)
    args |= dict(
        padded_vocab_size=run.padded_vocab_size,
        world_size=run.world_size,
        data_parallel_size=run.data_parallel_size,
        expert_tensor_parallel_size=p.tp,
        num_layers_per_virtual_pipeline_stage=None,
        fp16=m.precision == "fp16",
        bf16=m.precision == "bf16",
        params_dtype=getattr(torch, _DTYPES[m.precision]),
        micro_batch_size=t.micro_batch_size,
        global_batch_size=run.global_batch_size,
        rampup_batch_size=t.rampup_batch_size,
        train_iters=None if t.train_samples is not None else t.iters,
        train_samples=t.train_samples,
        seed=t.seed,
        eval_iters=t.eval_iters,
        eval_interval=t.eval_interval,
        optimizer=o.optimizer,
        lr=o.lr,
        min_lr=o.min_lr,
        lr_decay_style=o.lr_decay_style,
        lr_warmup_init=o.lr_warmup_init,
        lr_decay_iters=o.lr_decay_iters,
        lr_decay_samples=o.lr_decay_samples,
        lr_warmup_samples=o.lr_warmup_samples or 0,
        decoupled_lr=o.decoupled_lr,
        decoupled_min_lr=o.decoupled_min_lr,
        weight_decay=o.weight_decay,
        start_weight_decay=o.weight_decay,
        end_weight_decay=o.weight_decay,
        weight_decay_incr_style="constant",
        adam_beta1=o.adam_beta1,
        adam_beta2=o.adam_beta2,
        adam_eps=o.adam_eps,
        clip_grad=o.clip_grad,
        data_path=list(cfg.data.data_path) or None,
        split=cfg.data.split,
        mock_data=cfg.data.mock,
        save=c.save,
        load=c.load,
        save_interval=c.interval,
        no_save_optim=not c.save_optim,
        no_save_rng=not c.save_rng,
        async_save=c.async_save,
        ckpt_format="torch_dist",
        use_dist_ckpt=True,
        ckpt_fully_parallel_save=True,
        dist_ckpt_optim_fully_reshardable=run.fully_reshardable,
        data_parallel_random_init=False,
        phase_transition_iterations=None,
        iteration=run.iteration,
        consumed_train_samples=run.consumed_train_samples,
        skipped_train_samples=run.skipped_train_samples,
        consumed_valid_samples=run.consumed_valid_samples,
    )
    return argparse.Namespace(**args)


def _model_derived(m: ModelConfig) -> dict[str, Any]:
    """The Megatron-LM arguments that several model fields decide together."""
    return dict(
        swiglu=m.activation == "swiglu",
        squared_relu=m.activation == "squared_relu",
        quick_geglu=m.activation == "quick_geglu",
        add_qkv_bias=m.add_qkv_bias or m.add_bias_linear,  # Megatron-LM's validate_args: biases imply it
        group_query_attention=m.num_query_groups is not None,
        num_query_groups=m.num_query_groups if m.num_query_groups is not None else 1,
        kv_channels=m.head_dim or m.hidden_size // m.num_attention_heads,
        max_position_embeddings=m.max_position_embeddings or m.seq_length,
        add_position_embedding=m.position_embedding_type == "learned_absolute",
        use_rotary_position_embeddings=m.position_embedding_type == "rope",
        rotary_base=int(m.rotary_base) if float(m.rotary_base).is_integer() else m.rotary_base,
        rotary_interleaved=False,
        use_rope_scaling=m.rope_scaling == "llama3",
        untie_embeddings_and_output_weights=not m.tie_embeddings,
        apply_layernorm_1p=False,
        apply_query_key_layer_scaling=False,
        moe_layer_freq=_moe_layer_freq(m.moe_layer_freq),
        moe_aux_loss_coeff=m.moe_aux_loss_coeff,
        moe_router_load_balancing_type=m.moe_router_load_balancing_type,
        window_size=tuple(m.window_size) if m.window_size is not None else None,
        is_hybrid_model=m.arch == "hybrid",
        transformer_impl="local" if m.spec == "local" else "transformer_engine",
    )


def _moe_layer_freq(text: str) -> Any:
    """Megatron-LM keeps --moe-layer-freq as an int or the list its expression makes."""
    text = str(text).strip()
    return int(text) if text.isdigit() else pattern_expression(text)


def _tokenizer(spec: str) -> dict[str, Any]:
    """Megatron-LM's tokenizer arguments for `data.tokenizer`; the byte tokenizer has none."""
    if spec.startswith(NULL_PREFIX):
        return dict(tokenizer_type="NullTokenizer", vocab_size=int(spec[len(NULL_PREFIX):]), tokenizer_model=None)
    if spec.startswith(GPT2_FILES_PREFIX):
        vocab, merges = spec[len(GPT2_FILES_PREFIX):].split(":")
        return dict(tokenizer_type="GPT2BPETokenizer", vocab_file=vocab, merge_file=merges, tokenizer_model=None)
    if spec in ("byte", "auto"):
        return dict(tokenizer_type=None, tokenizer_model=None)
    return dict(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=spec)


def model_config(args: argparse.Namespace, base: Optional[ModelConfig] = None) -> ModelConfig:
    """The model a Megatron-LM `args` describes, over `base` (default: the runtime's defaults)."""
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    fields = {k: v for k, v in model_fields(args).items() if k in known}
    return dataclasses.replace(base or ModelConfig(name="megatron_lm_checkpoint"), **fields)


def model_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The model config fields a Megatron-LM `args` sets. Fields the Namespace lacks are left
    out (the run keeps its own); a model this runtime cannot build is refused later by the
    config's own checks."""
    model: dict[str, Any] = {
        field: getattr(args, name) for name, field in MODEL_FIELDS.items() if hasattr(args, name)
    }
    if getattr(args, "disable_bias_linear", None) is not None:  # older checkpoints' spelling
        model["add_bias_linear"] = not args.disable_bias_linear
    if hasattr(args, "add_qkv_bias"):  # here add_bias_linear implies the QKV bias, unsaid
        model["add_qkv_bias"] = args.add_qkv_bias and not model.get("add_bias_linear", False)
    gated = [kind for name, kind in _GATED.items() if getattr(args, name, False)]
    model["activation"] = gated[0] if gated else "gelu"
    if hasattr(args, "group_query_attention"):
        model["num_query_groups"] = args.num_query_groups if args.group_query_attention else None
    if getattr(args, "kv_channels", None) is not None:
        model["head_dim"] = None if args.kv_channels * args.num_attention_heads == args.hidden_size else args.kv_channels
    if hasattr(args, "untie_embeddings_and_output_weights"):
        model["tie_embeddings"] = not args.untie_embeddings_and_output_weights
    if getattr(args, "max_position_embeddings", None) is not None:  # None: the sequence length
        same = args.max_position_embeddings == getattr(args, "seq_length", None)
        model["max_position_embeddings"] = None if same else args.max_position_embeddings
    if getattr(args, "rotary_base", None) is not None:
        model["rotary_base"] = float(args.rotary_base)
    if getattr(args, "use_rope_scaling", False):
        model["rope_scaling"] = "llama3"
    if hasattr(args, "moe_layer_freq"):
        model["moe_layer_freq"] = _freq_text(args.moe_layer_freq)
    if getattr(args, "moe_aux_loss_coeff", None) is not None:
        model["moe_aux_loss_coeff"] = _first(args.moe_aux_loss_coeff)
    if getattr(args, "moe_router_load_balancing_type", None) is not None:
        model["moe_router_load_balancing_type"] = _first(args.moe_router_load_balancing_type)
    if getattr(args, "window_size", None) is not None:
        model["window_size"] = list(args.window_size)
    if getattr(args, "is_hybrid_model", False):
        model["arch"] = "hybrid"
    if getattr(args, "fp16", False) or getattr(args, "bf16", False):
        model["precision"] = "fp16" if args.fp16 else "bf16"
    return model


def tokenizer_spec(args: argparse.Namespace) -> Optional[str]:
    """The `data.tokenizer` of a Megatron-LM `args` (None: a tokenizer the runtime does not read)."""
    kind = getattr(args, "tokenizer_type", None)
    if kind == "NullTokenizer":
        return f"{NULL_PREFIX}{args.vocab_size}"
    if kind == "GPT2BPETokenizer" and getattr(args, "vocab_file", None):
        return f"{GPT2_FILES_PREFIX}{args.vocab_file}:{args.merge_file}"
    return getattr(args, "tokenizer_model", None)


def layout_fields(args: argparse.Namespace) -> dict[str, Optional[int]]:
    """The parallel sizes a Megatron-LM `args` ran with (--use-mp-args-from-checkpoint-args)."""
    return {field: getattr(args, name) for name, field in PARALLEL_FIELDS.items() if hasattr(args, name) and field in LAYOUT}


def _first(value: Any) -> Any:
    """Megatron-LM keeps some per-layer-type settings as lists; the runtime has one value."""
    return value[0] if isinstance(value, (list, tuple)) else value


def _freq_text(freq: Any) -> str:
    return str(freq) if isinstance(freq, int) else repr(list(freq))


# Megatron-LM argument -> optimizer config field, where they mean the same.
OPTIM_FIELDS = {
    name: name
    for name in ("lr", "min_lr", "weight_decay", "adam_beta1", "adam_beta2", "adam_eps", "clip_grad",
                 "decoupled_lr", "decoupled_min_lr", "lr_decay_style", "lr_warmup_init")
}


def optim_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The optimizer settings a Megatron-LM `args` ran with (what shapes its param groups)."""
    return {field: getattr(args, name) for name, field in OPTIM_FIELDS.items() if getattr(args, name, None) is not None}


def relaid_args(args: argparse.Namespace, parallel: ParallelConfig, world_size: int, fully_reshardable: bool) -> argparse.Namespace:
    """`args` of a checkpoint rewritten in layout `parallel` by `world_size` ranks: the layout
    fields changed, no RNG states (they belong to the old ranks), the optimizer format named."""
    fields = vars(args) | {name: getattr(parallel, field) for name, field in PARALLEL_FIELDS.items() if field in LAYOUT}
    model_parallel = parallel.tp * parallel.pp * parallel.cp
    return argparse.Namespace(**{
        **fields,
        "world_size": world_size,
        "data_parallel_size": world_size // model_parallel,
        "expert_tensor_parallel_size": parallel.tp,
        "num_layers_per_virtual_pipeline_stage": None,
        "dist_ckpt_optim_fully_reshardable": fully_reshardable,
        "no_save_rng": True,
    })
