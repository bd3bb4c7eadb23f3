"""A sweep's plan run on this world: every pack on its own ranks at its own TP degree, packs on
separate ranks at the same time (groups.py). A rank holds one frozen base at a time, built on its
pack's TP group: packs that follow on the same TP group train on it too, and a pack on another
one frees it before building its own.

Each job writes `<output_dir>/<job>/`: `log.txt`, `metrics.json`, `adapter/` (PEFT, by its pack's
leader rank) and `checkpoint/` (megatron dist_checkpointing). Every pack is checkpointed over its
own ranks (resume.py), also while other packs train on theirs, so a stopped sweep resumes.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
from megatron.core.process_groups_config import ProcessGroupCollection

from megatron_ext.config.schema import Config
from megatron_ext.lora.export import peft_base_model, save_megatron, save_peft
from megatron_ext.lora.job import LoraJob
from megatron_ext.lora.planning import pass_size
from megatron_ext.lora.planning.plan import Plan
from megatron_ext.lora.runtime import resume
from megatron_ext.lora.runtime.active_job import JobResult
from megatron_ext.lora.runtime.base import build_base
from megatron_ext.lora.runtime.groups import PackGroups, as_world, pack_groups
from megatron_ext.lora.runtime.layers import Routing, logical_weights
from megatron_ext.lora.runtime.packed import PackedTrainer
from megatron_ext.models.gpt import padded_vocab_size


@dataclass
class Base:
    """A rank's frozen base and the model groups (groups.PackGroups.model_groups) it is built on."""

    groups: ProcessGroupCollection
    model: torch.nn.Module
    wrappers: dict
    routing: Routing


def execute(
    cfg: Config, jobs: Sequence[LoraJob], plan: Plan, data_for: Callable, dtype: Optional[torch.dtype] = None
) -> dict[str, JobResult]:
    """Train `plan` (collective over the world); every rank returns every job's result.
    `lora.stop_after` counts the packed steps of each rank's packs; a pack runs at most what is
    left to the rank with the least left. `dtype` casts every base (torch.float64 for exactness
    checks)."""
    groups = pack_groups(plan)
    # One vocabulary padding for every pack's TP, so that all packs train the same logical model.
    vocab = padded_vocab_size(cfg.model.vocab_size, cfg.model, math.lcm(*(p.tp for p in plan.packs)))
    by_name = {j.name: j for j in jobs}
    results: dict[str, JobResult] = {}
    budget = cfg.lora.stop_after
    base: Optional[Base] = None
    for index, pack in enumerate(plan.packs):
        if index not in groups:
            continue
        mine = groups[index]
        if base is None or base.groups is not mine.model_groups:
            base = None  # freed before the next one is built: one base per rank at a time
            base = _build_base(cfg, vocab, mine.model_groups, dtype)
        budget = _least_left(budget, mine.group)
        trained, taken = _train_pack(cfg, base, mine, [by_name[n] for n in pack.jobs], pack.slots, index, data_for, budget)
        results.update(trained)
        budget = None if budget is None else budget - taken
    return _gathered(results, jobs)


def _build_base(cfg: Config, vocab: int, groups: ProcessGroupCollection, dtype: Optional[torch.dtype]) -> Base:
    model, wrappers, routing = build_base(cfg.model, vocab, cfg.train.seed, dtype, groups)
    routing.kernel = cfg.lora.kernel
    return Base(groups, model, wrappers, routing)


