"""Checkpoints in megatron's torch_dist format, saved atomically, loadable in any layout.

Layout on disk (megatron's, so its tools find the checkpoints):
    <dir>/iter_0000100/                     one dist_checkpointing checkpoint
    <dir>/latest_checkpointed_iteration.txt the tracker: the newest complete iteration

A save writes into `<dir>/.iter_0000100.tmp/`, and only when every rank has finished does rank 0
rename it into place and then replace the tracker. A crash at any point before the rename leaves
the tracker pointing at the previous checkpoint, which stays loadable. Leftovers of a broken save
are removed by the next run that takes the directory's writer lock (writer_lock.py); a save
replaces only a staging folder of its own iteration (left by an earlier attempt of the run).

An async save (Megatron-LM's --async-save) hands the writing to dist_checkpointing's async
request, run in a background process by megatron's `AsyncCallsQueue`; the rename and the tracker
are the request's last finalisation step, which megatron runs on every rank only once every
rank's write has completed. So a background write that fails or is cut off publishes nothing.
The caller finalises outstanding saves before it saves again and before it exits.

Where each tensor lives comes from megatron's own metadata: the model's and the optimizer's
`sharded_state_dict()`, shaped by the content metadata saved with them (megatron_lm.py, which
also says what the plain entries mean). The distributed optimizer's state is saved "fully
reshardable", so a checkpoint written at TP2 x PP2 resumes at PP2 x DP2; a checkpoint is read
with its own content metadata, so Megatron-LM's `dp_reshardable` ones load in their layout.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
from megatron.core.tensor_parallel import get_cuda_rng_tracker
from megatron.core.utils import unwrap_model
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

from megatron_ext.config.validate import ConfigError
from megatron_ext.platform.disk_space import disk_full
from megatron_ext.checkpointing.megatron_lm import from_saved, loading_metadata
from megatron_ext.checkpointing.tracker import TRACKER, holds_files, iteration_dir, latest_iteration, saved_iterations, staging_dir  # noqa: F401  (its API too)

# The top-level keys of the optimizer's and the RNG's states in a checkpoint.
OPTIMIZER_KEY, RNG_KEY = "optimizer", "rng_state"


def _model_sharded_state_dict(model_chunks: list, metadata: dict) -> dict:
    if len(model_chunks) == 1:
        return {"model": unwrap_model(model_chunks[0]).sharded_state_dict(metadata=metadata)}
    return {f"model{i}": unwrap_model(m).sharded_state_dict(metadata=metadata) for i, m in enumerate(model_chunks)}


def _rng_state() -> dict:
    """This process's RNG streams under Megatron-LM's names. Without CUDA the CUDA stream is
    the CPU one, as megatron's RNG tracker keeps it here."""
    return {
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
        "cuda_rng_state": torch.cuda.get_rng_state() if torch.cuda.is_available() else torch.get_rng_state(),
        "rng_tracker_states": get_cuda_rng_tracker().get_states(),
    }


def _rng_sharded_object(old_layout: bool = False) -> ShardedObject:
    """Megatron-LM's sharding of the RNG states: one per (pp, tp) position, data-parallel
    replicas sharing it; with expert parallelism one per (pp, tp, dp) rank. `old_layout`: the
    runtime's earlier checkpoints (one per (pp, tp), a dict of its own names)."""
    pp, tp = parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_tensor_model_parallel_rank()
    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    dp = parallel_state.get_data_parallel_rank(with_context_parallel=True)
    if old_layout:
        return ShardedObject(RNG_KEY, {}, (pp_size, tp_size), (pp, tp), replica_id=dp)
    if parallel_state.get_expert_model_parallel_world_size() > 1:
        dp_size = parallel_state.get_data_parallel_world_size(with_context_parallel=True)
        return ShardedObject(RNG_KEY, [_rng_state()], (pp_size, tp_size, dp_size), (pp, tp, dp), replica_id=0)
    return ShardedObject(RNG_KEY, [_rng_state()], (pp_size, tp_size), (pp, tp), replica_id=dp)


