"""A LoRA sweep from a config: jobs, plan, one packed execution, per-job outputs.

    jobs = jobs_of(cfg)                       # a plain multi-job config (lora.jobs / jobs_file)
    jobs = multirun_jobs(sweep, first)[1]     # or a Hydra multirun's combinations (config/sweep.py)
    summary = run_sweep(cfg, jobs)

Each job's data (datasets.py: its own SFT files, a mix of them, a built-in task or synthetic
tokens) is read on every rank first, so the planner sees the tokens its samples really hold.
The world the run is in (one process, or ranks under torchrun) is the planner's devices, one a
rank. The planner (planning/planner.py) decides which jobs share a pack, how many train at once within
`lora.memory_gb` per rank, at which TP and DP degree (TP a power of two up to `parallel.tp`, the
largest a pack may use), on which ranks and in which order, refusing a job that cannot fit even
alone; runtime/execute.py runs the packs through the packed runtime, each at its own TP, those on
separate ranks at the same time. Each job writes `<output_dir>/<job>/`: `log.txt`,
`metrics.json`, `adapter/` (PEFT) and `checkpoint/` (megatron dist_checkpointing). Every pack is checkpointed under
`<output_dir>/checkpoints/` over its own ranks, and `lora.resume=true` continues a stopped
sweep (runtime/resume.py).
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Sequence

import torch.distributed as dist
import yaml

from megatron_ext.config import compose_config
from megatron_ext.config.schema import Config
from megatron_ext.config.sweep import Sweep
from megatron_ext.config.validate import ConfigError
from megatron_ext.data import build_tokenizer
from megatron_ext.lora import datasets
from megatron_ext.lora.calibrate import load_coefficients
from megatron_ext.lora.job import LoraJob, jobs_from_dicts
from megatron_ext.lora.planning import pass_size, planner, report
from megatron_ext.lora.planning.costmodel import LinearCostModel
from megatron_ext.lora.planning.memory import BF16, FP32, Hardware, MemoryModel, gib
from megatron_ext.lora.planning.plan import Pack, Plan
from megatron_ext.lora.planning.planner import check_feasible
from megatron_ext.lora.planning.simulate import simulate
from megatron_ext.lora.planning.workload import Shapes, shapes_of, tp_divides
from megatron_ext.lora.runtime import kernels
from megatron_ext.lora.runtime.execute import execute, write_summary
from megatron_ext.lora.runtime.resume import sweep_plan
from megatron_ext.models import pretrained
from megatron_ext.models.convert.world import model_parallel_world

# Sections a Hydra multirun may vary per job; anything else must be the same for all jobs.
JOB_SECTIONS = ("lora", "optim", "train")
NOT_IN_NAMES = re.compile(r"[^\w.-]+")


def job_from_config(cfg: Config, name: str) -> LoraJob:
    lora, optim, train = cfg.lora, cfg.optim, cfg.train
    return LoraJob(
        name=name,
        rank=lora.rank,
        alpha=lora.alpha,
        dropout=lora.dropout,
        target_modules=tuple(lora.target_modules),
        lr=optim.lr,
        min_lr=min(optim.min_lr, optim.lr),
        weight_decay=optim.weight_decay,
        adam_beta1=optim.adam_beta1,
        adam_beta2=optim.adam_beta2,
        adam_eps=optim.adam_eps,
        lr_warmup_steps=optim.lr_warmup_iters or 0,
        lr_decay_style=optim.lr_decay_style,
        clip_grad=optim.clip_grad,
        micro_batch_size=train.micro_batch_size,
        global_batch_size=train.global_batch_size or train.micro_batch_size,
        seq_length=lora.seq_length or cfg.model.seq_length,
        steps=train.iters,
        dataset=lora.dataset,
        seed=train.seed,
        eval_interval=lora.eval_interval,
        eval_iters=lora.eval_iters,
    )


def jobs_of(cfg: Config) -> list[LoraJob]:
    """The jobs of a plain config: `lora.jobs` and/or `lora.jobs_file`, each entry overriding
    the job the config describes; without entries, that one job."""
    entries = list(cfg.lora.jobs)
    if cfg.lora.jobs_file:
        entries += list(yaml.safe_load(Path(cfg.lora.jobs_file).read_text()).get("jobs", []))
    defaults = dataclasses.asdict(job_from_config(cfg, "job"))
    del defaults["name"]
    if not entries:
        return [job_from_config(cfg, "job")]
    for i, entry in enumerate(entries):
        unknown = set(entry) - {f.name for f in dataclasses.fields(LoraJob)}
        if unknown or "name" not in entry:
            raise ValueError(f"lora.jobs[{i}]: unknown field(s) {sorted(unknown)}" if unknown else f"lora.jobs[{i}] has no name")
        measured = sorted(k for k in ("mean_tokens", "longest_tokens") if entry.get(k) is not None)
        if measured:  # datasets.SweepData measures them from the job's data
            raise ValueError(f"lora.jobs[{i}]: {measured} are measured from the job's data, not set")
    return jobs_from_dicts([dict(e) for e in entries], defaults)


def multirun_jobs(sweep: Sweep, first: Config) -> tuple[Config, list[LoraJob]]:
    """A Hydra multirun's combinations (`first`: the first one composed) as the jobs of one
    packed sweep."""
    combinations, swept = sweep.combinations, sweep.swept
    configs = [first] + [compose_config(c) for c in combinations[1:]]
    shared = [k for k in swept if k.split(".")[0] not in JOB_SECTIONS]
    if shared:
        raise ValueError(f"lora sweep: {shared} cannot vary between jobs: a packed sweep trains them all on one base and layout")
    jobs = []
    for combination, cfg in zip(combinations, configs):
        values = dict(o.split("=", 1) for o in combination)
        # A name is a folder of lora.output_dir: a value's other characters (a dataset's path) become "_".
        named = {k: NOT_IN_NAMES.sub("_", values[k]).strip("_") for k in swept}
        name = "-".join(f"{k.split('.')[-1]}{named[k]}" for k in swept) or "job"
        jobs += [job.replace(name=f"{name}-{job.name}" if len(jobs_of(cfg)) > 1 else name) for job in jobs_of(cfg)]
    return configs[0], jobs


# --- planning -----------------------------------------------------------------------------------

# Seconds of a pass = c . (1, jobs, base GFLOP, LoRA GFLOP, attention GFLOP, TP all-reduce GB)
# (costmodel.PassWork). A rough default for one CPU thread, NOT calibrated on this machine: a
# fixed cost per pass (Python, the optimizer steps, the launch of every small op) is what packing
# shares; thin LoRA GEMMs run far below the base GEMMs' rate. scripts/bench/lora_sweep.py
# measures these coefficients (calibrate.py) for the planner it benchmarks; lora.cost_model=FILE
# (calibrate.save_fit) plans with measured ones instead.
CPU_COEFFICIENTS = (0.05, 0.01, 0.05, 0.5, 0.1, 0.0)


def plan_sweep(cfg: Config, jobs: Sequence[LoraJob], devices: int = 1):
    """The planner's schedule of `jobs` on `devices` ranks (refuses what cannot fit). A pack's
    TP is a power of two up to `parallel.tp` that splits the model's heads; its DP divides every
    job's micro-batches per step (the runtime deals them over the DP ranks)."""
    shapes = shapes_of(cfg.model)
    check_max_tp(cfg.parallel.tp, devices, shapes)
    coefficients = load_coefficients(cfg.lora.cost_model) if cfg.lora.cost_model else CPU_COEFFICIENTS
    memory = MemoryModel(shapes, FP32 if cfg.model.precision == "fp32" else BF16, fused_attention=False,
                         max_pass_tokens=pass_size.pass_cap(cfg))
    max_dp = min(j.accumulation_steps & -j.accumulation_steps for j in jobs)  # powers of two
    problem = planner.Problem(tuple(jobs), Hardware(devices, gib(cfg.lora.memory_gb)), memory, LinearCostModel(shapes, coefficients),
                              max_tp=cfg.parallel.tp, max_dp=max_dp)
    if cfg.lora.slots is None:
        return planner.plan(problem)
    return _slots_schedule(problem, cfg.lora.slots)


