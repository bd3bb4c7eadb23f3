"""The reshard plan: which boxes move from which rank to which, by box intersection.

    p = plan(model, ParallelLayout(tp=2, pp=2), ParallelLayout(pp=2, dp=2))
    print(p.summary())

A pure function of (model, layout A, layout B): every rank computes the same plan without
talking to the others (the digest proves it), and it is cached. For each state of each logical
tensor, each destination piece is first filled from what its own rank already holds in A
(local ops, no network bytes); each element still missing is received exactly once, from a
source chosen deterministically (least bytes sent so far, then nearest rank after the
destination). So the bytes on the network are the minimum: the destination elements its rank
does not hold in A.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from collections import defaultdict

from megatron_ext.config.schema import ModelConfig
from megatron_ext.models.logical import LogicalName
from megatron_ext.reshard.boxes import Box, intersect, numel, subtract
from megatron_ext.reshard.layout import ParallelLayout
from megatron_ext.reshard.vps import ModelKey, Piece, layout_pieces, model_key


@dataclasses.dataclass(frozen=True)
class Op:
    """Copy `box` of (name, state) from rank `src` to rank `dst` (a local copy when equal)."""

    src: int
    dst: int
    name: LogicalName
    state: str
    box: Box
    source: int  # index of the piece in TransferPlan.sources that holds the box on `src`
    target: int  # index of the piece in TransferPlan.targets that receives it on `dst`
    nbytes: int

    @property
    def local(self) -> bool:
        return self.src == self.dst


@dataclasses.dataclass(frozen=True)
class TransferPlan:
    a: ParallelLayout
    b: ParallelLayout
    sources: tuple[Piece, ...]  # every piece of layout A
    targets: tuple[Piece, ...]  # every piece of layout B
    ops: tuple[Op, ...]  # in plan order: tensors in model order, destinations by rank
    min_bytes: int  # bytes of destination elements whose rank does not hold them in A
    digest: str  # sha256 of everything above: equal on every rank that planned the same move

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


def plan(model: ModelConfig, a: ParallelLayout, b: ParallelLayout) -> TransferPlan:
    """The plan moving every training state of `model` from layout `a` to layout `b`.

    `model.vocab_size` is the run's padded vocabulary. Raises ConfigError, before anything is
    computed, when either layout is invalid for the model."""
    a.check(model)
    b.check(model)
    return _plan(model_key(model), a, b)


@functools.lru_cache(maxsize=32)
def _plan(key: ModelKey, a: ParallelLayout, b: ParallelLayout) -> TransferPlan:
    model = ModelConfig(**dict(key))
    sources, targets = layout_pieces(model, a), layout_pieces(model, b)
    planner = _Planner(sources, max(a.world, b.world))
    for t in sorted(range(len(targets)), key=lambda t: _order(targets[t])):
        planner.fill(t, targets[t])
    ops = tuple(planner.ops)
    digest = hashlib.sha256(repr((key, a, b, sources, targets, ops, planner.min_bytes)).encode())
    return TransferPlan(a, b, sources, targets, ops, planner.min_bytes, digest.hexdigest())


def _order(piece: Piece) -> tuple:
    """Model order (embedding, layers by global index, the rest; the step last), then state and
    destination rank, so ops of one tensor are adjacent for the executor's rounds."""
    name = piece.name
    group = 0 if name.key.startswith("embedding") else 1 if name.index else 2
    if piece.state == "step":
        group = 3
    return (group, name.index, name.key, piece.state, piece.rank, piece.box)


def _itemsize(piece: Piece) -> int:
    return piece.nbytes // numel(piece.box)


class _Planner:
    """One plan being computed: the ops so far and the network bytes each rank sends so far."""

    def __init__(self, sources: tuple[Piece, ...], world: int) -> None:
        self.sources, self.world = sources, world
        self.by_tensor: dict[tuple[LogicalName, str], list[int]] = defaultdict(list)
        for s, piece in enumerate(sources):
            self.by_tensor[(piece.name, piece.state)].append(s)
        self.ops: list[Op] = []
        self.load = [0] * world
        self.min_bytes = 0

    def fill(self, t: int, target: Piece) -> None:
        """Fill target piece `t`: first from its own rank's pieces (local copies), then each
        missing box from the least-loaded holder (ties: the first rank after the target's), so
        replicas share the sending; what that holder lacks goes round again."""
        holders = [
            s for s in self.by_tensor.get((target.name, target.state), ())
            if intersect(self.sources[s].box, target.box)
        ]
        need = [target.box]
        for s in holders:
            if self.sources[s].rank == target.rank:
                need = self._take(need, s, t, target)
        self.min_bytes += sum(numel(box) for box in need) * _itemsize(target)
        remote = [s for s in holders if self.sources[s].rank != target.rank]
        while need:
            s = self._choose(remote, need[0], target)
            before = len(self.ops)
            need = self._take(need, s, t, target)
            self.load[self.sources[s].rank] += sum(op.nbytes for op in self.ops[before:])

    def _choose(self, remote: list[int], box: Box, target: Piece) -> int:
        candidates = [s for s in remote if intersect(self.sources[s].box, box)]
        if not candidates:
            raise RuntimeError(
                f"reshard: no rank of the source layout holds {target.name} {target.state} {box}"
            )

        def preference(s: int) -> tuple[int, int, int]:
            rank = self.sources[s].rank
            return (self.load[rank], (rank - target.rank) % self.world, s)

        return min(candidates, key=preference)

    def _take(self, need: list[Box], s: int, t: int, target: Piece) -> list[Box]:
        """Emit ops copying source `s` ∩ each needed box; return what is still needed."""
        source, rest = self.sources[s], []
        for box in need:
            common = intersect(box, source.box)
            if common is None:
                rest.append(box)
                continue
            nbytes = numel(common) * _itemsize(target)
            op = Op(source.rank, target.rank, target.name, target.state, common, s, t, nbytes)
            self.ops.append(op)
            rest += subtract(box, common)
        return rest
