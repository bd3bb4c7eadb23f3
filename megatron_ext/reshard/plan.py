"""The reshard plan: which boxes move from which rank to which, by box intersection.

    p = plan(model, ParallelLayout(tp=2, pp=2), ParallelLayout(pp=2, dp=2))   # the world's
    print(p.summary())
    mine = rank_plan(model, a, b, rank)     # only what `rank` sends or receives

A pure function of (model, layout A, layout B), and each rank computes its own part alone:
`rank_plan` is exactly the world plan's ops whose source or destination is that rank (tests
check it op for op), found from the layouts' structure (vps.py: positions, replicas, DP index
runs) without listing the other ranks' pieces. Ranks agree that they planned the same move by
the digest of the inputs and PLANNER_VERSION (execute.py checks it before anything moves).

Each destination piece is filled on its own (`fill`): first from what its own rank already
holds in A (local ops, no network bytes); then each element still missing is received exactly
once. So the bytes on the network are the minimum: the destination elements its rank does not
hold in A. The sender of a missing box is a function of the destination alone, so both ends
find it: among the source pieces that meet the box (in position, shard, rank order), the one
picked by the destination's replica index plus the tensor's layer and expert indices; DP
replicas of a destination therefore draw on different replicas of the source, and the sending
spreads evenly over them (scripts/bench/rank_plan.py reports the balance).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib

import numpy as np

from megatron_ext.config.schema import ModelConfig
from megatron_ext.models.logical import LogicalName
from megatron_ext.reshard.boxes import Box, contains, intersect, numel, subtract
from megatron_ext.parallel.layout import ParallelLayout
from megatron_ext.parallel.release import gc_paused
from megatron_ext.reshard.skeleton import standalone_world
from megatron_ext.reshard.vps import (
    Holders,
    ModelKey,
    Piece,
    holders,
    is_expert,
    layout_pieces,
    model_key,
    rank_pieces,
    replica_index,
)

RankOrRanks = int | np.ndarray

# Changes whenever the same inputs could plan other ops (the sender rule, the order): ranks
# running different planners must not agree.
PLANNER_VERSION = 2


@dataclasses.dataclass(frozen=True)
class Op:
    """Copy `box` of (name, state) from rank `src` to rank `dst` (a local copy when equal)."""

    src: int
    dst: int
    name: LogicalName
    state: str
    box: Box
    source: Piece  # the piece that holds the box on `src`
    target: Piece  # the piece that receives it on `dst`
    nbytes: int

    @property
    def local(self) -> bool:
        return self.src == self.dst

    @property
    def itemsize(self) -> int:
        return self.target.nbytes // numel(self.target.box)


@dataclasses.dataclass(frozen=True)
class RankPlan:
    """The ops one rank sends or receives (local copies included), in plan order."""

    a: ParallelLayout
    b: ParallelLayout
    rank: int
    ops: tuple[Op, ...]
    digest: str  # of the inputs and the planner: equal on every rank that planned the same move

    @property
    def world(self) -> int:
        return max(self.a.world, self.b.world)

    def sent(self, rank: int) -> int:
        return sum(op.nbytes for op in self.ops if op.src == rank and not op.local)

    def received(self, rank: int) -> int:
        return sum(op.nbytes for op in self.ops if op.dst == rank and not op.local)


@dataclasses.dataclass(frozen=True)
class TransferPlan:
    a: ParallelLayout
    b: ParallelLayout
    sources: tuple[Piece, ...]  # every piece of layout A
    targets: tuple[Piece, ...]  # every piece of layout B
    ops: tuple[Op, ...]  # in plan order: tensors in model order, destinations by rank
    min_bytes: int  # bytes of destination elements whose rank does not hold them in A
    digest: str  # of the inputs and the planner, as every RankPlan of the move has it

    @property
    def world(self) -> int:
        return max(self.a.world, self.b.world)

    @property
    def network_bytes(self) -> int:
        return sum(op.nbytes for op in self.ops if not op.local)

    def sent(self, rank: int) -> int:
        return sum(op.nbytes for op in self.ops if op.src == rank and not op.local)

    def received(self, rank: int) -> int:
        return sum(op.nbytes for op in self.ops if op.dst == rank and not op.local)

    def local_bytes(self, rank: int) -> int:
        return sum(op.nbytes for op in self.ops if op.dst == rank and op.local)

    def restricted(self, rank: int) -> RankPlan:
        """The ops `rank` sends or receives: what rank_plan computes alone."""
        ops = tuple(op for op in self.ops if rank in (op.src, op.dst))
        return RankPlan(self.a, self.b, rank, ops, self.digest)

    def summary(self) -> str:
        local = [op for op in self.ops if op.local]
        ratio = self.network_bytes / self.min_bytes if self.min_bytes else 1.0
        lines = [
            f"reshard plan {self.a} -> {self.b} (world {self.world}), digest {self.digest[:12]}",
            f"  ops {len(self.ops)} ({len(local)} local), network bytes {_mb(self.network_bytes)} "
            f"(minimum {_mb(self.min_bytes)}, ratio {ratio:.2f}), "
            f"local bytes {_mb(sum(op.nbytes for op in local))}",
            f"  {'rank':>4} {'sent':>10} {'received':>10} {'local':>10}",
        ]
        for r in range(self.world):
            sent, received, local_r = self.sent(r), self.received(r), self.local_bytes(r)
            lines.append(f"  {r:>4} {_mb(sent):>10} {_mb(received):>10} {_mb(local_r):>10}")
        return "\n".join(lines)


def _mb(nbytes: int) -> str:
    return f"{nbytes / 2**20:.2f} MiB"


def plan_digest(key: ModelKey, a: ParallelLayout, b: ParallelLayout) -> str:
    return hashlib.sha256(repr((PLANNER_VERSION, key, a, b)).encode()).hexdigest()


def plan(model: ModelConfig, a: ParallelLayout, b: ParallelLayout) -> TransferPlan:
    """The plan moving every training state of `model` from layout `a` to layout `b`, for the
    whole world: every destination rank's fills (for tests, summaries and the simulator).

    `model.vocab_size` is the run's padded vocabulary; `a` and `b` may have different world
    sizes. Every state of every logical tensor (the weight, both Adam moments and, below fp32,
    the fp32 main param) is filled first from what its rank holds in A, then each missing
    element is received once, so the bytes on the network are the minimum. Returns a
    TransferPlan: A's and B's pieces, the ops in plan order (`summary()`, `network_bytes` and
    `min_bytes` give its size) and the digest every rank's RankPlan of this move carries.
    Results are cached per (model, a, b). Raises ConfigError, before anything is computed, when
    either layout is invalid for the model.
    """
    a.check(model)
    b.check(model)
    return _plan(model_key(model), a, b)


def rank_plan(model: ModelConfig, a: ParallelLayout, b: ParallelLayout, rank: int) -> RankPlan:
    """The ops `rank` sends or receives moving `model` from `a` to `b` (local copies
    included): the world plan's ops of that rank, computed without the others'.

    What each rank of a live reshard plans for itself: the work grows with what the rank sends
    and receives, not with the number of ranks. `rank` is a rank of the larger of the two
    worlds. Returns a RankPlan: its ops in plan order and the digest of the inputs and the
    planner, which the ranks compare before anything moves. Results are cached. Raises
    ConfigError, before anything is computed, when either layout is invalid for the model.
    """
    a.check(model)
    b.check(model)
    return _rank_plan(model_key(model), a, b, rank)


@functools.lru_cache(maxsize=32)
def _plan(key: ModelKey, a: ParallelLayout, b: ParallelLayout) -> TransferPlan:
    model = ModelConfig(**dict(key))
    fills = _Fills(key, a, b)
    with standalone_world():  # one for every skeleton this plan builds
        ops = _in_plan_order([op for d in range(b.active) for op in fills.receives(d)])
        sources, targets = layout_pieces(model, a), layout_pieces(model, b)
    return TransferPlan(a, b, sources, targets, ops, fills.missing, plan_digest(key, a, b))


@functools.lru_cache(maxsize=64)
def _rank_plan(key: ModelKey, a: ParallelLayout, b: ParallelLayout, rank: int) -> RankPlan:
    fills = _Fills(key, a, b)
    # The collector paused: a full collection walks every object torch and megatron hold (0.17 s
    # here, a third of a 1,024-rank MoE plan), and the plan's allocations would set one off at random.
    with standalone_world(), gc_paused():  # one world for every skeleton this plan builds
        ops = _in_plan_order(fills.receives(rank) + fills.sends(rank))
    return RankPlan(a, b, rank, ops, plan_digest(key, a, b))


def _in_plan_order(ops: list[Op]) -> tuple[Op, ...]:
    # Stable: a target's ops keep their fill order.
    return tuple(sorted(ops, key=lambda op: _order(op.target)))


def _order(piece: Piece) -> tuple:
    """Model order (embedding, layers by global index, the rest; the step last), then state and
    destination rank, so ops of one tensor are adjacent for the executor's rounds."""
    name = piece.name
    group = 0 if name.key.startswith("embedding") else 1 if name.index else 2
    if piece.state == "step":
        group = 3
    return (group, name.index, name.key, piece.state, piece.rank, piece.box)