def check_max_tp(max_tp: int, devices: int, shapes: Shapes) -> None:
    """Refuse a largest pack TP (`parallel.tp`) that the planner could not use as asked."""
    problems = []
    if max_tp < 1 or max_tp & (max_tp - 1):
        problems.append("is not a power of two")
    else:
        if devices % max_tp:
            problems.append(f"does not divide the world of {devices} rank(s)")
        if not tp_divides(shapes, max_tp):
            problems.append(f"does not split the model evenly (attention heads {shapes.heads}, query groups "
                            f"{shapes.groups}, FFN {shapes.ffn})")
    if problems:
        raise ValueError(f"lora sweep: parallel.tp={max_tp} (the largest TP a pack may use) " + " and ".join(problems))


def _slots_schedule(problem, slots: int):
    """The user's slot count (`lora.slots`), kept within what memory allows: every job in one
    pack at the smallest TP that holds `slots` of them, over as many DP ranks as the rest allow."""
    check_feasible(problem)
    names = tuple(j.name for j in problem.jobs)
    fitting = sorted(tp for tp, dp in problem.shapes if dp == 1 and problem.fits(problem.jobs, slots, (tp, 1)))
    if not fitting:
        raise ValueError(f"lora.slots={slots}: that many of these jobs at once exceed lora.memory_gb per rank "
                         f"at every TP up to parallel.tp={problem.max_tp}")
    tp = fitting[0]
    dp = max(dp for t, dp in problem.shapes if t == tp)
    pack = Pack(names, tp, dp, slots, tuple(range(tp * dp)))
    return simulate(Plan("lora.slots", (pack,)), problem.jobs, problem.hardware.devices, problem.memory, problem)


