"""The reshard executor: a plan carried out in memory-budgeted rounds of point-to-point messages.

    mine = schedule(rank_plan(model, a, b, rank), budget_bytes=64 << 20)  # agreed by all ranks
    execute(plan, mine.steps, source.read, target.write)  # e.g. MegatronState (state_access.py)
    steps = rounds(world_plan, budget_bytes)             # the world's rounds, for tests and sims

Rounds bound the staging memory: in one round a rank sends at most `budget` bytes and receives
at most `budget` bytes, so its staging (send buffers + receive buffers) is at most 2·budget. An
op larger than its share of the budget is split along its box's leading axes into slabs that
fit (a slab of a box is still a box both its source and its destination hold, so the plan stays
valid); the smallest budget is therefore one element of the widest dtype per peer.

Each rank finds its own rounds from its own plan (`rank_rounds`): each pair of ranks cuts the
ops between them, which both ends know, into rounds of the pair's capacity, a share of each
end's budget computed from one small all-gather of every rank's byte counts (`schedule`, which
first checks that every rank planned the very same move with the same budget).

In a round each rank packs everything it sends to one peer into one buffer; the buffers travel
by one of two transports (transport.py). Between processes of one host, through shared memory:
each rank packs into its own arena, which its peers have mapped, and they unpack from it in
place after a barrier (a gloo message would add two socket copies). Otherwise as point-to-point
messages: all sends and receives of the round are posted at once, as one `batch_isend_irecv`
tagged with the round's index: gloo matches a message by (peer, tag) (checked with torch 2.13:
crossed posting orders deliver correctly) and NCCL runs a batch as one group launch, so posting
order cannot deadlock and no barrier is needed. Either way the staging arenas are allocated once
per move at the largest round's size and reused by every round. Local ops (source rank =
destination rank) are plain copies.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections import defaultdict
from typing import Callable, Iterator, Optional, Sequence, Union

import torch
import torch.distributed as dist

from megatron_ext.reshard.boxes import Box, box_shape, numel
from megatron_ext.reshard.plan import Op, RankPlan, TransferPlan
from megatron_ext.reshard.transport import Messages, open_shared_memory
from megatron_ext.reshard.vps import Piece

ReadLocal = Callable[[Piece, Box], torch.Tensor]
WriteLocal = Callable[[Piece, Box, torch.Tensor], None]


@dataclasses.dataclass(frozen=True)
class Round:
    """Ops run together: per rank, network bytes sent ≤ budget and received ≤ budget."""

    ops: tuple[Op, ...]

    def sent(self, rank: int) -> int:
        return sum(op.nbytes for op in self.ops if op.src == rank and not op.local)

    def received(self, rank: int) -> int:
        return sum(op.nbytes for op in self.ops if op.dst == rank and not op.local)


@dataclasses.dataclass(frozen=True)
class Traffic:
    """One rank's network bytes sent and received in a move, and its floors: the widest element
    of each peer's ops, summed over the peers it sends to (receives from)."""

    sent: int
    received: int
    send_floor: int
    receive_floor: int


def traffic(plan: Union[RankPlan, TransferPlan], rank: int) -> Traffic:
    sent, received = _pairs(plan, rank, "src", "dst"), _pairs(plan, rank, "dst", "src")
    return Traffic(
        sum(b for b, _ in sent.values()),
        sum(b for b, _ in received.values()),
        sum(w for _, w in sent.values()),
        sum(w for _, w in received.values()),
    )


def _pairs(plan, rank: int, mine: str, theirs: str) -> dict[int, tuple[int, int]]:
    """Peer -> (network bytes, widest itemsize) of `rank`'s ops where it is `mine` (src/dst)."""
    out: dict[int, tuple[int, int]] = {}
    for op in plan.ops:
        if not op.local and getattr(op, mine) == rank:
            nbytes, widest = out.get(getattr(op, theirs), (0, 0))
            out[getattr(op, theirs)] = (nbytes + op.nbytes, max(widest, op.itemsize))
    return out


