"""A checkpoint rewritten in another parallel layout, every state copied exactly.

    relayout("ckpt/", "ckpt_pp4/", ParallelConfig(tp=1, pp=4), fully_reshardable=False)

Megatron's own loader and saver do the work, in a world of local workers holding one rank per
model-parallel position of a layout (data parallelism 1: every data-parallel replica holds the
same model and, between them, one copy of the optimizer state):

- a checkpoint whose optimizer state loads in any layout (`fully_reshardable`,
  `fully_sharded_model_space`, or none) is loaded in the target layout and saved there;
- a `dp_reshardable` one is cut by the gradient buckets of the layout that saved it, which only
  that layout's megatron knows: it is first loaded in its own layout and saved
  `fully_reshardable` beside the destination, then that is rewritten in the target layout.

The plain entries (the counters, the lr schedule, the runtime's state) are copied as they were;
`args` records the new layout. RNG states are left out (their streams belong to the old ranks):
`args.no_save_rng` says so, and Megatron-LM then starts them from its seed, as it does for a
checkpoint of another TP / PP. The destination is written under a temporary name and renamed
when complete; every refusal comes before anything is written.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any, Optional

import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

from megatron_ext.checkpointing import torch_dist as ckpt
from megatron_ext.checkpointing.megatron_lm import (
    EXTENSION_KEY,
    OLD_LAYOUT_KEY,
    content_metadata,
    layout_key,
    optimizer_layout_problem,
    saved_model_config,
)
from megatron_ext.config.mlm_namespace import optim_fields, relaid_args
from megatron_ext.config.schema import Config, DataConfig, OptimConfig, ParallelConfig
from megatron_ext.config.validate import ConfigError, validate
from megatron_ext.parallel.groups import parallel_state_sizes
from megatron_ext.platform.launch import join_world, launch_local
from megatron_ext.checkpointing.relaid import needs_relayout, relaid_copy, relaid_copy_ready
from megatron_ext.training.trainer import Trainer


@dataclasses.dataclass(frozen=True)
class Source:
    """What a checkpoint says of itself: where it is, the model, the layout that saved it."""

    root: str
    iteration: int
    config: Config  # model, optimizer settings and saved layout (dp 1)
    common: dict  # its plain state (checkpointing.torch_dist.load_common)


def read_source(root: str, iteration: Optional[int] = None) -> Source:
    """The checkpoint `iteration` (default: the latest) of `root`; one line naming what is
    wrong when there is none."""
    latest = ckpt.latest_iteration(root) if Path(root).is_dir() else None
    iteration = latest if iteration is None else iteration
    if iteration is None or not ckpt.iteration_dir(root, iteration).is_dir():
        raise ConfigError("--load", f"{root} holds no checkpoint" + (f" of iteration {iteration}" if iteration is not None else ""))
    common = ckpt.load_common(root, iteration)
    args = common.get("args")
    model = saved_model_config(common)
    saved = common["layout"] or {}
    parallel = ParallelConfig(
        tp=saved.get("tp", 1), pp=saved.get("pp", 1), vpp=saved.get("vpp"), ep=saved.get("ep", 1),
        cp=getattr(args, "context_parallel_size", 1), first_stage_layers=saved.get("first_stage_layers"),
        last_stage_layers=saved.get("last_stage_layers"),
        use_distributed_optimizer=getattr(args, "use_distributed_optimizer", True),
    )
    optim = dataclasses.replace(OptimConfig(), **optim_fields(args)) if args is not None else OptimConfig()
    if common.get("config") is not None:
        optim = OptimConfig(**common["config"]["optim"])
    cfg = Config(model=model, parallel=parallel, optim=optim, data=DataConfig(tokenizer="byte", mock=True))
    return Source(root, iteration, cfg, common)


def world_of(parallel: ParallelConfig) -> int:
    """Ranks of one model-parallel copy of `parallel` (data parallelism 1, or the least that
    expert parallelism needs)."""
    return parallel.tp * parallel.pp * parallel.cp * (parallel.ep if parallel.ep > 1 else 1)


def target_config(source: Source, parallel: ParallelConfig) -> Config:
    """The source's model and settings in layout `parallel`, checked: a layout the model cannot
    take is refused here, naming the field."""
    # The source's optimizer kind: a plain (non-distributed) one's state is laid out by parameter.
    layout = dataclasses.replace(parallel, dp=None, use_distributed_optimizer=source.config.parallel.use_distributed_optimizer)
    cfg = dataclasses.replace(source.config, parallel=layout)
    validate(cfg, world_of(layout))
    return cfg


@dataclasses.dataclass(frozen=True)
class Pass:
    """One load-and-save of a rewrite, summed over its ranks: bytes read and written through
    the file system (Linux's per-process I/O counters; None elsewhere), and its slowest rank's
    seconds loading and saving."""

    ranks: int
    read_bytes: Optional[int]
    written_bytes: Optional[int]
    load_s: float
    save_s: float


@dataclasses.dataclass(frozen=True)
class Rewritten:
    """What `relayout` wrote, and what each of its passes read, wrote and took."""

    path: Path
    passes: tuple[Pass, ...]  # two for a dp_reshardable source in another layout, else one

    def __str__(self) -> str:
        io = [p for p in self.passes if p.read_bytes is not None]
        moved = (
            f": read {sum(p.read_bytes for p in io) / 1e6:.1f} MB, wrote {sum(p.written_bytes for p in io) / 1e6:.1f} MB"
            if len(io) == len(self.passes) else ""
        )
        seconds = sum(p.load_s + p.save_s for p in self.passes)
        return f"{self.path} in {len(self.passes)} pass(es){moved}, {seconds:.1f} s loading and saving"


def relayout(
    source: Source, out: str | os.PathLike, parallel: ParallelConfig, fully_reshardable: bool = True
) -> Rewritten:
    """Write `source` at `out` in layout `parallel`, its optimizer state `fully_reshardable`
    or `dp_reshardable`. `out` must not exist or be empty."""
    target = target_config(source, parallel)
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError("--save", f"{out} already exists and is not empty")
    staging = out.parent / f".{out.name}.{os.getpid()}.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    passes = []
    try:
        src = source
        if optimizer_layout_problem(source.common, layout_key(target.parallel)) is not None:
            # Megatron reads a dp_reshardable state only in its own layout: through it first.
            via = staging / "via"
            passes.append(_rewrite(source, source.config, via, fully_reshardable=True))
            src = dataclasses.replace(source, root=str(via), common=ckpt.load_common(via, source.iteration))
        passes.append(_rewrite(src, target, staging / "out", fully_reshardable))
        out.parent.mkdir(parents=True, exist_ok=True)
        if out.is_dir():
            out.rmdir()
        os.replace(staging / "out", out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return Rewritten(out, tuple(passes))


def _rewrite(source: Source, cfg: Config, out: Path, fully_reshardable: bool) -> Pass:
    nproc = world_of(cfg.parallel)
    ranks = list(launch_local(nproc, rewrite_rank, (source, cfg, str(out), fully_reshardable), "127.0.0.1", 0).values())
    counted = all(r["read_bytes"] is not None for r in ranks)
    return Pass(
        ranks=nproc,
        read_bytes=sum(r["read_bytes"] for r in ranks) if counted else None,
        written_bytes=sum(r["written_bytes"] for r in ranks) if counted else None,
        load_s=max(r["load_s"] for r in ranks),
        save_s=max(r["save_s"] for r in ranks),
    )


def _io_bytes() -> Optional[tuple[int, int]]:
    """(bytes read, bytes written) by this process through read/write calls, page cache
    included (Linux's /proc/self/io rchar / wchar); None where there is no such file."""
    try:
        fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    except OSError:
        return None
    return int(fields["rchar"]), int(fields["wchar"])


def rewrite_rank(source: Source, cfg: Config, out: str, fully_reshardable: bool) -> dict[str, Any]:
    """One rank's part of a rewrite, in a world of `world_of(cfg.parallel)` workers: build its
    model and optimizer in `cfg`'s layout, load the source into them, save them to `out`.
    Returns its bytes read and written and its seconds loading and saving."""
    join_world(cfg.launcher.device)
    parallel_state.initialize_model_parallel(**parallel_state_sizes(cfg.parallel))
    model_parallel_cuda_manual_seed(cfg.train.seed)
    trainer = Trainer(cfg)
    try:
        common = ckpt.load_common(source.root, source.iteration)
        trainer.vocab_size = common["padded_vocab_size"]
        trainer.model, trainer.model_config = trainer.build_model(cfg.parallel, initialise=False)
        trainer.optimizer = trainer.build_optimizer(trainer.model, trainer.model_config, cfg.parallel)
        has_optimizer = ckpt.OPTIMIZER_KEY in ckpt.held_states(source.root, source.iteration)
        optimizer = trainer.optimizer if has_optimizer else None
        plain = _relaid_plain(source, cfg, fully_reshardable)
        metadata = content_metadata(cfg.parallel.use_distributed_optimizer, fully_reshardable)
        before, start = _io_bytes(), time.perf_counter()
        ckpt.load_checkpoint(source.root, source.iteration, trainer.model, optimizer, load_rng=False, field="--load")
        loaded, middle = _io_bytes(), time.perf_counter()
        ckpt.save_checkpoint(out, source.iteration, trainer.model, optimizer, plain, metadata, save_rng=False)
        after, end = _io_bytes(), time.perf_counter()
        counted = before is not None
        return {
            "read_bytes": loaded[0] - before[0] if counted else None,
            "written_bytes": after[1] - loaded[1] if counted else None,
            "load_s": middle - start,
            "save_s": end - middle,
        }
    finally:
        trainer.close()
        dist.destroy_process_group()


def _relaid_plain(source: Source, cfg: Config, fully_reshardable: bool) -> dict[str, Any]:
    """The source's plain entries, with the layout they name changed to `cfg`'s."""
    saved = dist_checkpointing.load_common_state_dict(str(ckpt.iteration_dir(source.root, source.iteration)))
    # The common state also holds the non-tensor parts of the model's, optimizer's and RNG's
    # entries: the save writes those anew.
    plain = {k: v for k, v in saved.items() if not re.fullmatch(r"model\d*|optimizer|rng_state|content_metadata", k)}
    p = cfg.parallel
    key = layout_key(p)
    if OLD_LAYOUT_KEY in plain:
        plain[OLD_LAYOUT_KEY] = _relaid_extension(plain[OLD_LAYOUT_KEY], key, p)
        return plain
    if "args" in plain:
        plain["args"] = relaid_args(plain["args"], p, dist.get_world_size(), fully_reshardable)
    if EXTENSION_KEY in plain:
        plain[EXTENSION_KEY] = _relaid_extension(plain[EXTENSION_KEY], key, p)
    return plain


def _relaid_extension(state: dict, key: dict, parallel: ParallelConfig) -> dict:
    state = {**state, "layout": key}
    if state.get("config") is not None:
        sizes = {k: getattr(parallel, k) for k in ("tp", "pp", "vpp", "ep", "cp", "first_stage_layers", "last_stage_layers")}
        state["config"] = {**state["config"], "parallel": {**state["config"]["parallel"], **sizes, "dp": None}}
    return state



# --- a run resuming a checkpoint its layout cannot read ------------------------------------------


def prepare_resume(cfg: Config) -> Optional[str]:
    """Before a run's workers start: when the checkpoint it resumes holds a `dp_reshardable`
    optimizer state of another layout, rewrite it once in the run's layout (`relaid_copy`,
    `fully_reshardable`), which the Trainer then resumes. Returns the line saying so, else None."""
    c = cfg.checkpoint
    try:
        iteration = c.step if c.step is not None else ckpt.latest_iteration(c.load) if c.load else None
        if iteration is None or not ckpt.iteration_dir(c.load, iteration).is_dir() or not needs_relayout(cfg, c.load, iteration):
            return None
    except Exception:  # a damaged tracker or checkpoint: preflight's checks, next, name it
        return None
    copy = relaid_copy(cfg, c.load, iteration)
    if relaid_copy_ready(cfg, c.load, iteration):
        return f"checkpoint.load: resuming {copy}, this layout's rewrite of {ckpt.iteration_dir(c.load, iteration)}"
    shutil.rmtree(copy, ignore_errors=True)  # an incomplete one of an interrupted rewrite
    start = time.perf_counter()
    relayout(read_source(c.load, iteration), copy, cfg.parallel, fully_reshardable=True)
    return (
        f"checkpoint.load: {ckpt.iteration_dir(c.load, iteration)} holds a dp_reshardable optimizer state of "
        f"another layout: rewritten in this one at {copy} ({time.perf_counter() - start:.1f} s)"
    )
