"""Packed training: K LoRA jobs on one frozen base, one base forward/backward per step.

Every step takes one micro-batch from each active job. The packed loss is the SUM over jobs of
each job's own loss (its per-token mean over the micro-batch, divided by its number of
accumulation micro-batches): adapter i's parameters only touch job i's batch columns, so
d(packed loss)/d(adapter i) is exactly the gradient job i gets alone. With `max_pass_tokens`
a step runs its micro-batches as several passes (whole micro-batches in slot order, each pass
at most that many padded tokens, a sample counted at its job's longest:
workload.split_passes), each a forward and backward whose
gradients add to the others': a job sits in one pass, so its gradient is still its own, and
the activations held at once are one pass's, not the whole step's. Each job steps its own
optimizer when it has accumulated its global batch, and leaves when it has taken its steps (or
its loss stops being finite); the next queued job takes the free slot at the next step.

Data parallelism: on D ranks (megatron's data-parallel group), each job's micro-batches are dealt
round-robin (rank r takes micro-batches r, r+D, ...) and every packed step sums the new adapter
gradients over the group (the base is frozen and has none), so each optimizer step sees the same
global batch, normalised the same way, as on one rank. A job's micro-batches per step must be a
multiple of D. Dropout masks are drawn per micro-batch from (job seed, micro-batch index), so they
do not depend on D either, nor on where a resumed run stopped. Under a pass cap every rank
splits a step alike: by each job's longest sample (LoraJob.longest_sample), not by the lengths
of the micro-batches this rank holds, which differ between ranks for data of varying lengths;
and the gradients are still summed once per step, after its last pass.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import time
from collections import deque
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_ext.lora.job import LoraJob
from megatron_ext.lora.planning.workload import split_passes
from megatron_ext.lora.runtime import checkpoint
from megatron_ext.lora.runtime.active_job import ActiveJob, JobResult
from megatron_ext.lora.runtime.batching import JobData, MicroBatch, pack
from megatron_ext.lora.runtime.layers import MultiLoraLinear, Routing, install_job, remove_job
from megatron_ext.lora.runtime.optim import JobOptimizer
from megatron_ext.checkpointing import torch_dist as ckpt

Wrappers = dict[tuple[int, str], MultiLoraLinear]


def token_losses(model: torch.nn.Module, tokens: torch.Tensor, position_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The model's per-token cross entropy [b, s] (build_base gives it loss.py's, over the model's
    own TP group; the causal mask is megatron's default)."""
    device = next(model.parameters()).device
    return model(tokens.to(device), position_ids.to(device), None, labels=labels.to(device))


