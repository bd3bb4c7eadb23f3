"""What a checkpoint's plain state means: Megatron-LM's top-level keys, and the runtime's view.

A checkpoint's `common.pt` holds what Megatron-LM 0.16's `save_checkpoint` puts there:

    args                                  the run's arguments (config/mlm_namespace.py), with the
                                          data position in consumed_train_samples
    checkpoint_version                    3.0
    iteration
    opt_param_scheduler                   megatron-core's scheduler state, counted in samples
    num_floating_point_operations_so_far
    megatron_ext                          what only this runtime reads: tokenizer, data path,
                                          plugin states, the whole config

plus `content_metadata` (`distrib_optim_sharding_type` and the flags that shape the sharded
state dict), saved by dist_checkpointing beside them. So Megatron-LM resumes these checkpoints
and this runtime resumes Megatron-LM's.

The runtime works with one flat dictionary, `common` (Trainer.common_state): iteration,
consumed_samples, scheduler, padded_vocab_size, tokenizer, data_path, layout, plugins, config,
flops. `to_saved` and `from_saved` translate; `from_saved` also reads a checkpoint of the
runtime's earlier layout (everything under one `common` key) and one Megatron-LM wrote (no
`megatron_ext` key: what the runtime needs comes from `args`).

Scheduler steps: Megatron-LM's training loop advances the scheduler by each step's global batch,
so its warmup, decay and weight-decay lengths are samples. A run of this runtime with a fixed
global batch counts iterations (training/schedule.py); `to_saved` / `from_saved` scale by its
`samples_per_step` (1 where the run counts samples itself), which is exact.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Optional

from megatron_ext.config.mlm_namespace import layout_fields, model_config, tokenizer_spec
from megatron_ext.config.schema import ModelConfig, ParallelConfig

CHECKPOINT_VERSION = 3.0
EXTENSION_KEY = "megatron_ext"
# The runtime's layout of earlier releases: one key holding the whole `common` dictionary.
OLD_LAYOUT_KEY = "common"
SCHEDULER_STEPS = ("lr_warmup_steps", "num_steps", "lr_decay_steps", "wd_incr_steps")
# Sharding types of Megatron's distributed optimizer that load in any TP / PP (megatron-core's
# DistributedOptimizer.checkpoint_fully_reshardable_formats).
RESHARDABLE = ("fully_reshardable", "fully_sharded_model_space")
# What the runtime's own earlier checkpoints held: fully reshardable optimizer states under
# chained_<i> prefixes, and no content metadata.
OLD_LAYOUT_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


def content_metadata(distributed_optimizer: bool, fully_reshardable: bool) -> dict[str, Any]:
    """Megatron-LM's `_build_sharded_state_dict_metadata` for a torch_dist save (the process
    group it adds at run time is not saved)."""
    metadata: dict[str, Any] = {}
    if distributed_optimizer:
        if fully_reshardable:
            metadata["distrib_optim_sharding_type"] = "fully_reshardable"
            metadata["distrib_optim_fully_reshardable_mem_efficient"] = False
        else:
            metadata["distrib_optim_sharding_type"] = "dp_reshardable"
    metadata["singleton_local_shards"] = False
    metadata["chained_optim_avoid_prefix"] = True
    return metadata


def loading_metadata(saved: Optional[dict], args: Optional[argparse.Namespace]) -> dict[str, Any]:
    """The metadata a checkpoint's sharded state dict is read with: its own content metadata;
    for checkpoints written before Megatron-LM kept one, what Megatron-LM's `load_checkpoint`
    assumes of them (fully_sharded_model_space when saved fully parallel)."""
    if saved is not None:
        return dict(saved)
    if args is None:
        return dict(OLD_LAYOUT_METADATA)
    parallel_save = getattr(args, "ckpt_fully_parallel_save", False)
    return {"distrib_optim_sharding_type": "fully_sharded_model_space" if parallel_save else "dp_zero_gather_scatter"}


def layout_key(parallel: ParallelConfig) -> dict:
    """What decides which RNG stream each rank holds and how a `dp_reshardable` optimizer state
    is cut into buckets: the model-parallel cut of the layers and experts."""
    p = parallel
    return {"tp": p.tp, "pp": p.pp, "vpp": p.vpp, "first_stage_layers": p.first_stage_layers,
            "last_stage_layers": p.last_stage_layers, "ep": p.ep}


def optimizer_layout_problem(common: dict[str, Any], run_layout: dict) -> Optional[str]:
    """Why the optimizer state of a checkpoint (its `load_common`) cannot be read in
    `run_layout` (a `layout_key`), or None. Megatron's `dp_reshardable` and
    `dp_zero_gather_scatter` states are cut by the buckets of the layout that saved them."""
    sharding = loading_metadata(common.get("content_metadata"), common.get("args")).get("distrib_optim_sharding_type")
    saved = common.get("layout")
    if sharding in (None, *RESHARDABLE) or saved is None or saved == run_layout:
        return None
    where = ", ".join(f"{k}={v}" for k, v in saved.items() if v is not None)
    return (
        f"its optimizer state is {sharding}, which loads only in the layout that saved it ({where}): "
        "resume in that layout, or without the optimizer state (checkpoint.load_optim=false, "
        "--no-load-optim), or rewrite the checkpoint in this layout with python -m megatron_ext.reshard.convert"
    )


def scheduler_to_samples(state: dict[str, Any], samples_per_step: int) -> dict[str, Any]:
    return {k: v * samples_per_step if k in SCHEDULER_STEPS else v for k, v in state.items()}


def scheduler_from_samples(state: dict[str, Any], samples_per_step: int) -> dict[str, Any]:
    if samples_per_step == 1:
        return dict(state)
    steps = {k: state[k] / samples_per_step for k in SCHEDULER_STEPS if k in state}
    # whole numbers stay ints, so the scheduler's own checks compare them with its settings
    steps = {k: int(v) if float(v).is_integer() else v for k, v in steps.items()}
    return {**state, **steps}


def to_saved(common: dict[str, Any], args: argparse.Namespace, samples_per_step: int) -> dict[str, Any]:
    """The top-level plain entries of a save of `common` (without the scheduler when it is
    left out, as with --no-save-optim)."""
    extension = {k: v for k, v in common.items() if k not in ("iteration", "consumed_samples", "scheduler", "flops")}
    saved = {
        "args": args,
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": common["iteration"],
        "num_floating_point_operations_so_far": common.get("flops", 0),
        EXTENSION_KEY: extension,
    }
    if "scheduler" in common:
        saved["opt_param_scheduler"] = scheduler_to_samples(common["scheduler"], samples_per_step)
    return saved


def from_saved(saved: dict[str, Any]) -> dict[str, Any]:
    """The runtime's `common` of a checkpoint's plain entries, whoever wrote them. The scheduler
    is kept in samples (`scheduler_samples`) for the resuming run to scale; `args` is kept for
    what a resume takes from it. A Megatron-LM checkpoint has no tokenizer, data path, plugin
    states or config of this runtime: those are None / empty, and the run gives its own."""
    if OLD_LAYOUT_KEY in saved:
        common = dict(saved[OLD_LAYOUT_KEY])
        common["format"] = "megatron_ext_v1"
        if common.get("layout") is not None:  # its layout key named no expert parallelism; its config does
            common["layout"] = {**common["layout"], "ep": (common.get("config") or {}).get("parallel", {}).get("ep", 1)}
        return common
    args = saved.get("args")
    extension = saved.get(EXTENSION_KEY)
    common = {
        "iteration": saved.get("iteration", 0),
        "consumed_samples": getattr(args, "consumed_train_samples", 0),
        "flops": saved.get("num_floating_point_operations_so_far", 0),
        "args": args,
        "format": "megatron_ext" if extension is not None else "megatron_lm",
    }
    if "opt_param_scheduler" in saved:
        common["scheduler_samples"] = saved["opt_param_scheduler"]
    if extension is not None:
        return {**extension, **common}
    return {
        **common,
        "padded_vocab_size": getattr(args, "padded_vocab_size", None),
        "tokenizer": tokenizer_spec(args) if args is not None else None,
        "data_path": None,
        "layout": _saved_layout(args) if args is not None else None,
        "plugins": {},
        "config": None,
    }


def _saved_layout(args: argparse.Namespace) -> dict:
    return layout_key(ParallelConfig(**layout_fields(args)))


def saved_model_config(common: dict[str, Any]) -> ModelConfig:
    """The model a checkpoint holds: the runtime's saved config, or a Megatron-LM one's `args`."""
    if common.get("config") is not None:
        known = {f.name for f in dataclasses.fields(ModelConfig)}
        return ModelConfig(**{k: v for k, v in common["config"]["model"].items() if k in known})
    if common.get("args") is None:
        raise ValueError("the checkpoint records neither its model config nor Megatron-LM's args")
    return model_config(common["args"])