class _Fills:
    """Fills of destination pieces of one move; `missing` counts the network bytes of those
    filled so far."""

    def __init__(self, key: ModelKey, a: ParallelLayout, b: ParallelLayout) -> None:
        self.key, self.a, self.b = key, a, b
        self.model = ModelConfig(**dict(key))
        self.missing = 0
        # Per move, not lru caches keyed by the model: hashing its hundred fields per lookup
        # cost more than the lookups.
        self._holders: dict[tuple, list] = {}
        self._expert: dict[LogicalName, bool] = {}

    def receives(self, rank: int) -> list[Op]:
        """Every op that fills `rank`'s pieces of B."""
        return [op for t in rank_pieces(self.model, self.b, rank) for op in self.fill(t)]

    def sends(self, rank: int) -> list[Op]:
        """Every op by which `rank` sends another rank its pieces' boxes: the fills of the
        pieces of B that meet them (found per position, not per rank) and whose sender rule
        could pick `rank`, kept where the sender picked is `rank`."""
        out, seen = [], set()
        for p in rank_pieces(self.model, self.a, rank):
            for group in self.holders(False, p.name, p.state, p.box):
                for dst in self._may_pick(rank, group):
                    if dst == rank or (p.state == "step" and dst < self.a.active):
                        continue  # its own fill; a rank of A holds the step already
                    target = group.on(dst)
                    if target not in seen and not self._holds(target):
                        seen.add(target)
                        out += [op for op in self.fill(target) if op.src == rank]
        return out

    def _may_pick(self, rank: int, group: Holders) -> list[int]:
        """The ranks of `group` (replicas of one piece of B) whose fill could pick `rank` as a
        sender, by the rule alone: in some source group g that `rank` is in, g.ranks[pick // c %
        len(g.ranks)] is `rank` for some count c of candidates, at most the number of source
        groups. A necessary condition, cheap to test per rank: of the many DP replicas of a
        destination that draw on a replicated source, only those whose replica index can land
        on `rank` are filled."""
        p = group.piece
        sources = self.holders(True, p.name, p.state, p.box)
        dsts = np.arange(group.ranks.start, group.ranks.stop, group.ranks.step)
        picks = self._replica(p, dsts)
        may = np.zeros(len(dsts), dtype=bool)
        for g in sources:
            if rank not in g.ranks:
                continue
            if len(g.ranks) == 1:
                return dsts.tolist()  # a sole holder is picked whatever the index
            for c in range(1, len(sources) + 1):
                may |= picks // c % len(g.ranks) == g.ranks.index(rank)
        return dsts[may].tolist()

    def _holds(self, target: Piece) -> bool:
        """Whether the target's rank holds all of it in A already (its fill is one local op)."""
        return any(
            target.rank in g.ranks and contains(g.piece.box, target.box)
            for g in self.holders(True, target.name, target.state, target.box)
        )

    def holders(self, source: bool, name: LogicalName, state: str, box: Box) -> list:
        """The pieces of layout A (`source`) or B that meet `box`, grouped by replicas."""
        key = (source, name, state, box)
        if key not in self._holders:
            self._holders[key] = holders(self.key, self.a if source else self.b, name, state, box)
        return self._holders[key]

    def fill(self, target: Piece) -> list[Op]:
        """The ops that fill `target`: from its own rank's pieces of A first, then each box
        still missing from one holder, picked by the destination's replica index."""
        groups = self.holders(True, target.name, target.state, target.box)
        ops: list[Op] = []
        need = [target.box]
        for g in groups:
            if target.rank in g.ranks:
                need = _take(need, g.on(target.rank), target, ops)
        self.missing += sum(numel(box) for box in need) * (target.nbytes // numel(target.box))
        pick = self._replica(target, target.rank)
        while need:
            candidates = [g for g in groups if intersect(g.piece.box, need[0])]
            if not candidates:
                raise RuntimeError(
                    f"reshard: no rank of the source layout holds {target.name} {target.state} {need[0]}"
                )
            g = candidates[pick % len(candidates)]
            need = _take(need, g.on(g.ranks[pick // len(candidates) % len(g.ranks)]), target, ops)
        return ops

    def _replica(self, target: Piece, rank: RankOrRanks) -> RankOrRanks:
        """The replica index of `target`'s tensor on destination `rank`, or on each of an array
        of ranks (expert DP for an expert's, DP·CP otherwise), offset by the tensor's layer and
        expert indices to spread small groups."""
        if target.state == "step":
            return replica_index(self.b, rank, False)
        if target.name not in self._expert:
            self._expert[target.name] = is_expert(self.key, self.b, target.name)
        return replica_index(self.b, rank, self._expert[target.name]) + sum(target.name.index)


def _take(need: list[Box], source: Piece, target: Piece, ops: list[Op]) -> list[Box]:
    """Append ops copying `source` ∩ each needed box; return what is still needed."""
    rest = []
    itemsize = target.nbytes // numel(target.box)
    for box in need:
        common = intersect(box, source.box)
        if common is None:
            rest.append(box)
            continue
        nbytes = numel(common) * itemsize
        ops.append(Op(source.rank, target.rank, target.name, target.state, common, source, target, nbytes))
        rest += subtract(box, common)
    return rest