def rank_rounds(
    plan: Union[RankPlan, TransferPlan], rank: int, budget_bytes: int, everyone: Sequence[Traffic]
) -> list[Round]:
    """`rank`'s ops of `plan` in rounds, from its own ops and every rank's Traffic (gathered in
    one small all-reduce: `schedule`).

    Each pair of ranks cuts its own stream (its ops in plan order, both ends list them alike)
    into rounds of at most the pair's capacity, by next-fit, an op larger than that as slabs.
    The capacity is the smaller of the two ends' shares: a rank gives each peer its widest
    element plus a part of the rest of the budget proportional to its bytes with that peer. The
    shares of a rank sum to at most the budget, so no rank sends or receives more than the
    budget in any round; and the busiest rank's pairs all take about its bytes over the budget
    rounds, the lower bound. Both ends compute the same cut from the same numbers, so an op has
    one round without the world's plan. Local ops cost no staging: they run in the first round.
    Raises ValueError when the budget is below some rank's floor (every rank raises alike)."""
    _check_budget(budget_bytes, everyone)
    return _cut(plan, budget_bytes, everyone, lambda op: op.dst == rank or (not op.local and op.src == rank))


def _check_budget(budget_bytes: int, everyone: Sequence[Traffic]) -> None:
    for r, t in enumerate(everyone):
        floor = max(t.send_floor, t.receive_floor)
        if budget_bytes < max(floor, 1):
            raise ValueError(
                f"reshard: a memory budget of {budget_bytes} bytes is below the plan's minimum "
                f"({floor} bytes, one element per peer of rank {r})"
            )


def _cut(plan, budget_bytes: int, everyone: Sequence[Traffic], mine: Callable[[Op], bool]) -> list[Round]:
    """The rounds of the plan's ops that `mine` selects, each pair's stream cut alone."""
    # Ops by pair, each with its place in the plan: a round lists its ops in plan order.
    streams: dict[tuple[int, int], list[tuple[int, Op]]] = defaultdict(list)
    local: list[tuple[int, Op]] = []
    for i, op in enumerate(plan.ops):
        if mine(op):
            (local if op.local else streams[op.src, op.dst]).append((i, op))
    out: list[list[tuple[int, Op]]] = [local]
    for (src, dst), ops in sorted(streams.items()):
        capacity = _capacity(budget_bytes, [op for _, op in ops], everyone[src], everyone[dst])
        for index, i, part in _next_fit(ops, capacity):
            while len(out) <= index:
                out.append([])
            out[index].append((i, part))
    if not any(out):
        return []
    # sorted() is stable: an op's slabs keep their order.
    return [Round(tuple(op for _, op in sorted(step, key=lambda x: x[0]))) for step in out]


def _capacity(budget: int, ops: list[Op], src: Traffic, dst: Traffic) -> int:
    nbytes, widest = sum(op.nbytes for op in ops), max(op.itemsize for op in ops)

    def share(total: int, floor: int) -> int:
        return widest + (budget - floor) * nbytes // total // widest * widest

    return min(share(src.sent, src.send_floor), share(dst.received, dst.receive_floor))


def _next_fit(ops: list[tuple[int, Op]], capacity: int) -> Iterator[tuple[int, int, Op]]:
    """(round index, place in the plan, op or slab) for a pair's stream cut into rounds of at
    most `capacity` bytes."""
    index, used = 0, 0
    for i, whole in ops:
        for part in _split(whole, capacity, whole.itemsize):
            if used + part.nbytes > capacity:
                index, used = index + 1, 0
            used += part.nbytes
            yield index, i, part


def rounds(plan: TransferPlan, budget_bytes: int) -> list[Round]:
    """The world plan's rounds: round k holds every rank's ops of its round k (`rank_rounds`,
    with every rank's Traffic taken from the plan). For tests, summaries and the simulator;
    a running move schedules each rank's own (`schedule`)."""
    everyone = [traffic(plan, r) for r in range(plan.world)]
    _check_budget(budget_bytes, everyone)
    return _cut(plan, budget_bytes, everyone, lambda op: True)


def peak_bytes(plan, steps: list[Round]) -> dict[int, int]:
    """Each rank's largest staging in any round: its send buffers plus its receive buffers.
    Local ops copy straight from source to destination and stage nothing."""
    return {
        rank: max((r.sent(rank) + r.received(rank) for r in steps), default=0)
        for rank in range(plan.world)
    }


