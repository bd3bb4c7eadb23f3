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
`DistributedDataParallel`, owned ranges from `DistributedOptimizer`
(platform/distributed_optimizer_internals.py).
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import itertools

import torch
from megatron.core.transformer.transformer_block import get_num_layers_to_build
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
from torch.multiprocessing.reductions import StorageWeakRef

from megatron_ext.config.schema import ModelConfig
from megatron_ext.models.gpt import DTYPES, transformer_config
from megatron_ext.models.logical import LogicalName, local_box, local_shards
from megatron_ext.platform.distributed_optimizer_internals import dp_param_ranges
from megatron_ext.reshard.boxes import Box, flat_range_boxes, intersect, numel
from megatron_ext.parallel.layout import ParallelLayout
from megatron_ext.platform.fake_build import on_meta
from megatron_ext.reshard.skeleton import Skeleton, build_skeleton, standalone_world

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
    param_dtype = _param_dtype(model)
    pieces = []
    for s in position_shards(key, layout, (coords["pp"], coords["tp"], coords["ep"])):
        pieces.append(_piece(rank, s, "param", s.box, param_dtype, s.start))
        if s.owned is not None:
            dp_index = coords["edp"] if s.expert else coords["dp_cp"]
            pieces += _optimizer_pieces(rank, s, s.owned[dp_index], optimizer_states(model))
    pieces.append(step_piece(rank))
    return tuple(pieces)


@functools.lru_cache(maxsize=64)
def _model(key: ModelKey) -> ModelConfig:
    return ModelConfig(**dict(key))


def step_piece(rank: int) -> Piece:
    return Piece(rank, STEP, "step", ((0, 1),), (1,), "float32", -1, "", 0)


def _param_dtype(model: ModelConfig) -> str:
    return str(DTYPES[model.precision]).removeprefix("torch.")


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


# --- positions: (pp, tp, ep) ------------------------------------------------------------------
#
# DP and CP replicas of a position hold the same model shards (their optimizer ranges differ by
# DP index only). The tp and ep positions of one pipeline stage differ only by where their
# boxes lie (megatron offsets a TP shard by its TP rank times its extent) and by which experts
# they hold (EP rank times the local experts): one skeleton per stage, at tp = ep = 0, answers
# for all of them (tests compare every position with its own skeleton).

Position = tuple[int, int, int]


@dataclasses.dataclass(frozen=True)
class _Stage:
    shards: tuple[_Shard, ...]  # of position (pp, 0, 0)
    by_name: dict[LogicalName, tuple[_Shard, ...]]
    expert_keys: frozenset[str]
    local_experts: int