# --- running ------------------------------------------------------------------------------------


def check_jobs(cfg: Config, jobs: Sequence[LoraJob]) -> None:
    """What the packed runtime cannot do, refused before anything is built."""
    problems = []
    if cfg.parallel.pp != 1 or cfg.parallel.cp != 1 or cfg.parallel.sequence_parallel:
        problems.append("the packed runtime needs parallel.pp=1, parallel.cp=1 and no sequence parallelism")
    if cfg.model.arch != "gpt":  # the base, the cost model and the PEFT export are LLaMA-style GPT
        problems.append(f"the packed runtime adapts model.arch=gpt only, not {cfg.model.arch!r}")

    if cfg.lora.kernel not in kernels.NAMES:  # else only the first forward says so
        problems.append(f"unknown lora.kernel {cfg.lora.kernel!r} ({', '.join(kernels.NAMES)})")
    for key, unit in (("save_interval", "packed steps"), ("stop_after", "packed steps")):
        value = getattr(cfg.lora, key)
        if value is not None and value < 1:
            problems.append(f"lora.{key} must be >= 1 {unit} (or null), got {value}")
    problems += filter(None, [pass_size.check_setting(cfg.lora.max_pass_tokens)])
    for job in jobs:
        dataset = datasets.problem(job.dataset)
        if dataset:
            problems.append(f"job {job.name!r}: dataset {job.dataset!r}: {dataset}")
        if job.seq_length > cfg.model.seq_length:
            problems.append(f"job {job.name!r}: seq_length {job.seq_length} exceeds model.seq_length {cfg.model.seq_length}")
    if problems:  # a ConfigError: the command line, or the launcher of the workers, prints its one line
        raise ConfigError("lora", "; ".join(problems))


def run_sweep(cfg: Config, jobs: Sequence[LoraJob]) -> dict:
    """Plan and train `jobs` on this world; returns {job: {dataset, status, steps, loss,
    eval_loss, ...}} (eval_loss: the job's validation loss at its end)."""
    check_jobs(cfg, jobs)
    tokenizer = _tokenizer(cfg)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=cfg.model.vocab_size or tokenizer.vocab_size))
    # Megatron's global state at TP=1: each pack builds its base on its own groups (runtime/groups.py).
    with model_parallel_world(tp=1):
        # Every job's data on every rank, before planning: the planner sees the lengths it holds.
        data = datasets.SweepData(cfg, tokenizer, cfg.model.vocab_size, jobs)
        jobs = data.jobs
        schedule = plan_sweep(cfg, jobs, dist.get_world_size())
        if dist.get_rank() == 0:
            print("\n".join([*data.notes, report.table(schedule)]), flush=True)
        # On resume the recorded plan: its packs' checkpoints are of it (runtime/resume.py).
        plan = sweep_plan(cfg.lora.output_dir, jobs, schedule.plan, resume=cfg.lora.resume)
        results = execute(cfg, jobs, plan, data.data_for)
        if dist.get_rank() == 0 and any(r.status in ("queued", "running") for r in results.values()):
            print(f"lora sweep: stopped after lora.stop_after={cfg.lora.stop_after} packed steps; continue with lora.resume=true", flush=True)
        return write_summary(Path(cfg.lora.output_dir), results, jobs)


def _tokenizer(cfg: Config):
    return build_tokenizer(pretrained.run_tokenizer_spec(cfg.data.tokenizer, cfg.model.pretrained))