@dataclasses.dataclass(frozen=True)
class Schedule:
    """This rank's rounds of a move, padded to the count every rank runs, the largest staging
    any rank may need, and the bytes every rank receives over the network, summed."""

    steps: list[Round]
    peak_bound: int
    network_bytes: int


def schedule(plan: RankPlan, budget_bytes: int, channel=None, group: Optional[dist.ProcessGroup] = None) -> Schedule:
    """Check, before anything moves, that every rank planned the same move with the same budget
    (the plans' digests: ValueError on every rank otherwise), then cut this rank's rounds from
    every rank's Traffic; two small all-reduces over `channel` (default: `group`'s)."""
    channel = channel or GroupChannel(group)
    digest = hashlib.sha256(repr((plan.digest, budget_bytes)).encode()).hexdigest()
    mine = traffic(plan, plan.rank)
    rows = torch.zeros(plan.world, 5, dtype=torch.int64)
    rows[plan.rank] = torch.tensor([int(digest[:15], 16), *dataclasses.astuple(mine)])  # 60 bits
    channel.all_reduce_sum(rows)
    active = rows[:, 0] != 0
    if bool((rows[active, 0] != rows[plan.rank, 0]).any()) or int(active.sum()) != plan.world:
        raise ValueError(f"reshard: the ranks planned different moves to {plan.b}; nothing was moved")
    everyone = [Traffic(*row[1:].tolist()) for row in rows]
    steps = rank_rounds(plan, plan.rank, budget_bytes, everyone)
    sizes = torch.zeros(plan.world, 2, dtype=torch.int64)
    sizes[plan.rank] = torch.tensor([len(steps), max(peak_bytes(plan, steps)[plan.rank] if steps else 0, 0)])
    channel.all_reduce_sum(sizes)
    count, bound = int(sizes[:, 0].max()), int(sizes[:, 1].max())
    return Schedule(steps + [Round(())] * (count - len(steps)), bound, sum(t.received for t in everyone))


def _split(op: Op, budget: int, itemsize: int) -> list[Op]:
    """`op` as slabs of at most `budget` bytes: whole rows of its leading axis when a row fits,
    otherwise each row split the same way along the next axis."""
    if op.local or op.nbytes <= budget:
        return [op]
    (lo, hi), rest = op.box[0], op.box[1:]
    row = numel(rest) * itemsize
    if row > budget:
        rows = [_slab(op, ((i, i + 1),) + rest, row) for i in range(lo, hi)]
        return [part for r in rows for part in _split_inner(r, budget, itemsize)]
    per = budget // row
    return [_slab(op, ((i, min(i + per, hi)),) + rest, (min(i + per, hi) - i) * row) for i in range(lo, hi, per)]


def _slab(op: Op, box: Box, nbytes: int) -> Op:
    # dataclasses.replace costs several times this, and a small budget makes many slabs.
    return Op(op.src, op.dst, op.name, op.state, box, op.source, op.target, nbytes)


def _split_inner(row: Op, budget: int, itemsize: int) -> list[Op]:
    """A one-row op split along its remaining axes (the row index is kept)."""
    head, rest = row.box[0], row.box[1:]
    inner = _slab(row, rest, row.nbytes)
    return [_slab(p, (head,) + p.box, p.nbytes) for p in _split(inner, budget, itemsize)]


class GroupChannel:
    """Point-to-point messages among the ranks of a torch.distributed group (default: the
    world), numbered as the group numbers them."""

    def __init__(self, group: Optional[dist.ProcessGroup] = None) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        # NCCL carries device tensors, gloo host tensors.
        nccl = dist.get_backend(group) == "nccl"
        self.buffer_device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")

    def exchange(self, recv: dict[int, torch.Tensor], send: dict[int, torch.Tensor], tag: int) -> list:
        """Post every receive and send at once; returns the requests to wait for."""
        messages = [dist.P2POp(dist.irecv, b, self._peer(p), self.group, tag) for p, b in recv.items()]
        messages += [dist.P2POp(dist.isend, b, self._peer(p), self.group, tag) for p, b in send.items()]
        return dist.batch_isend_irecv(messages) if messages else []

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        dist.all_reduce(tensor, group=self.group)

    def _peer(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)


