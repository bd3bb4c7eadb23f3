"""Packed training: K LoRA jobs on one frozen base, one base forward/backward per step.

Every step takes one micro-batch from each active job. The packed loss is the SUM over jobs of
each job's own loss (its per-token mean over the micro-batch, divided by its number of
accumulation micro-batches): adapter i's parameters only touch job i's batch columns, so
d(packed loss)/d(adapter i) is exactly the gradient job i gets alone. Each job steps its own
optimizer when it has accumulated its global batch, and leaves when it has taken its steps (or
its loss stops being finite); the next queued job takes the free slot at the next step.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

import torch

from megatron_ext.lora.batching import JobData, MicroBatch, pack
from megatron_ext.lora.job import LoraJob
from megatron_ext.lora.layers import MultiLoraLinear, Routing, install_job, remove_job
from megatron_ext.lora.optim import JobOptimizer

Wrappers = dict[tuple[int, str], MultiLoraLinear]


@dataclass
class JobResult:
    name: str
    status: str = "queued"  # queued | running | done | diverged
    steps: int = 0
    losses: list[float] = field(default_factory=list)  # per optimizer step
    eval_losses: dict[int, float] = field(default_factory=dict)  # step -> eval loss
    tokens: int = 0  # trained tokens (loss-counted or not)
    started_s: Optional[float] = None
    finished_s: Optional[float] = None


@dataclass
class ActiveJob:
    job: LoraJob
    slot: int
    optimizer: JobOptimizer
    data: Iterator[MicroBatch]
    eval_data: list[MicroBatch]
    generator: torch.Generator
    result: JobResult
    micro: int = 0  # micro-batches accumulated towards the next optimizer step
    step_loss: float = 0.0


def token_losses(model: torch.nn.Module, tokens: torch.Tensor, position_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Megatron's per-token cross entropy [b, s] (the causal mask is megatron's default)."""
    device = next(model.parameters()).device
    return model(tokens.to(device), position_ids.to(device), None, labels=labels.to(device))


