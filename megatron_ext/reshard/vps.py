"""The Virtual Parameter Space: every rank's piece of every training state, for any layout.

A training state has layout-free coordinates: a logical tensor (megatron's sharded-state-dict
key plus global layer / expert index, see models/logical.py), a state kind, and a box of the
tensor's logical shape. A layout is then a map from ranks to pieces:

  param       model weights: the rank's TP box, on every DP/CP replica (tied output copies too)
  main_param  fp32 master weights, only when the model is not fp32 (megatron's fp32 main
              params are views of the fp32 model params: the same memory as `param`)
  exp_avg, exp_avg_sq
              Adam moments: the box ∩ the flat range [a, b) of the TP shard that the rank's
              distributed-optimizer index owns, split into contiguous sub-boxes
  step        the optimizer step, one scalar every rank holds

Everything comes from megatron's own code, run for each (pp, tp, ep) position on a fake
skeleton (skeleton.py): boxes from `sharded_state_dict()`, bucket layout from
`DistributedDataParallel`, owned ranges from `DistributedOptimizer._build_model_gbuf_range`.
"""

from __future__ import annotations

import dataclasses
import functools
from types import SimpleNamespace

import torch
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from torch.multiprocessing.reductions import StorageWeakRef

from megatron_ext.config.schema import ModelConfig
from megatron_ext.models.gpt import DTYPES
from megatron_ext.models.logical import LogicalName, local_box, local_shards
from megatron_ext.reshard.boxes import Box, flat_range_boxes, numel
from megatron_ext.reshard.layout import ParallelLayout
from megatron_ext.reshard.skeleton import Skeleton, build_skeleton, fake_group, standalone_world

STEP = LogicalName("optimizer.step")
ModelKey = tuple[tuple[str, object], ...]


@dataclasses.dataclass(frozen=True)
class Piece:
    """A box of one state of one logical tensor, held by one rank."""

    rank: int
    name: LogicalName
    state: str
    box: Box
    shape: tuple[int, ...]  # the logical tensor's
    dtype: str
    # Where the box lives: a contiguous run (row-major, box order) of the local tensor of this
    # state for parameter `param` of model chunk `chunk` (the TP shard for `param`, the DP shard
    # for optimizer states), starting at `offset`. The step is no parameter's: chunk -1.
    chunk: int
    param: str
    offset: int

    @property
    def nbytes(self) -> int:
        return numel(self.box) * getattr(torch, self.dtype).itemsize


@dataclasses.dataclass(frozen=True)
class _Shard:
    """One sharded tensor of a position's model: where its box starts in its parameter, and the
    flat range [a, b) of that parameter each optimizer DP index owns (None: no optimizer state)."""

    chunk: int
    param: str
    name: LogicalName
    shape: tuple[int, ...]
    box: Box
    start: int
    expert: bool
    owned: tuple[tuple[int, int], ...] | None


def model_key(model: ModelConfig) -> ModelKey:
    """A hashable stand-in for a ModelConfig (which is a mutable dataclass), for caching."""
    return tuple(sorted(dataclasses.asdict(model).items()))


def optimizer_states(model: ModelConfig) -> tuple[str, ...]:
    moments = ("exp_avg", "exp_avg_sq")
    return moments if model.precision == "fp32" else ("main_param", *moments)


def rank_pieces(model: ModelConfig, layout: ParallelLayout, rank: int) -> tuple[Piece, ...]:
    """Every piece `rank` holds in `layout` (standby ranks hold none)."""
    return _rank_pieces(model_key(model), layout, rank)


def layout_pieces(model: ModelConfig, layout: ParallelLayout) -> tuple[Piece, ...]:
    """Every piece of every rank of `layout`, by rank."""
    key = model_key(model)
    return tuple(p for rank in range(layout.world) for p in _rank_pieces(key, layout, rank))


@functools.lru_cache(maxsize=1024)
def _rank_pieces(key: ModelKey, layout: ParallelLayout, rank: int) -> tuple[Piece, ...]:
    if rank >= layout.active:
        return ()
    model = ModelConfig(**dict(key))
    coords = layout.rank_coords(rank)
    position = (coords["pp"], coords["tp"], coords["ep"])
    param_dtype = str(DTYPES[model.precision]).removeprefix("torch.")
    pieces = []
    for s in _layout_shards(key, layout)[position]:
        pieces.append(_piece(rank, s, "param", s.box, param_dtype, s.start))
        if s.owned is not None:
            dp_index = coords["edp"] if s.expert else coords["dp_cp"]
            pieces += _optimizer_pieces(rank, s, s.owned[dp_index], optimizer_states(model))
    pieces.append(Piece(rank, STEP, "step", ((0, 1),), (1,), "float32", -1, "", 0))
    return tuple(pieces)


def _piece(rank: int, s: _Shard, state: str, box: Box, dtype: str, offset: int) -> Piece:
    return Piece(rank, s.name, state, box, s.shape, dtype, s.chunk, s.param, offset)


