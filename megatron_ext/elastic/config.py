"""The elastic plugin's config section (`elastic.*`) and its checks before launch; no torch."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from megatron_ext.config.capabilities import Capability
from megatron_ext.config.plugin_sections import PluginSection
from megatron_ext.config.schema import Config, ModelConfig
from megatron_ext.config.validate import ConfigError


@dataclass
class ElasticConfig:
    # Fractions of the parent's parameters (total, or active with cost=active_params), largest first.
    budgets: list[float] = field(default_factory=lambda: [1.0, 0.75, 0.5])
    # Allowed sizes per axis kind, e.g. {hidden: [64, 96, 128], heads: [2, 4], ffn: [...]}.
    # None: every kind gets `default_choices` sizes from half to all of its width. (Typed Any:
    # Hydra's struct mode refuses new keys in a typed dict override.)
    grid: Any = None
    default_choices: int = 8  # Sizes per axis kind of the default grid (from half to all of its width).
    # A budget must be within this (relative) of some submodel of the grid.
    tolerance: float = 0.05
    # What a budget is a fraction of: params (total) | active_params (MoE: the top-k experts a token uses).
    cost: str = "params"
    # Curriculum: each micro-batch or sample (`budget_draw`) draws its budget, uniformly for
    # `uniform_steps`, then with `skew` (largest budget first).
    uniform_steps: int = 50
    # Draw probabilities after uniform_steps, in the order of budgets; None: uniform throughout.
    skew: Optional[list[float]] = field(default_factory=lambda: [0.5, 0.3, 0.2])
    # What draws a budget: "micro_batch" (one budget and one router sample per micro-batch, from
    # (seed, step, global micro-batch index)) or "sample" (one budget per sample, from (seed,
    # step, global sample index); the router samples each budget once per step; `grouped.py`).
    budget_draw: str = "micro_batch"
    # Consecutive global micro-batches that draw one budget and router sample together (per
    # sample: the same budgets row by row). Expert parallelism needs a multiple of parallel.ep
    # (`expert_parallel.py`); a one-process run with the same value draws the same.
    budget_share: int = 1
    temperature: float = 1.0  # Softmax temperature of the distillation loss KL(teacher || student) (times its square).
    ce_weight: float = 0.0  # Weight of the next-token loss added to the distillation loss (0: distillation alone).
    # Which tokens the distillation loss covers and counts in its per-token mean: "loss_mask",
    # the batch's loss mask (with data=sft the assistant's tokens), or "all", every token of each
    # conversation whose next token is of the same conversation (the prompts too; not the
    # padding, not across conversations); pre-training batches hold no conversations, so there
    # "all" is the loss mask. The next-token loss (ce_weight) stays on the loss mask.
    distill_tokens: str = "loss_mask"
    # Micro-batches of the whole run (all replicas together) the importance is measured on.
    calibration_batches: int = 4
    router_hidden: int = 64  # Hidden width of the router's MLP per axis kind.
    router_lr: float = 1e-2  # The router's Adam learning rate.
    anneal_steps: int = 100  # Steps over which the router's Gumbel temperature falls and logit scale rises.
    # Where the router starts: "quality", each budget's grid submodel of least KD loss to the
    # parent on the calibration batches (pruned, scored before the first step); "cost", any
    # submodel of the budget's cost (no model forward).
    router_start: str = "quality"
    # Router steps fitting it to that start before the first distillation step.
    router_warmup_steps: int = 200
    # FP8 quantisation-aware distillation: the student reads its decoder linears fake-quantised
    # to e4m3 with the parent's per-tensor scales (`fp8.py`; evaluation too, as deployed); the
    # teacher stays in full precision. The nested checkpoint is then written in FP8.
    fp8: bool = False
    # Write the nested checkpoint of every budget and report.json here at the end; None: no export.
    export_dir: Optional[str] = None


ROUTER_STARTS = ("quality", "cost")
DISTILL_TOKENS = ("loss_mask", "all")


def model_space_refusals(model: ModelConfig) -> list[tuple[str, str]]:
    """(field, what) for the model-space options elastic's axes do not slice: they cut the
    weights of LLaMA-style layers (RMSNorm, gated MLPs, no biases, RoPE) and of routed experts."""
    found = [
        (model.normalization != "RMSNorm", "model.normalization",
         "LayerNorm (its bias is not sliced with the hidden axis)"),
        (model.activation != "swiglu", "model.activation", f"{model.activation} (the FFN axes slice gated MLPs)"),
        (model.add_bias_linear or model.add_qkv_bias, "model.add_bias_linear",
         "linear biases (not sliced with the axes)"),
        (model.position_embedding_type == "learned_absolute", "model.position_embedding_type",
         "learned_absolute (the position table is not sliced with the hidden axis)"),
        (model.multi_latent_attention, "model.multi_latent_attention", "multi-latent attention (no axes for it)"),
        (model.softmax_type != "vanilla", "model.softmax_type",
         f"softmax offsets (softmax_type={model.softmax_type}: one per head, not sliced with the heads axis)"),
        (model.mtp_num_layers is not None, "model.mtp_num_layers",
         "multi-token prediction (its layers are not sliced with the axes)"),
        (model.moe_shared_expert_intermediate_size is not None, "model.moe_shared_expert_intermediate_size",
         "shared experts (not sliced with the hidden axis)"),
        (model.moe_router_num_groups is not None, "model.moe_router_num_groups",
         "group-limited routing (dropping experts breaks the groups)"),
    ]
    return [(field, what) for bad, field, what in found if bad]


def check_distill_tokens(value: str) -> None:
    if value not in DISTILL_TOKENS:
        raise ConfigError("elastic.distill_tokens", f"{value!r} is not one of {', '.join(DISTILL_TOKENS)}")


def check(own: ElasticConfig, cfg: Config, world_size: int) -> None:
    """Settings, or a model with options elastic's axes do not slice, are refused."""
    if own.router_start not in ROUTER_STARTS:
        raise ConfigError("elastic.router_start", f"{own.router_start!r} is not one of {', '.join(ROUTER_STARTS)}")
    check_distill_tokens(own.distill_tokens)
    refusals = [(field, f"elastic does not support {what}") for field, what in model_space_refusals(cfg.model)]
    if refusals:
        raise ConfigError(*refusals[0], refusals[1:])


# Elastic modules swapped in after the model is built, the frozen parent held beside it as the
# teacher, the distillation step and loss, and the router's state in checkpoints.
SECTION = PluginSection("elastic", ElasticConfig, check=check, capabilities=frozenset({
    Capability.EDITS_BUILT_MODEL, Capability.HOLDS_EXTRA_MODULES, Capability.OWNS_STEP, Capability.CHANGES_LOSS,
    Capability.ADDS_CHECKPOINT_STATE}))