@functools.lru_cache(maxsize=256)
def _stage(key: ModelKey, layout: ParallelLayout, pp: int) -> _Stage:
    model = ModelConfig(**dict(key))
    with standalone_world():  # the stage's rank with tp = cp = dp = 0, hence ep = 0
        shards = read_skeleton(build_skeleton(model, layout, pp * layout.tp * layout.cp * layout.dp))
    by_name: dict[LogicalName, list[_Shard]] = {}
    for s in shards:
        by_name.setdefault(s.name, []).append(s)
    experts = frozenset(s.name.key for s in shards if s.expert)
    named = {n: tuple(v) for n, v in by_name.items()}
    return _Stage(shards, named, experts, (model.num_experts or 1) // layout.ep)


@functools.lru_cache(maxsize=4096)
def position_shards(key: ModelKey, layout: ParallelLayout, position: Position) -> tuple[_Shard, ...]:
    """The shards of every rank at (pp, tp, ep) of `layout`."""
    pp, tp, ep = position
    stage = _stage(key, layout, pp)
    return tuple(_moved(s, stage, tp, ep) for s in stage.shards)


def _named_shards(key: ModelKey, layout: ParallelLayout, position: Position, name: LogicalName) -> list[_Shard]:
    """The shards of `name` at `position`, derived from those of its stage's (pp, 0, 0) alone."""
    pp, tp, ep = position
    stage = _stage(key, layout, pp)
    if name.key in stage.expert_keys:
        layer, expert = name.index
        if expert // stage.local_experts != ep:
            return []
        name = LogicalName(name.key, (layer, expert - ep * stage.local_experts))
    return [_moved(s, stage, tp, ep) for s in stage.by_name.get(name, ())]


def _moved(s: _Shard, stage: _Stage, tp: int, ep: int) -> _Shard:
    """Shard `s` of position (pp, 0, 0) as position (pp, tp, ep) holds it."""
    box = tuple(
        (lo + tp * (hi - lo), hi + tp * (hi - lo)) if hi - lo < n else (lo, hi)
        for (lo, hi), n in zip(s.box, s.shape)
    )
    name = s.name
    if s.expert and ep:
        layer, expert = name.index
        name = LogicalName(name.key, (layer, expert + ep * stage.local_experts))
    return dataclasses.replace(s, box=box, name=name)


@functools.lru_cache(maxsize=64)
def stage_layers(key: ModelKey, layout: ParallelLayout) -> tuple[frozenset[int], ...]:
    """The global layer indices each pipeline stage holds (all its virtual stages), by
    megatron's own offsets."""
    config = transformer_config(ModelConfig(**dict(key)), layout.to_config(), True)
    stages = []
    for pp in range(layout.pp):
        layers: set[int] = set()
        for vp in range(layout.vpp or 1):
            vp_stage = vp if layout.vpp else None
            offset = get_transformer_layer_offset(config, vp_stage, pp)
            layers.update(range(offset, offset + get_num_layers_to_build(config, vp_stage, pp)))
        stages.append(frozenset(layers))
    return tuple(stages)


@functools.lru_cache(maxsize=65536)
def name_positions(key: ModelKey, layout: ParallelLayout, name: LogicalName) -> tuple[Position, ...]:
    """The positions whose shards may hold `name`: the stage of its layer, every tp, and for an
    expert the ep that holds it. The embedding is the first stage's, and the last stage's too
    when the output layer shares it (megatron's tied copy has the embedding's key); the output
    layer and final norm are the last stage's; anything else is looked for in both."""
    last = layout.pp - 1
    if name.index:
        stages = [pp for pp, layers in enumerate(stage_layers(key, layout)) if name.index[0] in layers]
    elif name.key.startswith("embedding."):
        stages = sorted({0, last}) if _model(key).tie_embeddings else [0]
    elif name.key.startswith(("output_layer.", "decoder.final_layernorm.")):
        stages = [last]
    else:
        stages = sorted({0, last})
    out = []
    for pp in stages:
        stage = _stage(key, layout, pp)
        eps = [name.index[1] // stage.local_experts] if name.key in stage.expert_keys else range(layout.ep)
        out += [(pp, tp, ep) for tp in range(layout.tp) for ep in eps]
    return tuple(out)


@functools.lru_cache(maxsize=65536)
def is_expert(key: ModelKey, layout: ParallelLayout, name: LogicalName) -> bool:
    """Whether `name` is an expert's tensor (its optimizer state is sharded over expert DP)."""
    positions = name_positions(key, layout, name)
    return bool(positions) and name.key in _stage(key, layout, positions[0][0]).expert_keys


def position_ranks(layout: ParallelLayout, position: Position) -> range:
    """The ranks at `position`, ascending; the j-th has expert DP index j and dense DP index
    ep + EP·j (megatron's order: tp, cp, ep, dp, pp)."""
    pp, tp, ep = position
    step = layout.tp * layout.ep
    start = tp + layout.tp * ep + step * layout.edp * pp
    return range(start, start + step * layout.edp, step)


def replica_index(layout: ParallelLayout, rank: int, expert: bool) -> int:
    """`rank`'s index among the replicas of its position: its expert DP index for an expert's
    tensor, its dense DP·CP index otherwise (what rank_coords says as edp / dp_cp)."""
    if expert:
        return rank // (layout.tp * layout.ep) % layout.edp
    return rank // layout.tp % (layout.cp * layout.dp)


@dataclasses.dataclass(frozen=True)
class Holders:
    """One piece that each of `ranks` holds alike (DP/CP replicas of a parameter; one rank for a
    piece of an optimizer state)."""

    piece: Piece  # as held by ranks[0]
    ranks: range

    def on(self, rank: int) -> Piece:
        p = self.piece
        if rank == p.rank:
            return p
        return Piece(rank, p.name, p.state, p.box, p.shape, p.dtype, p.chunk, p.param, p.offset)


def holders(key: ModelKey, layout: ParallelLayout, name: LogicalName, state: str, box: Box) -> list[Holders]:
    """Every piece of (name, state) in `layout` that meets `box`: by position, then shard, then
    rank; without listing the other ranks' pieces."""
    if state == "step":
        return [Holders(step_piece(0), range(layout.active))] if layout.active else []
    out = []
    meeting: dict[tuple[int, int], list[_Shard]] = {}  # a dense tensor's shards are every ep's
    for position in name_positions(key, layout, name):
        pp, tp, ep = position
        if (pp, tp) not in meeting or name.key in _stage(key, layout, pp).expert_keys:
            shards = _named_shards(key, layout, position, name)
            meeting[pp, tp] = [s for s in shards if intersect(s.box, box) is not None]
        ranks = position_ranks(layout, position)
        for s in meeting[pp, tp]:
            if state == "param":
                dtype = _param_dtype(_model(key))
                out.append(Holders(_piece(ranks[0], s, "param", s.box, dtype, s.start), ranks))
            elif s.owned is not None:
                out += _optimizer_holders(layout, position, ranks, s, state, box)
    return out


def _optimizer_holders(
    layout: ParallelLayout, position: Position, ranks: range, s: _Shard, state: str, box: Box
) -> list[Holders]:
    """The pieces of `state` of shard `s` that meet `box`, on the ranks of `position` whose DP
    index owns part of it. The indices own consecutive runs of the parameter in index order, so
    only those between the first and last element of s ∩ box can (bisect finds them)."""
    common = intersect(s.box, box)
    first = s.start + flat_index(s.box, tuple(lo for lo, _ in common))
    last = s.start + flat_index(s.box, tuple(hi - 1 for _, hi in common))
    index = (lambda j: j) if s.expert else (lambda j: position[2] + layout.ep * j)
    # Indices that own none of it say (0, 0): the running maximum of the run ends ascends.
    ends = list(itertools.accumulate((s.owned[index(j)][1] for j in range(len(ranks))), max))
    out = []
    for j in range(bisect.bisect_right(ends, first), len(ranks)):
        a, b = s.owned[index(j)]
        if a >= b:
            continue
        if a > last:
            break
        out += [
            Holders(p, range(ranks[j], ranks[j] + 1))
            for p in _optimizer_pieces(ranks[j], s, (a, b), (state,))
            if intersect(p.box, box) is not None
        ]
    return out


def flat_index(box: Box, point: tuple[int, ...]) -> int:
    """Row-major position of `point` in `box`."""
    index = 0
    for (lo, hi), x in zip(box, point):
        index = index * (hi - lo) + (x - lo)
    return index


def built_position_shards(model: ModelConfig, layout: ParallelLayout) -> dict[Position, tuple[_Shard, ...]]:
    """Every position's shards, each read from the fake skeleton of its own first rank: what
    `position_shards` derives from one skeleton per stage (for tests)."""
    shards = {}
    with standalone_world():
        for rank in range(layout.active):
            c = layout.rank_coords(rank)
            position = (c["pp"], c["tp"], c["ep"])
            if position not in shards:
                shards[position] = read_skeleton(build_skeleton(model, layout, rank))
    return shards


def read_skeleton(skeleton: Skeleton) -> tuple[_Shard, ...]:
    return tuple(
        shard
        for i, (chunk, ddp) in enumerate(zip(skeleton.chunks, skeleton.ddp))
        for shard in _chunk_shards(i, chunk, ddp, skeleton.groups)
    )


def _chunk_shards(index: int, chunk, ddp, groups) -> list[_Shard]:
    owned = owned_ranges(ddp)
    # By storage: tensor_holder then looks among the few tensors sharing the shard's memory.
    by_storage: dict[StorageWeakRef, list[tuple[str, torch.Tensor]]] = {}
    for name, tensor in [*chunk.named_parameters(), *chunk.named_buffers()]:
        by_storage.setdefault(StorageWeakRef(tensor.untyped_storage()), []).append((name, tensor))
    # The skeleton's DP group: without it megatron 0.16 falls back to the global parallel state,
    # which belongs to the running layout, not this one.
    with on_meta():  # megatron's state dict may create tensors of its own
        state = list(local_shards([chunk], metadata={"dp_cp_group": groups.dp_cp}))
    shards = []
    for name, shape, sh in state:
        tensors = by_storage.get(StorageWeakRef(sh.data.untyped_storage()), [])
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
                per_index = [dp_param_ranges(buffer, d) for d in range(size)]
                for param in buffer.param_index_map:
                    ranges = tuple(by_param.get(param, (0, 0)) for by_param in per_index)
                    owned[param] = (expert, ranges)
            else:
                for param in buffer.param_index_map:
                    owned[param] = (expert, ((0, param.numel()),) * size)
    return owned
