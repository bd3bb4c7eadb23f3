"""A sweep's checkpoints, and the re-launch that continues it.

    <output_dir>/checkpoints/sweep.json          the jobs and the plan the sweep runs
    <output_dir>/checkpoints/pack_<i>/iter_<n>/  pack i after n packed steps (PackedTrainer.save)

Each pack is checkpointed over its own ranks (also while packs on other ranks train) every
`lora.save_interval` packed steps and when it ends (a finished pack's checkpoint holds only its
results, so a re-launch skips it). `lora.stop_after=N` ends a launch after N packed steps of each
rank, with a checkpoint. A re-launch with `lora.resume=true` and the same
jobs runs the plan recorded in sweep.json (not a new one: the planner's exact solver has a time
limit, so planning again may not give the same packs) and continues every pack from its latest
checkpoint, bitwise like a sweep that never stopped.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Optional, Sequence

import torch.distributed as dist

from megatron_ext.lora.job import LoraJob
from megatron_ext.lora.planning.plan import Pack, Plan
from megatron_ext.lora.runtime.packed import PackedTrainer
from megatron_ext.checkpointing import torch_dist as ckpt

RECORD = "sweep.json"


def folder_of(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def pack_folder(output_dir: str | Path, index: int) -> Path:
    return folder_of(output_dir) / f"pack_{index}"


def sweep_plan(output_dir: str | Path, jobs: Sequence[LoraJob], plan: Plan, resume: bool) -> Plan:
    """The plan to run. Fresh (`resume` false): `plan`, recorded; refused where an earlier
    sweep's checkpoints would be mixed with this one's. Resumed: the recorded plan; refused
    when nothing was recorded or the jobs differ. Checks on every rank, then rank 0 writes."""
    record = folder_of(output_dir) / RECORD
    if resume:
        if not record.is_file():
            raise ValueError(f"lora.resume=true: {folder_of(output_dir)} holds no sweep to resume ({RECORD} is missing)")
        saved = json.loads(record.read_text())
        _check_same_jobs([LoraJob(**entry) for entry in saved["jobs"]], jobs, record)
        return _plan_from(saved["plan"])
    if record.exists():
        raise ValueError(
            f"lora: {folder_of(output_dir)} holds the checkpoints of an earlier sweep: continue it with "
            "lora.resume=true, or give this sweep another lora.output_dir"
        )
    dist.barrier()  # every rank has looked before rank 0 writes
    if dist.get_rank() == 0:
        record.parent.mkdir(parents=True, exist_ok=True)
        staging = record.with_name(f".{RECORD}.tmp")
        staging.write_text(json.dumps({"jobs": [dataclasses.asdict(j) for j in jobs], "plan": dataclasses.asdict(plan)}, indent=1) + "\n")
        os.replace(staging, record)  # never a half-written record
    dist.barrier()
    return plan


def _check_same_jobs(saved: list[LoraJob], jobs: Sequence[LoraJob], record: Path) -> None:
    by_name = {j.name: j for j in saved}
    if set(by_name) != {j.name for j in jobs}:
        raise ValueError(f"lora.resume=true: {record} holds jobs {sorted(by_name)}, not {sorted(j.name for j in jobs)}")
    changed = {
        job.name: [f.name for f in dataclasses.fields(LoraJob) if getattr(job, f.name) != getattr(by_name[job.name], f.name)]
        for job in jobs
    }
    changed = {name: fields for name, fields in changed.items() if fields}
    if changed:
        raise ValueError(f"lora.resume=true: jobs changed since {record} was written: {changed}")


def _plan_from(saved: dict) -> Plan:
    packs = tuple(Pack(tuple(p["jobs"]), p["tp"], p["dp"], p["slots"], tuple(p["devices"])) for p in saved["packs"])
    return Plan(saved["strategy"], packs)


def restore(trainer: PackedTrainer, folder: Path) -> None:
    """Continue `trainer` (its jobs submitted) from `folder`'s latest checkpoint, if any."""
    if ckpt.latest_iteration(folder) is not None:
        trainer.resume(folder)


def finished(trainer: PackedTrainer) -> bool:
    return not trainer.active and not trainer.queue


def run_pack(trainer: PackedTrainer, folder: Path, interval: Optional[int], budget: Optional[int]) -> int:
    """Train `trainer` until its jobs have left or `budget` more packed steps have run,
    checkpointing into `folder` every `interval` packed steps and at the end. Returns the packed
    steps taken."""
    start = trainer.packed_steps
    stop = math.inf if budget is None else start + budget
    while True:
        until = min(stop, (trainer.packed_steps // interval + 1) * interval if interval else math.inf)
        trainer.run(until=None if until == math.inf else int(until))
        if ckpt.latest_iteration(folder) != trainer.packed_steps:  # an interval save may have ended the pack
            trainer.save(folder)
        if finished(trainer) or trainer.packed_steps >= stop:
            return trainer.packed_steps - start
