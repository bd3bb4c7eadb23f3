"""A sweep's plan run on this world: every pack on its own ranks, packs on separate devices at
the same time (groups.py), one frozen base per rank.

Each job writes `<output_dir>/<job>/`: `log.txt`, `metrics.json`, `adapter/` (PEFT, by its pack's
leader rank) and `checkpoint/` (megatron dist_checkpointing). Every pack is checkpointed over its
own ranks (resume.py), also while other packs train on theirs, so a stopped sweep resumes.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_ext.config.schema import Config
from megatron_ext.lora import resume
from megatron_ext.lora.base import build_base
from megatron_ext.lora.export import save_megatron, save_peft
from megatron_ext.lora.groups import as_world, pack_groups
from megatron_ext.lora.job import LoraJob
from megatron_ext.lora.layers import logical_weights
from megatron_ext.lora.plan import Plan
from megatron_ext.lora.runtime import JobResult, PackedTrainer
from megatron_ext.models.gpt import padded_vocab_size


def execute(cfg: Config, jobs: Sequence[LoraJob], plan: Plan, data_for: Callable) -> dict[str, JobResult]:
    """Train `plan` (collective over the world); every rank returns every job's result.
    `lora.stop_after` counts the packed steps of each rank's packs; a pack runs at most what is
    left to the rank with the least left."""
    groups = pack_groups(plan, cfg.parallel.tp)
    model, wrappers, routing = build_base(cfg.model, padded_vocab_size(cfg.model.vocab_size, cfg.model, cfg.parallel.tp), cfg.train.seed)
    routing.kernel = cfg.lora.kernel
    out = Path(cfg.lora.output_dir)
    by_name = {j.name: j for j in jobs}
    results: dict[str, JobResult] = {}
    budget = cfg.lora.stop_after
    for index, pack in enumerate(plan.packs):
        if index not in groups:
            continue
        mine = groups[index]
        writer = dist.get_rank() == mine.leader
        trainer = PackedTrainer(model, wrappers, routing, data_for, pack.slots, _finisher(cfg, out, writer, mine.group),
                                _logger(out, writer), dp_group=mine.dp_group, group=mine.group,
                                max_pass_tokens=cfg.lora.max_pass_tokens)
        trainer.submit([by_name[n] for n in pack.jobs])
        folder = resume.pack_folder(out, index)
        resume.restore(trainer, folder)
        budget = _least_left(budget, mine.group)
        if not resume.finished(trainer) and budget != 0:
            taken = resume.run_pack(trainer, folder, cfg.lora.save_interval, budget)
            budget = None if budget is None else budget - taken
        if writer:
            results.update(trainer.results)
    return _gathered(results, jobs)


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
        weights = logical_weights(trainer.wrappers, active.slot)  # over megatron's TP group
        if writer:
            save_peft(out / active.job.name / "adapter", active.job, weights, cfg.model, cfg.model.pretrained)
        with as_world(group):
            save_megatron(out / active.job.name / "checkpoint", active.job, weights)

    return finish


def _gathered(results: dict[str, JobResult], jobs: Sequence[LoraJob]) -> dict[str, JobResult]:
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, results)
    merged = {name: r for part in everyone for name, r in part.items()}
    return {j.name: merged[j.name] for j in jobs}


def write_summary(out: Path, results: dict[str, JobResult]) -> dict:
    """{job: status, steps, losses, ...}; rank 0 writes it and each job's metrics.json."""
    summary = {
        name: {
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
    rows = [("job", "status", "steps", "train loss", "eval loss before", "eval loss after")]
    for name, s in summary.items():
        fmt = lambda v: f"{v:.4f}" if v is not None else "-"  # noqa: E731
        rows.append((name, s["status"], str(s["steps"]), fmt(s["loss"]), fmt(s["first_eval_loss"]), fmt(s["eval_loss"])))
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths)) for r in rows)
