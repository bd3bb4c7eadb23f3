"""One job's training checkpoint in the packed runtime, for an exact resume.

A job's folder is a megatron `dist_checkpointing` checkpoint (export.save_megatron, so
export.load_megatron reads its adapter like any other) holding, beside the adapter weights, what
the next step depends on:
  - Adam's moments (`adam.exp_avg.*`, `adam.exp_avg_sq.*`) and per-tensor step counts,
  - the gradients accumulated so far when the job stopped inside a global batch (`grad.*`),
  - the counters: optimizer steps (which also fix the LR-schedule position, optim.learning_rate),
    micro-batches accumulated, the loss summed over them, micro-batches of the data stream used.
Tensors are stored logical (gathered over TP), so a checkpoint loads under another TP; gradients
are summed over DP every packed step, so one copy serves every DP layout too.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from megatron_ext.lora.export import Weights, load_megatron_state, save_megatron, sharded_weights, weights_from
from megatron_ext.lora.job import LoraJob
from megatron_ext.lora.runtime.active_job import ActiveJob
from megatron_ext.lora.runtime.groups import as_world
from megatron_ext.lora.runtime.layers import MultiLoraLinear

MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclass
class JobState:
    weights: Weights
    moments: dict[str, Weights]  # empty before the job's first optimizer step
    adam_steps: dict[str, tuple[torch.Tensor, torch.Tensor]]  # "layer.target" -> A's, B's step
    grads: Weights  # empty at a global-batch boundary
    counters: dict[str, float]  # step_count, micro, step_loss, consumed


def save_job(
    folder: Path, active: ActiveJob, wrappers: dict[tuple[int, str], MultiLoraLinear], group: Optional[dist.ProcessGroup] = None
) -> None:
    """Write `active`'s state to `folder` (collective over `group`, default the world: the
    ranks that train the job)."""
    weights, moments, steps, grads = {}, {name: {} for name in MOMENTS}, {}, {}
    adam = active.optimizer.optimizer.state
    for key, wrapper in wrappers.items():
        adapter = wrapper.slot(active.slot)
        if adapter is None:
            continue
        weights[key] = wrapper.logical(active.slot)
        if adapter.a in adam:
            for name in MOMENTS:
                moments[name][key] = wrapper.logical_pair(adam[adapter.a][name], adam[adapter.b][name])
            steps[f"{key[0]}.{key[1]}"] = (adam[adapter.a]["step"].clone(), adam[adapter.b]["step"].clone())
        if adapter.a.grad is not None:
            grads[key] = wrapper.logical_pair(adapter.a.grad, adapter.b.grad)
    counters = {"step_count": active.optimizer.step_count, "micro": active.micro, "step_loss": active.step_loss,
                "consumed": active.consumed}
    # The TP gathers above run over the pack's TP group (the wrappers'); the save over `group` alone (replicas
    # are numbered by rank in it, so its first rank writes).
    with as_world(group):
        extra = sharded_weights(grads, "grad")
        for name in MOMENTS:
            extra.update(sharded_weights(moments[name], f"adam.{name}"))
        save_megatron(folder, active.job, weights, {**extra, "adam_steps": steps, "counters": counters})


def load_job(folder: Path, job: LoraJob, group: Optional[dist.ProcessGroup] = None) -> JobState:
    """The state `save_job` wrote for `job` (collective over `group`, default the world);
    refuses a checkpoint of another job."""
    with as_world(group):
        saved, state = load_megatron_state(folder)
    changed = [f.name for f in dataclasses.fields(LoraJob) if getattr(saved, f.name) != getattr(job, f.name)]
    if changed:
        raise ValueError(f"lora job {job.name!r}: the checkpoint in {folder} was written with other {changed}")
    return JobState(
        weights=weights_from(state, "lora"),
        moments={name: weights_from(state, f"adam.{name}") for name in MOMENTS if state["adam_steps"]},
        adam_steps=state["adam_steps"],
        grads=weights_from(state, "grad"),
        counters=state["counters"],
    )


def restore(wrappers: dict[tuple[int, str], MultiLoraLinear], active: ActiveJob, state: JobState) -> None:
    """Give the job just installed in `active.slot` (from `state.weights`) the rest of its state."""
    adam = active.optimizer.optimizer.state
    for key, wrapper in wrappers.items():
        adapter = wrapper.slot(active.slot)
        if adapter is None:
            continue
        steps = state.adam_steps.get(f"{key[0]}.{key[1]}")
        if steps is not None:
            locals_ = {name: wrapper.local_pair(*state.moments[name][key]) for name in MOMENTS}
            for i, param in enumerate((adapter.a, adapter.b)):
                adam[param] = {"step": steps[i].clone(), **{name: locals_[name][i].clone() for name in MOMENTS}}
        if key in state.grads:
            adapter.a.grad, adapter.b.grad = (g.clone() for g in wrapper.local_pair(*state.grads[key]))
    counters = state.counters
    active.optimizer.step_count = int(counters["step_count"])
    active.micro, active.step_loss, active.consumed = int(counters["micro"]), counters["step_loss"], int(counters["consumed"])