def sharded_state_dict(
    model_chunks: list, optimizer, metadata: dict, is_loading: bool = False, rng: bool = True, old_layout: bool = False
) -> dict:
    """What a checkpoint holds: the model, the optimizer unless it is None, the RNG states if
    `rng`; `metadata` is the content metadata that shapes the sharded state dicts (its
    `distrib_optim_sharding_type` the distributed optimizer's format)."""
    metadata = {**metadata, "dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True)}
    state = _model_sharded_state_dict(model_chunks, metadata)
    if optimizer is not None:
        state[OPTIMIZER_KEY] = optimizer.sharded_state_dict(
            _model_sharded_state_dict(model_chunks, metadata) if len(model_chunks) > 1 else state["model"],
            is_loading=is_loading,
            metadata=metadata,
        )
    if rng:
        state[RNG_KEY] = _rng_sharded_object(old_layout)
    return state


def save_checkpoint(
    root: str | os.PathLike,
    iteration: int,
    model_chunks: list,
    optimizer,
    plain: dict[str, Any],
    metadata: dict[str, Any],
    keep_last: Optional[int] = None,
    async_queue: Optional[AsyncCallsQueue] = None,
    save_rng: bool = True,
) -> Path:
    """Write checkpoint `iteration` under `root`: the tensors, and `plain` as the top-level
    plain entries (megatron_lm.to_saved: the same on all ranks); `metadata` is the content
    metadata (megatron_lm.content_metadata), saved with them. Without `optimizer` (None) the
    checkpoint holds no optimizer state, without `save_rng` no RNG states (Megatron-LM's
    --no-save-optim / --no-save-rng). With `async_queue` (no save of it outstanding), the
    tensors are written in the background and the checkpoint is published when the queue
    finalises the request."""
    state = sharded_state_dict(model_chunks, optimizer, metadata, rng=save_rng) | plain

    def write(folder: Path, async_sharded_save: bool = False):
        return dist_checkpointing.save(
            state, str(folder), async_sharded_save=async_sharded_save, content_metadata=metadata
        )

    if async_queue is None:
        return write_staged(root, iteration, write, keep_last)
    staging = _open_staging(root, iteration)
    request = write(staging, async_sharded_save=True)
    # megatron's finalisation raises what the background writers met: a full disk named too
    request.finalize_fns[:] = [_naming_a_full_disk(fn, Path(root), staging) for fn in request.finalize_fns]
    request.add_finalize_fn(lambda: _publish(root, iteration, keep_last))
    async_queue.schedule_async_request(request)
    return iteration_dir(root, iteration)


def write_staged(
    root: str | os.PathLike,
    iteration: int,
    write: Callable[[Path], None],
    keep_last: Optional[int] = None,
    group: Optional[dist.ProcessGroup] = None,
) -> Path:
    """Write checkpoint `iteration` under `root` by calling `write(folder)` on every rank of
    `group` (collective; default the world, whose rank 0 renames). The folder is a staging one,
    renamed to `iteration_dir` and recorded in the tracker only after every rank has written: a
    crash mid-save leaves the previous checkpoint the latest, and no half-written one."""
    staging = _open_staging(root, iteration, group)
    with _full_disk_named(Path(root), staging):
        write(staging)
    return _publish(root, iteration, keep_last, group)


def _open_staging(root: str | os.PathLike, iteration: int, group: Optional[dist.ProcessGroup] = None) -> Path:
    """An empty staging folder for checkpoint `iteration` (collective over `group`): one that
    an earlier save of this iteration left is replaced; other leftovers are the writer lock's
    holder's to remove (tracker.remove_leftover_staging), not a save's: they may be another
    run's save in progress where nothing locks the directory."""
    staging = staging_dir(root, iteration)
    if dist.get_rank(group) == 0:
        Path(root).mkdir(parents=True, exist_ok=True)
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
    dist.barrier(group=group)
    return staging


def _publish(
    root: str | os.PathLike, iteration: int, keep_last: Optional[int], group: Optional[dist.ProcessGroup] = None
) -> Path:
    """Once every rank of `group` has written the staging folder: rename it into place, then
    point the tracker at it (collective)."""
    root, final = Path(root), iteration_dir(root, iteration)
    dist.barrier(group=group)
    if dist.get_rank(group) == 0:
        if final.exists():  # a re-save of the same iteration replaces it
            shutil.rmtree(final)
        os.replace(staging_dir(root, iteration), final)
        with _full_disk_named(root, root / TRACKER):
            _write_tracker(root, iteration)
        if keep_last:
            _prune(root, keep_last)
    dist.barrier(group=group)
    return final


@contextlib.contextmanager
def _full_disk_named(root: Path, path: Path) -> Iterator[None]:
    """Writing `path` of a save to `root` that runs out of space ends in one line naming it and
    the space left (the writers' own errors name neither); the tracker still names the last
    complete checkpoint, which stays. A staging folder left is removed by the next run of the
    directory (not here: the other ranks are judging the space left)."""
    try:
        yield
    except (Exception, CheckpointException) as e:
        reason = disk_full(e, path)
        if reason is None:
            raise
        with contextlib.suppress(ValueError):  # a tracker that does not parse: nothing to name
            last = latest_iteration(root)
            kept = f"{iteration_dir(root, last)} stays the latest" if last is not None else "no checkpoint was complete before it"
            reason = f"{reason}; {kept}"
        raise ConfigError("checkpoint.save", reason) from e


def _naming_a_full_disk(fn: Callable[[], None], root: Path, path: Path) -> Callable[[], None]:
    """`fn` (an async save's finalisation step), its full disk said as `_full_disk_named` says it."""

    def step() -> None:
        with _full_disk_named(root, path):
            fn()

    return step


def _write_tracker(root: Path, iteration: int) -> None:
    tmp = root / f".{TRACKER}.tmp"
    tmp.write_text(f"{iteration}\n")
    with open(tmp) as f:
        os.fsync(f.fileno())
    os.replace(tmp, root / TRACKER)


def _prune(root: Path, keep_last: int) -> None:
    for it in saved_iterations(root)[:-keep_last]:
        shutil.rmtree(iteration_dir(root, it), ignore_errors=True)


def load_common(root: str | os.PathLike, iteration: int) -> dict[str, Any]:
    """The plain state of a checkpoint as the runtime reads it (megatron_lm.from_saved), whoever
    wrote it, with its content metadata under "content_metadata" (None when it has none)."""
    saved = dist_checkpointing.load_common_state_dict(str(iteration_dir(root, iteration)))
    common = from_saved(saved)
    common["content_metadata"] = dist_checkpointing.load_content_metadata(preloaded_state_dict=saved)
    return common


def held_states(root: str | os.PathLike, iteration: int, field: str = "checkpoint.load") -> frozenset[str]:
    """The top-level keys of what checkpoint `iteration` holds (model keys, OPTIMIZER_KEY,
    RNG_KEY), read from its metadata file alone; one that cannot be read raises naming `field`."""
    folder = iteration_dir(root, iteration)
    try:
        metadata = FileSystemReader(str(folder)).read_metadata()
    except Exception as e:  # missing or damaged: whatever torch raises for it
        raise ConfigError(field, f"{folder} cannot be loaded: {_cause(e)}") from e
    return frozenset(_held(re.split(r"[./]", key, maxsplit=1)[0]) for key in metadata.state_dict_metadata)


def _held(top: str) -> str:
    # megatron's ChainedOptimizer (one optimizer per param kind, e.g. dense and expert params)
    # prefixes each one's keys with chained_<i> in place of "optimizer".
    return OPTIMIZER_KEY if re.fullmatch(r"chained_\d+", top) else top


def check_holds_optimizer(
    root: str | os.PathLike, iteration: int, field: str = "checkpoint.load", held: Optional[frozenset[str]] = None
) -> None:
    """A resume that restores the optimizer needs a checkpoint that holds it (`held`: its
    `held_states`, read when not given). Megatron-LM stops there too, asking for --no-load-optim
    or --finetune; a missing RNG state it tolerates, and so does `load_checkpoint`."""
    if OPTIMIZER_KEY not in (held if held is not None else held_states(root, iteration, field)):
        raise ConfigError(
            field,
            f"{iteration_dir(root, iteration)} holds no optimizer state (saved with --no-save-optim, "
            "checkpoint.save_optim=false): resume it with --no-load-optim (checkpoint.load_optim=false) or --finetune",
        )


def load_checkpoint(
    root: str | os.PathLike,
    iteration: int,
    model_chunks: list,
    optimizer,
    load_rng: bool,
    field: str = "checkpoint.load",
) -> dict[str, Any]:
    """Load model (and optimizer) state of `iteration` into the current layout; returns its
    `load_common`. RNG states are restored only when `load_rng` (same TP x PP layout) and the
    checkpoint holds them. A checkpoint that cannot be read (a shard cut short, another model's
    shapes, no optimizer state for an `optimizer`) raises one line naming `field` and its path."""
    path = str(iteration_dir(root, iteration))
    common = load_common(root, iteration)
    held = held_states(root, iteration, field)
    if optimizer is not None:
        check_holds_optimizer(root, iteration, field, held)
    load_rng = load_rng and RNG_KEY in held  # Megatron-LM ignores a missing one
    old_layout = common["format"] == "megatron_ext_v1"
    metadata = loading_metadata(common["content_metadata"], None if old_layout else common["args"])
    template = sharded_state_dict(model_chunks, optimizer, metadata, is_loading=True, rng=load_rng, old_layout=old_layout)
    try:
        state = dist_checkpointing.load(template, path)
    except (Exception, CheckpointException) as e:  # every rank raises it: torch gathers the readers' failures
        raise ConfigError(field, f"{path} cannot be loaded: {_cause(e)}") from e
    if len(model_chunks) == 1:
        unwrap_model(model_chunks[0]).load_state_dict(state["model"])
    else:
        for i, m in enumerate(model_chunks):
            unwrap_model(m).load_state_dict(state[f"model{i}"])
    if optimizer is not None:
        optimizer.load_state_dict(state[OPTIMIZER_KEY])
    if load_rng:
        _restore_rng(state[RNG_KEY])
    return common


def _cause(error: BaseException) -> str:
    """The first line of what went wrong, under torch's wrapping of each reader's failure."""
    if isinstance(error, CheckpointException) and error.failures:
        error = next(iter(error.failures.values()))[0]
    lines = str(error).strip().splitlines()
    if isinstance(error, EOFError):
        return "a shard file is cut short (EOFError)"
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


def _restore_rng(rng: list | dict) -> None:
    """Megatron-LM's RNG entry (a list holding one rank's states), or the runtime's earlier one."""
    if isinstance(rng, dict):
        rng = {"random_rng_state": rng["random"], "np_rng_state": rng["numpy"], "torch_rng_state": rng["torch"],
               "cuda_rng_state": rng["cuda"], "rng_tracker_states": rng["tracker"]}
    else:
        rng = rng[0]
    random.setstate(rng["random_rng_state"])
    np.random.set_state(rng["np_rng_state"])
    torch.set_rng_state(rng["torch_rng_state"])
    if rng["cuda_rng_state"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda_rng_state"])
    get_cuda_rng_tracker().set_states(rng["rng_tracker_states"])
