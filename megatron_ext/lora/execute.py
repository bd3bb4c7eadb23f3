"""A sweep's plan run on this world: every pack on its own ranks, packs on separate devices at
the same time (groups.py), one frozen base per rank.

Each job writes `<output_dir>/<job>/`: `log.txt`, `metrics.json`, `adapter/` (PEFT, by its pack's
leader rank) and `checkpoint/` (megatron dist_checkpointing). When every pack spans the world,
packs run one after another and are checkpointed (resume.py). dist_checkpointing saves are
collective over the whole world, so when packs train on separate ranks at once there are no pack
checkpoints, and the finished jobs' megatron checkpoints are written together once every pack
has ended (each pack's leader hands its adapters to every rank first).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Callable, Sequence

import torch.distributed as dist

from megatron_ext.config.schema import Config
from megatron_ext.lora import resume
from megatron_ext.lora.base import build_base
from megatron_ext.lora.export import Weights, save_megatron, save_peft
from megatron_ext.lora.groups import pack_groups, spans_world
from megatron_ext.lora.job import LoraJob
from megatron_ext.lora.layers import logical_weights
from megatron_ext.lora.plan import Plan
from megatron_ext.lora.runtime import JobResult, PackedTrainer
from megatron_ext.models.gpt import padded_vocab_size


def execute(cfg: Config, jobs: Sequence[LoraJob], plan: Plan, data_for: Callable) -> dict[str, JobResult]:
    """Train `plan` (collective over the world); every rank returns every job's result."""
    tp = cfg.parallel.tp
    groups = pack_groups(plan, tp)
    whole = spans_world(plan, tp)
    model, wrappers, routing = build_base(cfg.model, padded_vocab_size(cfg.model.vocab_size, cfg.model, tp), cfg.train.seed)
    routing.kernel = cfg.lora.kernel
    out = Path(cfg.lora.output_dir)
    by_name = {j.name: j for j in jobs}
    results: dict[str, JobResult] = {}
    held: dict[str, tuple[LoraJob, Weights]] = {}  # finished adapters whose megatron checkpoint waits
    budget = cfg.lora.stop_after
    for index, pack in enumerate(plan.packs):
        if index not in groups:
            continue
        mine = groups[index]
        writer = dist.get_rank() == mine.leader
        trainer = PackedTrainer(model, wrappers, routing, data_for, pack.slots, _finisher(cfg, out, writer, whole, held),
                                _logger(out, writer), dp_group=mine.dp_group, group=mine.group)
        trainer.submit([by_name[n] for n in pack.jobs])
        if whole:
            folder = resume.pack_folder(out, index)
            resume.restore(trainer, folder)
            if not resume.finished(trainer) and budget != 0:
                taken = resume.run_pack(trainer, folder, cfg.lora.save_interval, budget)
                budget = None if budget is None else budget - taken
        else:
            trainer.run()
        if writer:
            results.update(trainer.results)
    if not whole:
        _save_held(out, held)
    return _gathered(results, jobs)


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


def _finisher(cfg: Config, out: Path, writer: bool, whole: bool, held: dict) -> Callable:
    def finish(trainer: PackedTrainer, active) -> None:
        weights = logical_weights(trainer.wrappers, active.slot)
        if writer:
            save_peft(out / active.job.name / "adapter", active.job, weights, cfg.model, cfg.model.pretrained)
        if whole:
            save_megatron(out / active.job.name / "checkpoint", active.job, weights)
        elif writer:
            held[active.job.name] = (active.job, weights)

    return finish


def _save_held(out: Path, held: dict[str, tuple[LoraJob, Weights]]) -> None:
    """Every pack leader's finished adapters, written as megatron checkpoints by the world."""
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, held)
    merged = {name: entry for part in everyone for name, entry in part.items()}
    for name in sorted(merged):
        save_megatron(out / name / "checkpoint", *merged[name])


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