class PackedTrainer:
    """Runs `jobs` through `capacity` slots of one model. `data_for(job)` gives the job's data;
    `on_finish(trainer, active)` runs while a finished job still sits in its slot (export,
    checkpoints); `log(job name, line)` gets a line per job event and optimizer step.
    `dp_group`: the ranks that share each job's batches (default: megatron's data-parallel group);
    `group`: every rank that trains these jobs (default: the world), which agree on a job that
    fails to start, and write and read its checkpoints (`save`, `resume`).
    `max_pass_tokens`: the most padded tokens of one forward/backward (None: one per step)."""

    def __init__(
        self,
        model: torch.nn.Module,
        wrappers: Wrappers,
        routing: Routing,
        data_for: Callable[[LoraJob], JobData],
        capacity: int,
        on_finish: Optional[Callable[["PackedTrainer", ActiveJob], None]] = None,
        log: Callable[[str, str], None] = lambda job, line: None,
        dp_group: Optional[dist.ProcessGroup] = None,
        group: Optional[dist.ProcessGroup] = None,
        max_pass_tokens: Optional[int] = None,
    ) -> None:
        if max_pass_tokens is not None and max_pass_tokens < 1:
            raise ValueError(f"lora: max_pass_tokens must be >= 1 (or None), got {max_pass_tokens}")
        self.model, self.wrappers, self.routing = model, wrappers, routing
        self.data_for, self.capacity = data_for, capacity
        self.on_finish, self.log = on_finish, log
        self.active: dict[int, ActiveJob] = {}
        self.queue: deque[LoraJob] = deque()
        self.results: dict[str, JobResult] = {}
        self.packed_steps = 0
        self.t0 = time.perf_counter()
        self.dp_group = dp_group if dp_group is not None else parallel_state.get_data_parallel_group()
        self.dp, self.dp_rank = dist.get_world_size(self.dp_group), dist.get_rank(self.dp_group)
        self.group = group
        self.max_pass_tokens = max_pass_tokens

    # --- job lifecycle --------------------------------------------------------------------------

    def submit(self, jobs: list[LoraJob]) -> None:
        for job in jobs:
            if job.name in self.results:
                raise ValueError(f"lora: job name {job.name!r} is used twice")
            if job.accumulation_steps % self.dp:
                raise ValueError(
                    f"lora job {job.name!r}: {job.accumulation_steps} micro-batches per step do not split over "
                    f"{self.dp} data-parallel ranks (global_batch_size must be a multiple of micro_batch_size x {self.dp})"
                )
        for job in jobs:
            self.results[job.name] = JobResult(job.name)
            self.queue.append(job)

    def _start(self, job: LoraJob, slot: int, saved: Optional[Path] = None) -> None:
        """Put `job` into the free `slot`, fresh or from its checkpoint folder `saved`. All or
        nothing: if any part fails on any rank (its data, its adapter, its checkpoint), the slot
        stays empty, the other jobs are untouched, and the job is marked failed with the error."""
        result = self.results[job.name]
        try:
            active, error = self._prepare(job, slot, saved), None
        except Exception as exc:  # noqa: BLE001 - any failure of one job must spare the others
            active, error = None, f"{type(exc).__name__}: {exc}"
        if self._failed_on_any_rank(error is not None):
            remove_job(self.wrappers, slot)
            result.status = "failed"
            result.error = f"lora job {job.name!r} could not start in slot {slot}: {error or 'failed on another rank'}"
            self.log(job.name, result.error)
            return
        self.active[slot] = active
        result.status = "running"
        if saved is None:
            result.started_s = self._now()
            if active.eval_data:  # the starting point each job's eval losses compare with
                result.eval_losses[0] = self.evaluate(active)
        tp = next(iter(self.wrappers.values())).tp
        self.log(job.name, f"{'resumed' if saved else 'started'} in slot {slot} (rank {job.rank}, lr {job.lr:g}, batch {job.global_batch_size}, TP {tp})")

    def _prepare(self, job: LoraJob, slot: int, saved: Optional[Path]) -> ActiveJob:
        data = self.data_for(job)
        state = checkpoint.load_job(saved, job, self.group) if saved is not None else None
        params = install_job(self.wrappers, slot, job, state.weights if state else None)
        sharded, tp_group = [], None
        for wrapper in self.wrappers.values():
            if wrapper.slot(slot) is not None:
                split = wrapper.sharded(slot)
                sharded += [split["a"], split["b"]]
                tp_group = wrapper.tp_group  # one base: every wrapper's is the same
        optimizer = JobOptimizer(job, params, sharded, tp_group)
        active = ActiveJob(job, slot, optimizer, iter(()), data.eval(), self.results[job.name])
        if state is not None:
            checkpoint.restore(self.wrappers, active, state)
        active.data = itertools.islice(data.train(), active.consumed + self.dp_rank, None, self.dp)
        return active

    def _failed_on_any_rank(self, failed: bool) -> bool:
        if not dist.is_initialized() or dist.get_world_size(self.group) == 1:
            return failed
        flag = torch.tensor([float(failed)])
        dist.all_reduce(flag, group=self.group)
        return bool(flag.item())

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
            while slot not in self.active and self.queue:  # a job that fails to start frees it again
                self._start(self.queue.popleft(), slot)

    def _now(self) -> float:
        return time.perf_counter() - self.t0

    # --- steps ----------------------------------------------------------------------------------

    def run(self, until: Optional[int] = None) -> dict[str, JobResult]:
        """Train until every job has left, or until `until` packed steps (then `save` can
        checkpoint the run and a new trainer `resume` it)."""
        self._fill_slots()
        while self.active and (until is None or self.packed_steps < until):
            self.step()
            self._fill_slots()
        return self.results

    def step(self) -> None:
        """One micro-batch of every active job, forward/backward in one pass or several (the
        pass cap); optimizer steps for the jobs whose batch is complete. Under DP the earlier
        gradients are set aside before the first pass and this step's summed after the last."""
        self.model.train()
        order = sorted(self.active)
        parts = [(slot, next(self.active[slot].data)) for slot in order]
        self.routing.generators = {slot: self._dropout_generator(self.active[slot]) for slot in order}
        earlier = self._take_grads(order) if self.dp > 1 else {}
        values: dict[int, float] = {}
        sizes = [(mb.batch_size, self.active[slot].job.longest_sample) for slot, mb in parts]
        for group in split_passes(sizes, self.max_pass_tokens):
            values.update(self._pass([parts[i] for i in group]))
        if self.dp > 1:
            self._reduce_grads(earlier)
        self.packed_steps += 1
        for slot in order:
            active = self.active[slot]
            active.consumed += self.dp
            if not math.isfinite(values[slot]):
                self._finish(active, "diverged")
                continue
            active.step_loss += values[slot]
            active.micro += self.dp
            if active.micro == active.job.accumulation_steps:
                self._optimizer_step(active)

    def _pass(self, parts: list[tuple[int, MicroBatch]]) -> dict[int, float]:
        """Forward and backward of one packed batch of `parts`; each job's loss summed over DP.
        A job whose loss is not finite on some rank is left out of the backward."""
        batch = pack(parts)
        self.routing.segments = batch.segments
        losses = token_losses(self.model, batch.tokens, batch.position_ids, batch.labels)
        mask = batch.loss_mask.to(losses.device, losses.dtype)
        job_losses, tokens = {}, {}
        for seg, (_, mb) in zip(batch.segments, parts):
            active = self.active[seg.slot]
            # Its own tokens only: the padding its pass partners' lengths add would change the
            # rounding of its loss and its token count.
            own = (slice(seg.start, seg.stop), slice(0, mb.tokens.shape[1]))
            job_losses[seg.slot] = (losses[own] * mask[own]).sum() / mask[own].sum().clamp(min=1) / active.job.accumulation_steps
            tokens[seg.slot] = mb.tokens.numel()
        values, tokens = self._sum_over_dp(job_losses, tokens)
        for slot, count in tokens.items():
            self.active[slot].result.tokens += int(count)
        kept = [loss for slot, loss in job_losses.items() if math.isfinite(values[slot])]
        if kept:
            torch.stack(kept).sum().backward()
        return values

    def _dropout_generator(self, active: ActiveJob) -> torch.Generator:
        index = active.consumed + self.dp_rank  # this rank's micro-batch of the job's stream
        return torch.Generator().manual_seed((active.job.seed * 1_000_033 + index) % 2**63)

    def _sum_over_dp(self, job_losses: dict[int, torch.Tensor], tokens: dict[int, int]) -> tuple[dict[int, float], dict[int, float]]:
        """Each job's loss (non-finite when it is on any rank) and tokens, summed over the DP
        ranks (whose micro-batches may differ in length)."""
        slots = sorted(job_losses)
        values = torch.tensor([float(job_losses[slot].detach()) for slot in slots] + [tokens[slot] for slot in slots],
                              dtype=torch.float64)
        if self.dp > 1:
            dist.all_reduce(values, group=self.dp_group)
        return dict(zip(slots, values[: len(slots)].tolist())), dict(zip(slots, values[len(slots) :].tolist()))

    def _take_grads(self, slots: list[int]) -> dict[torch.nn.Parameter, Optional[torch.Tensor]]:
        """Detach the gradients accumulated so far (the same on every DP rank), so that only
        this step's are summed over DP."""
        earlier = {}
        for slot in slots:
            for p in self.active[slot].optimizer.params:
                earlier[p], p.grad = p.grad, None
        return earlier

    def _reduce_grads(self, earlier: dict[torch.nn.Parameter, Optional[torch.Tensor]]) -> None:
        fresh = [p for p in earlier if p.grad is not None]  # the same set on every rank
        if fresh:
            flat = torch.cat([p.grad.reshape(-1) for p in fresh])
            dist.all_reduce(flat, group=self.dp_group)
            for p, g in zip(fresh, flat.split([p.numel() for p in fresh])):
                p.grad = g.view_as(p)
        for p, grad in earlier.items():
            if grad is not None:
                p.grad = grad if p.grad is None else grad.add_(p.grad)

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

    # --- checkpoints ----------------------------------------------------------------------------

    def save(self, folder: str | Path) -> Path:
        """Checkpoint the run (collective over `group`) as `<folder>/iter_<packed step>/`: each
        active job's training state under `<job>/` (checkpoint.save_job), then the queue, the
        slots and every job's results in `trainer.json`. Written like the trainer's checkpoints
        (a staging folder, renamed and recorded in the tracker once complete); only the latest
        is kept."""
        return ckpt.write_staged(folder, self.packed_steps, self._write, keep_last=1, group=self.group)

    def _write(self, folder: Path) -> None:
        for slot in sorted(self.active):
            checkpoint.save_job(folder / self.active[slot].job.name, self.active[slot], self.wrappers, self.group)
        if dist.get_rank(self.group) == 0:
            state = {
                "packed_steps": self.packed_steps,
                "slots": {active.job.name: slot for slot, active in self.active.items()},
                "queue": [job.name for job in self.queue],
                "results": {name: dataclasses.asdict(r) for name, r in self.results.items()},
            }
            (folder / "trainer.json").write_text(json.dumps(state, indent=1) + "\n")

    def resume(self, folder: str | Path) -> None:
        """Continue the run whose latest checkpoint `save(folder)` wrote: call after `submit`
        with the same jobs and before `run`; each job continues exactly where it stopped."""
        latest = ckpt.latest_iteration(folder)
        if latest is None:
            raise ValueError(f"lora: {folder} holds no checkpoint ({ckpt.TRACKER} is missing)")
        folder = ckpt.iteration_dir(folder, latest)
        state = json.loads((folder / "trainer.json").read_text())
        if self.active or self.packed_steps:
            raise RuntimeError("lora: resume a trainer before it has run")
        if set(state["results"]) != set(self.results):
            raise ValueError(f"lora: {folder} holds jobs {sorted(state['results'])}, not the submitted {sorted(self.results)}")
        for name, saved in state["results"].items():
            saved["eval_losses"] = {int(step): loss for step, loss in saved["eval_losses"].items()}
            self.results[name] = JobResult(**saved)
        jobs = {job.name: job for job in self.queue}
        self.queue = deque(jobs[name] for name in state["queue"])
        self.packed_steps = state["packed_steps"]
        for name, slot in sorted(state["slots"].items(), key=lambda item: item[1]):
            self._start(jobs[name], slot, folder / name)