def _train_pack(
    cfg: Config, base: Base, mine: PackGroups, jobs: list[LoraJob], slots: int, index: int, data_for: Callable, budget: Optional[int]
) -> tuple[dict[str, JobResult], int]:
    """Run (or continue) pack `index` on `base` for at most `budget` packed steps; its jobs'
    results (on its leader rank; none elsewhere) and the packed steps taken."""
    out = Path(cfg.lora.output_dir)
    writer = dist.get_rank() == mine.leader
    trainer = PackedTrainer(base.model, base.wrappers, base.routing, data_for, slots, _finisher(cfg, out, writer, mine.group),
                            _logger(out, writer), dp_group=mine.dp_group, group=mine.group,
                            max_pass_tokens=pass_size.pass_cap(cfg))
    trainer.submit(jobs)
    folder = resume.pack_folder(out, index)
    resume.restore(trainer, folder)
    taken = 0
    if not resume.finished(trainer) and budget != 0:
        taken = resume.run_pack(trainer, folder, cfg.lora.save_interval, budget)
    return (trainer.results if writer else {}), taken


def _least_left(budget: Optional[int], group: dist.ProcessGroup) -> Optional[int]:
    """The packed steps every rank of the pack still has (ranks that ran other packs before
    differ), so that all of them stop at the same step."""
    if budget is None:
        return None
    left = torch.tensor([budget])
    dist.all_reduce(left, op=dist.ReduceOp.MIN, group=group)
    return int(left.item())


def _logger(out: Path, writer: bool) -> Callable[[str, str], None]:
    def log(name: str, line: str) -> None:
        if not writer:
            return
        (out / name).mkdir(parents=True, exist_ok=True)
        with open(out / name / "log.txt", "a") as f:
            f.write(line + "\n")
        if not line.startswith("step") or "eval" in line:
            print(f"[{name}] {line}", flush=True)

    return log


def _finisher(cfg: Config, out: Path, writer: bool, group: dist.ProcessGroup) -> Callable:
    def finish(trainer: PackedTrainer, active) -> None:
        weights = logical_weights(trainer.wrappers, active.slot)  # over the pack's TP group
        if writer:
            base = peft_base_model(cfg.model.pretrained, cfg.lora.peft_base_model)
            save_peft(out / active.job.name / "adapter", active.job, weights, cfg.model, base)
        with as_world(group):
            save_megatron(out / active.job.name / "checkpoint", active.job, weights)

    return finish


def _gathered(results: dict[str, JobResult], jobs: Sequence[LoraJob]) -> dict[str, JobResult]:
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, results)
    merged = {name: r for part in everyone for name, r in part.items()}
    return {j.name: merged[j.name] for j in jobs}


def write_summary(out: Path, results: dict[str, JobResult], jobs: Sequence[LoraJob]) -> dict:
    """{job: dataset, status, steps, losses, validation losses, ...} of `results` (of `jobs`);
    rank 0 writes it and each job's metrics.json, and prints it as a table."""
    datasets = {j.name: j.dataset for j in jobs}
    summary = {
        name: {
            "dataset": datasets[name],
            "status": r.status,
            "steps": r.steps,
            "loss": r.losses[-1] if r.losses else None,
            "eval_loss": r.eval_losses.get(r.steps),
            "first_eval_loss": r.eval_losses.get(0),
            "seconds": (r.finished_s or 0.0) - (r.started_s or 0.0),
            "error": r.error,
        }
        for name, r in results.items()
    }
    if dist.get_rank() == 0:
        for name, r in results.items():
            (out / name).mkdir(parents=True, exist_ok=True)
            (out / name / "metrics.json").write_text(json.dumps(dataclasses.asdict(r), indent=2) + "\n")
        (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        print(summary_table(summary), flush=True)
    return summary


def summary_table(summary: dict) -> str:
    """One row a job: its dataset, how it ended, its last training loss and its validation loss
    before and after training."""
    rows = [("job", "dataset", "status", "steps", "train loss", "valid loss before", "valid loss after")]
    for name, s in summary.items():
        fmt = lambda v: f"{v:.4f}" if v is not None else "-"  # noqa: E731
        rows.append((name, s["dataset"], s["status"], str(s["steps"]), fmt(s["loss"]), fmt(s["first_eval_loss"]),
                     fmt(s["eval_loss"])))
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths)) for r in rows)