@dataclasses.dataclass(frozen=True)
class Executed:
    staged_bytes: int  # the most staging bytes this rank held at once
    transport: str  # how the messages travelled: "shared memory" or "messages"


NOTHING_MOVED = Executed(0, "nothing")


def execute(
    plan: Union[RankPlan, TransferPlan],
    steps: list[Round],
    read_local: ReadLocal,
    write_local: WriteLocal,
    group: Optional[dist.ProcessGroup] = None,
    channel=None,
    shared_memory: bool = True,
) -> Executed:
    """Run `steps` (`schedule`'s, or the world's `rounds`: as many on every rank) of `plan` on
    this rank: plan rank r is rank r of `channel` (default: of `group`, default the world; the
    worker pool has its own channel, see pool.py). Between the processes of one host the
    messages go through shared memory when every rank can (`shared_memory`, host tensors only;
    transport.py: collectives over the channel, so every rank of it must ask the same), else as
    point-to-point messages.

    `read_local(source_piece, box)` returns this rank's values of `box` (⊆ the piece's box) in
    the source layout; `write_local(target_piece, box, values)` stores them in the destination
    layout.
    """
    channel = channel or GroupChannel(group)
    by_round = [_by_peer(step, channel.rank) for step in steps]
    transport = None
    if shared_memory and channel.buffer_device.type == "cpu":
        transport = open_shared_memory(channel, by_round, plan.world)
    transport = transport or Messages(channel, by_round)
    try:
        for index, (step, (outgoing, incoming)) in enumerate(zip(steps, by_round)):
            send = transport.send_buffers(outgoing)
            for peer, ops in outgoing.items():
                _pack(ops, read_local, send[peer])
            received = transport.start(index, send, incoming)
            for op in step.ops:  # the local copies, while the messages travel
                if op.local and op.dst == channel.rank:
                    write_local(op.target, op.box, read_local(op.source, op.box))
            recv = received()
            for peer, ops in incoming.items():
                _unpack(ops, recv[peer], write_local)
            transport.finish()
        return Executed(transport.staged, transport.name)
    finally:
        transport.close()


def local_rounds(plan: Union[RankPlan, TransferPlan]) -> list[Round]:
    """The one round of a plan of local copies only (e.g. A -> A, a rollback): the same count
    on every rank without a word exchanged."""
    if any(not op.local for op in plan.ops):
        raise ValueError("reshard: the plan sends over the network; schedule it")
    return [Round(plan.ops)]


def _by_peer(step: Round, rank: int) -> tuple[dict, dict]:
    """This rank's network ops of the round, by peer, in packing order: widest dtype first,
    then op order. Both ends compute the same order, and every segment starts aligned for its
    dtype (each segment's size is a multiple of every narrower itemsize), so a buffer's bytes
    can be viewed as typed tensors without copies."""
    outgoing: dict[int, list[Op]] = defaultdict(list)
    incoming: dict[int, list[Op]] = defaultdict(list)
    for op in step.ops:
        if not op.local and op.src == rank:
            outgoing[op.dst].append(op)
        if not op.local and op.dst == rank:
            incoming[op.src].append(op)
    return _packing_order(outgoing), _packing_order(incoming)


def _packing_order(by_peer: dict[int, list[Op]]) -> dict[int, list[Op]]:
    # sorted() is stable: within one itemsize, op order.
    return {peer: sorted(ops, key=lambda op: -op.itemsize) for peer, ops in sorted(by_peer.items())}


def _segments(ops: list[Op], buffer: torch.Tensor):
    """(op, typed view of its part of `buffer` shaped like its box), in packing order."""
    offset = 0
    for op in ops:
        dtype = getattr(torch, op.target.dtype)
        part = buffer[offset : offset + op.nbytes].view(dtype).view(box_shape(op.box))
        offset += op.nbytes
        yield op, part


def _pack(ops: list[Op], read_local: ReadLocal, buffer: torch.Tensor) -> None:
    for op, part in _segments(ops, buffer):
        part.copy_(read_local(op.source, op.box))


def _unpack(ops: list[Op], buffer: torch.Tensor, write_local: WriteLocal) -> None:
    for op, part in _segments(ops, buffer):
        write_local(op.target, op.box, part)
