"""The dpp plugin's config section (`dpp.*`) and its checks before launch; no torch."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from megatron_ext.config.batch_sizes import schedule_key
from megatron_ext.config.capabilities import Capability
from megatron_ext.config.plugin_sections import PluginSection
from megatron_ext.config.schema import Config, ModelConfig
from megatron_ext.config.validate import ConfigError


@dataclass
class DppConfig:
    # The longest sequence a step trains on, in tokens; longer documents follow `too_long`.
    max_seq_len: int = 1024
    # truncate | reject: what happens to a longer document (the counts are logged after the
    # first batch and at the end of training).
    too_long: str = "truncate"
    # Whole documents per global batch, over all data-parallel replicas.
    docs_per_batch: int = 16
    # Memory per pipeline stage the plan must fit: model states (the stage's parameters, their
    # fp32 gradients and optimizer state, counted on the run's model) plus activations. A
    # budget no plan can meet is refused before the first step, naming the smallest feasible one.
    memory_budget_mb: float = 1024.0
    # dpp, or a baseline / ablation for comparison (megatron_ext.dpp.planning.planner.POLICIES).
    policy: str = "dpp"
    # A cost model fitted by `python -m megatron_ext.dpp.tools.calibrate` (JSON). Required: a missing
    # one is refused before the run starts. Its activation terms are refitted to the run.
    cost_model: Optional[str] = None
    # Plan the next global batch in a background thread while the current one trains (the
    # plans are the same either way; false plans each batch at its own step).
    plan_ahead: bool = True


def check_settings(own: DppConfig) -> None:
    """Raise a ConfigError for a setting of the `dpp` section that cannot work."""
    # numpy and the planner's modules: loaded for a run with dpp only
    from megatron_ext.dpp.planning.lengths import OVERFLOW_POLICIES
    from megatron_ext.dpp.planning.planner import POLICIES

    if own.too_long not in OVERFLOW_POLICIES:
        raise ConfigError("dpp.too_long", f"must be one of {OVERFLOW_POLICIES}, got {own.too_long!r}")
    if own.policy not in POLICIES:
        raise ConfigError("dpp.policy", f"expected one of {POLICIES}, got {own.policy!r}")
    if own.max_seq_len < 2:
        raise ConfigError("dpp.max_seq_len", f"must be at least 2, got {own.max_seq_len}")
    if own.docs_per_batch < 1:
        raise ConfigError("dpp.docs_per_batch", f"must be at least 1, got {own.docs_per_batch}")
    if own.memory_budget_mb <= 0:
        raise ConfigError("dpp.memory_budget_mb", f"must be positive, got {own.memory_budget_mb}")


def check(own: DppConfig, cfg: Config, world_size: int) -> None:
    """The section's settings, and a batch-size schedule or SFT data (dpp plans its own batches
    of pre-training documents), are checked."""
    check_settings(own)
    if cfg.data.sft is not None:
        raise ConfigError("data.sft.path", "dpp plans chunks of pre-training documents: it does not read SFT conversations")
    if schedule_key(cfg.train):  # dpp's global batches are dpp.docs_per_batch documents
        raise ConfigError(schedule_key(cfg.train), "dpp plans its own global batches of whole documents: "
                                                   "a batch-size schedule is not supported")


def check_layout(own: DppConfig, cfg: Config, world_size: int) -> None:
    """Before the run starts and before a live reshard moves it: a layout or model DPP cannot
    train, or a cost model that is missing or was calibrated for another layer shape or tensor
    parallelism, is refused."""
    refuse_layout(cfg)
    refuse_cost_model(own.cost_model, cfg)


def refuse_layout(cfg: Config) -> None:
    """Raise a ConfigError for a parallel layout or model (`cfg`'s) that DPP cannot train."""
    p, model = cfg.parallel, cfg.model
    if p.vpp:
        raise ConfigError("parallel.vpp", "dpp runs a non-interleaved pipeline; leave parallel.vpp unset")
    if p.cp > 1:
        raise ConfigError("parallel.cp", "dpp does not support context parallelism (it splits long sequences itself)")
    if model.arch != "gpt":  # the chunk attention and RoPE swaps assume GPT layers
        raise ConfigError("model.arch", f"dpp supports model.arch=gpt only, not {model.arch!r}")
    if p.sequence_parallel and p.tp > 1 and model.num_experts and model.moe_aux_loss_coeff > 0:
        # Chunks are padded to multiples of tp, and megatron routes padding like any token.
        raise ConfigError("model.moe_aux_loss_coeff", "dpp with sequence parallelism does not support an MoE "
                          "auxiliary loss: the padding of chunks would enter the load-balancing loss")
    if p.sequence_parallel and p.tp > 1 and model.num_experts and model.moe_router_enable_expert_bias:
        raise ConfigError("model.moe_router_enable_expert_bias", "dpp with sequence parallelism does not support "
                          "the expert bias: the padding of chunks would enter its expert counts")
    refuse_model_space(model)
    if cfg.train.test_mode and model.qk_layernorm:
        # As for expert parallelism below: the replicas' plans differ.
        raise ConfigError("train.test_mode", "dpp's data-parallel replicas forward different chunks, and megatron's "
                          "real-time test all-gathers over them in every attention forward: not supported")
    if p.ep > 1:
        # Expert-parallel ranks sit in different data-parallel replicas, whose plans differ:
        # their MoE layers' token exchanges would not pair up chunk by chunk.
        raise ConfigError("parallel.ep", "dpp does not support expert parallelism; MoE models run with parallel.ep=1")


def refuse_model_space(model: ModelConfig) -> None:
    """What dpp's chunk attention and chunk positions (runtime/attention.py) are not written for."""
    if model.multi_latent_attention:
        raise ConfigError("model.multi_latent_attention", "dpp's chunk attention takes one head size for queries, "
                          "keys and values: multi-latent attention is not supported")
    if model.position_embedding_type != "rope":
        raise ConfigError("model.position_embedding_type", "dpp places the tokens of packed and split sequences "
                          f"through RoPE: position_embedding_type={model.position_embedding_type} is not supported")
    if model.attention_dropout > 0:
        raise ConfigError("model.attention_dropout", "dpp's chunk attention has no attention dropout; set it to 0")
    if model.window_size is not None:
        raise ConfigError("model.window_size", "dpp's chunk attention is full causal attention within each sequence: "
                          "sliding windows are not supported")
    if model.softmax_type != "vanilla":
        raise ConfigError("model.softmax_type", f"dpp's chunk attention computes a plain softmax: softmax offsets "
                          f"(softmax_type={model.softmax_type}) are not supported")
    if model.mtp_num_layers is not None:
        raise ConfigError("model.mtp_num_layers", "dpp packs several sequences into one chunk: multi-token "
                          "prediction's shifted tokens would cross from one sequence into the next")
    if model.num_experts and model.moe_router_load_balancing_type == "seq_aux_loss":
        raise ConfigError("model.moe_router_load_balancing_type", "dpp packs several sequences into one chunk: "
                          "the sequence-level aux loss (seq_aux_loss) would see chunks, not sequences")


def refuse_cost_model(path: Optional[str], cfg: Config) -> None:
    """Raise a ConfigError for a `dpp.cost_model` that is missing or was calibrated for
    another layer shape or tensor parallelism than `cfg`'s model and layout."""
    how = "python -m megatron_ext.dpp.tools.calibrate writes one"
    if path is None:
        raise ConfigError("dpp.cost_model", f"give a cost model fitted on this machine ({how})")
    if not os.path.isfile(path):
        raise ConfigError("dpp.cost_model", f"{path} is not a file ({how})")
    check_calibrated_for(path, cfg.model, cfg.parallel)


# Chunk attention through the layer spec and a module swap, its own schedule, and the position
# of its document stream in checkpoints.
SECTION = PluginSection("dpp", DppConfig, check=check, check_layout=check_layout, capabilities=frozenset({
    Capability.REWRITES_LAYER_SPECS, Capability.EDITS_BUILT_MODEL, Capability.OWNS_STEP,
    Capability.ADDS_CHECKPOINT_STATE}))


def layer_shape(mc) -> dict:
    """What a calibrated layer's times and bytes depend on, from a model config (ModelConfig)."""
    heads, moe = mc.num_attention_heads, bool(mc.num_experts)
    return dict(hidden=mc.hidden_size, ffn=mc.ffn_hidden_size, heads=heads, kv_heads=mc.num_query_groups or heads,
                head_dim=mc.head_dim or mc.hidden_size // heads, num_experts=mc.num_experts,
                moe_ffn=mc.moe_ffn_hidden_size if moe else None, topk=mc.moe_router_topk if moe else None)


def check_calibrated_for(path: str, mc, parallel=None) -> None:
    """Refuse a cost model calibrated on another layer shape than the model config `mc`'s (its
    times would be another model's, its parameter count the model states of another), or, given
    the run's `parallel` config, at another tensor parallelism. Fields a cost model written
    before they were recorded does not have are not compared."""
    shape = json.loads(Path(path).read_text()).get("shape", {})
    wanted = layer_shape(mc)
    if parallel is not None:
        wanted.update(tp=parallel.tp, sequence_parallel=bool(parallel.sequence_parallel and parallel.tp > 1))
    differ = [f"{k} {shape[k]} (this run: {wanted[k]})" for k in wanted if k in shape and shape[k] != wanted[k]]
    if differ:
        raise ConfigError(
            "dpp.cost_model", f"{path} was calibrated for another model: " + ", ".join(differ)
            + "; calibrate this one (python -m megatron_ext.dpp.tools.calibrate --model <its preset> [--tp N "
            "--sequence-parallel])"
        )