class PackedTrainer:
    """Runs `jobs` through `capacity` slots of one model. `data_for(job)` gives the job's data;
    `on_finish(trainer, active)` runs while a finished job still sits in its slot (export,
    checkpoints); `log(job name, line)` gets a line per job event and optimizer step."""

    def __init__(
        self,
        model: torch.nn.Module,
        wrappers: Wrappers,
        routing: Routing,
        data_for: Callable[[LoraJob], JobData],
        capacity: int,
        on_finish: Optional[Callable[["PackedTrainer", ActiveJob], None]] = None,
        log: Callable[[str, str], None] = lambda job, line: None,
    ) -> None:
        self.model, self.wrappers, self.routing = model, wrappers, routing
        self.data_for, self.capacity = data_for, capacity
        self.on_finish, self.log = on_finish, log
        self.active: dict[int, ActiveJob] = {}
        self.queue: deque[LoraJob] = deque()
        self.results: dict[str, JobResult] = {}
        self.packed_steps = 0
        self.t0 = time.perf_counter()

    # --- job lifecycle --------------------------------------------------------------------------

    def submit(self, jobs: list[LoraJob]) -> None:
        for job in jobs:
            if job.name in self.results:
                raise ValueError(f"lora: job name {job.name!r} is used twice")
            self.results[job.name] = JobResult(job.name)
            self.queue.append(job)

    def _start(self, job: LoraJob, slot: int) -> None:
        params = install_job(self.wrappers, slot, job)
        sharded = []
        for wrapper in self.wrappers.values():
            if wrapper.slot(slot) is not None:
                split = wrapper.sharded(slot)
                sharded += [split["a"], split["b"]]
        data = self.data_for(job)
        result = self.results[job.name]
        result.status, result.started_s = "running", self._now()
        active = ActiveJob(
            job, slot, JobOptimizer(job, params, sharded), data.train(), data.eval(),
            torch.Generator().manual_seed(job.seed), result,
        )
        self.active[slot] = active
        if active.eval_data:  # the starting point each job's eval losses compare with
            result.eval_losses[0] = self.evaluate(active)
        self.log(job.name, f"started in slot {slot} (rank {job.rank}, lr {job.lr:g}, batch {job.global_batch_size})")

    def _finish(self, active: ActiveJob, status: str) -> None:
        active.result.status, active.result.finished_s = status, self._now()
        if status == "done":
            active.result.eval_losses[active.result.steps] = self.evaluate(active)
            if self.on_finish is not None:
                self.on_finish(self, active)
        remove_job(self.wrappers, active.slot)
        del self.active[active.slot]
        eval_loss = active.result.eval_losses.get(active.result.steps)
        tail = f", eval loss {eval_loss:.4f}" if eval_loss is not None else ""
        self.log(active.job.name, f"{status} after {active.result.steps} steps{tail}")

    def _fill_slots(self) -> None:
        for slot in range(self.capacity):
            if slot not in self.active and self.queue:
                self._start(self.queue.popleft(), slot)

    def _now(self) -> float:
        return time.perf_counter() - self.t0

    # --- steps ----------------------------------------------------------------------------------

    def run(self) -> dict[str, JobResult]:
        self._fill_slots()
        while self.active:
            self.step()
            self._fill_slots()
        return self.results

    def step(self) -> None:
        """One packed forward/backward; optimizer steps for the jobs whose batch is complete."""
        self.model.train()
        order = sorted(self.active)
        parts = [(slot, next(self.active[slot].data)) for slot in order]
        batch = pack(parts)
        self.routing.segments = batch.segments
        self.routing.generators = {slot: self.active[slot].generator for slot in order}
        losses = token_losses(self.model, batch.tokens, batch.position_ids, batch.labels)
        mask = batch.loss_mask.to(losses.device, losses.dtype)
        total, finite = [], {}
        for seg in batch.segments:
            active = self.active[seg.slot]
            rows = slice(seg.start, seg.stop)
            job_loss = (losses[rows] * mask[rows]).sum() / mask[rows].sum().clamp(min=1) / active.job.accumulation_steps
            value = float(job_loss.detach())
            finite[seg.slot] = value == value and abs(value) != float("inf")
            if finite[seg.slot]:
                total.append(job_loss)
                active.step_loss += value
            active.result.tokens += mask[rows].numel()
        if total:
            torch.stack(total).sum().backward()
        self.packed_steps += 1
        for slot in order:
            active = self.active[slot]
            if not finite[slot]:
                self._finish(active, "diverged")
                continue
            active.micro += 1
            if active.micro == active.job.accumulation_steps:
                self._optimizer_step(active)

    def _optimizer_step(self, active: ActiveJob) -> None:
        active.optimizer.step()
        result = active.result
        result.steps += 1
        result.losses.append(active.step_loss)
        active.micro, active.step_loss = 0, 0.0
        job = active.job
        line = f"step {result.steps}/{job.steps}: loss {result.losses[-1]:.4f}"
        if job.eval_interval and result.steps % job.eval_interval == 0 and result.steps < job.steps:
            result.eval_losses[result.steps] = self.evaluate(active)
            line += f", eval loss {result.eval_losses[result.steps]:.4f}"
        self.log(job.name, line)
        if result.steps == job.steps:
            self._finish(active, "done")

    @torch.no_grad()
    def evaluate(self, active: ActiveJob) -> float:
        """The job's token-weighted mean loss on its held-out batches (its adapter alone)."""
        self.model.eval()
        total, count = 0.0, 0.0
        for mb in active.eval_data:
            batch = pack([(active.slot, mb)])
            self.routing.segments = batch.segments
            losses = token_losses(self.model, batch.tokens, batch.position_ids, batch.labels)
            mask = batch.loss_mask.to(losses.device, losses.dtype)
            total += float((losses * mask).sum())
            count += float(mask.sum())
        self.model.train()
        return total / max(count, 1.0)