def _optimizer_pieces(
    rank: int, s: _Shard, owned: tuple[int, int], states: tuple[str, ...]
) -> list[Piece]:
    """Shard `s` ∩ the flat range [a, b) of its parameter that the rank's DP index owns, as
    contiguous boxes. Element j of the rank's DP shard is element a + j of the parameter."""
    a, b = owned
    lo, hi = max(a, s.start), min(b, s.start + numel(s.box))
    return [
        _piece(rank, s, state, sub, "float32", s.start + pos - a)
        for sub, pos in flat_range_boxes(s.box, lo - s.start, hi - s.start)
        for state in states
    ]


@functools.lru_cache(maxsize=64)
def _layout_shards(key: ModelKey, layout: ParallelLayout) -> dict[tuple, tuple[_Shard, ...]]:
    """(pp, tp, ep) position -> its shards, read from the fake skeleton of its first rank. DP and
    CP replicas hold the same model shard; their optimizer ranges differ only by DP index."""
    model = ModelConfig(**dict(key))
    shards = {}
    with standalone_world():
        for rank in range(layout.active):
            c = layout.rank_coords(rank)
            position = (c["pp"], c["tp"], c["ep"])
            if position not in shards:
                shards[position] = read_skeleton(build_skeleton(model, layout, rank))
    return shards


def read_skeleton(skeleton: Skeleton) -> tuple[_Shard, ...]:
    with skeleton.fake_mode:
        return tuple(
            shard
            for i, (chunk, ddp) in enumerate(zip(skeleton.chunks, skeleton.ddp))
            for shard in _chunk_shards(i, chunk, ddp, skeleton.groups)
        )


def _chunk_shards(index: int, chunk, ddp, groups) -> list[_Shard]:
    owned = owned_ranges(ddp)
    tensors = [*chunk.named_parameters(), *chunk.named_buffers()]
    shards = []
    # The skeleton's DP group: without it megatron 0.16 falls back to the global parallel state,
    # which belongs to the running layout, not this one.
    for name, shape, sh in local_shards([chunk], metadata={"dp_cp_group": groups.dp_cp}):
        param_name, tensor, start = tensor_holder(tensors, sh.data)
        expert, ranges = owned.get(tensor, (False, None))
        box = tuple((s.start, s.stop) for s in local_box(sh))
        shards.append(_Shard(index, param_name, name, tuple(shape), box, start, expert, ranges))
    return shards


def tensor_holder(
    tensors: list[tuple[str, torch.Tensor]], data: torch.Tensor
) -> tuple[str, torch.Tensor, int]:
    """(name, tensor, flat offset) of the parameter or buffer whose memory `data` is a contiguous
    part of. Megatron's shards are the parameters themselves or views (SwiGLU's halves); under
    the distributed optimizer all parameters are views of one buffer, so storage plus offset,
    not storage alone, tells them apart."""
    if not data.is_contiguous():
        raise ValueError("reshard: a sharded tensor that is not contiguous cannot be a box")
    storage, offset = StorageWeakRef(data.untyped_storage()), data.storage_offset()
    for name, tensor in tensors:
        start = offset - tensor.storage_offset()
        if StorageWeakRef(tensor.untyped_storage()) == storage and 0 <= start < tensor.numel():
            return name, tensor, start
    raise ValueError(
        f"reshard: no parameter or buffer holds a sharded tensor of shape {tuple(data.shape)}"
    )


def owned_ranges(ddp) -> dict[torch.Tensor, tuple[bool, tuple[tuple[int, int], ...]]]:
    """Parameter -> (expert?, the flat range [a, b) of it each optimizer DP index owns).

    Without the distributed optimizer every index holds the whole parameter's state."""
    owned = {}
    for expert, buffers in ((False, ddp.buffers), (True, ddp.expert_parallel_buffers)):
        for buffer in buffers:
            size = buffer.data_parallel_world_size
            if ddp.ddp_config.use_distributed_optimizer:
                per_index = [_dp_param_ranges(buffer, d) for d in range(size)]
                for param in buffer.param_index_map:
                    ranges = tuple(by_param.get(param, (0, 0)) for by_param in per_index)
                    owned[param] = (expert, ranges)
            else:
                for param in buffer.param_index_map:
                    owned[param] = (expert, ((0, param.numel()),) * size)
    return owned


def _dp_param_ranges(buffer, dp_index: int) -> dict[torch.Tensor, tuple[int, int]]:
    """Megatron's own answer to "which part of each parameter does DP index d update", asked of
    the buffer as DP rank d would see it."""
    as_seen_by = SimpleNamespace(
        data_parallel_group=fake_group(dp_index, list(range(buffer.data_parallel_world_size))),
        buckets=buffer.buckets,
        param_index_map=buffer.param_index_map,
    )
    ranges = {}
    for bucket in range(len(buffer.buckets)):
        param_map = DistributedOptimizer._build_model_gbuf_range(as_seen_by, bucket)["param_map"]
        ranges.update({p: (r["param"].start, r["param"].end) for p, r in param_map.items()})
    return ranges
