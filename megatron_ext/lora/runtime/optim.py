"""Per-job optimisation: each job's AdamW, learning-rate schedule, step counter and gradient
clipping on its own gradient norm. Nothing is shared between jobs, so a job trained in a pack
takes exactly the steps it would take alone (megatron's optimizer clips on one global norm over
all parameters, which would couple the adapters)."""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist

from megatron_ext.lora.job import LoraJob


def learning_rate(job: LoraJob, step: int) -> float:
    """The lr of optimizer step `step` (0-based): linear warm-up, then constant / linear / cosine
    decay to `min_lr` at the job's last step."""
    if step < job.lr_warmup_steps:
        return job.lr * (step + 1) / job.lr_warmup_steps
    if job.lr_decay_style == "constant":
        return job.lr
    span = max(job.steps - job.lr_warmup_steps, 1)
    progress = min((step - job.lr_warmup_steps) / span, 1.0)
    if job.lr_decay_style == "linear":
        factor = 1.0 - progress
    else:
        factor = 0.5 * (1.0 + math.cos(math.pi * progress))
    return job.min_lr + (job.lr - job.min_lr) * factor


class JobOptimizer:
    """AdamW over one job's adapter tensors. `sharded[i]`: parameter i is split over `tp_group`
    (its squared norm is summed over the group; replicated ones count once); None: no TP."""

    def __init__(
        self, job: LoraJob, params: list[torch.nn.Parameter], sharded: list[bool], tp_group: Optional[dist.ProcessGroup] = None
    ) -> None:
        self.job = job
        self.params = params
        self.sharded = sharded
        self.tp_group = tp_group
        self.step_count = 0
        self.optimizer = torch.optim.AdamW(
            params,
            lr=job.lr,
            betas=(job.adam_beta1, job.adam_beta2),
            eps=job.adam_eps,
            weight_decay=job.weight_decay,
            foreach=False,
        )

    def grad_norm(self) -> float:
        """The adapters' global gradient norm: summed on the device, read once (one host sync)."""
        local = torch.zeros(2, dtype=torch.float64, device=self.params[0].device)
        for p, split in zip(self.params, self.sharded):
            if p.grad is not None:
                local[int(split)] += p.grad.detach().double().pow(2).sum()
        if self.tp_group is not None and self.tp_group.size() > 1:
            split = local[1:].clone()
            dist.all_reduce(split, group=self.tp_group)
            local[1] = split[0]
        return float(local.sum().sqrt())

    def step(self) -> tuple[float, float]:
        """Clip, set the lr, take one AdamW step, zero the grads. Returns (grad norm, lr)."""
        norm = self.grad_norm()
        clip = self.job.clip_grad
        if clip > 0 and norm > clip:
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(clip / (norm + 1e-6))
        lr = learning_rate(self.job, self.step_count)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step_count += 1
        return norm, lr

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def state_dict(self) -> dict:
        return {"step": self.step_count, "adam": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.step_count = state["step"]
        self.optimizer.load_state_dict(state["adam"])
