"""The reshard executor: a TransferPlan carried out in memory-budgeted rounds of point-to-point
messages.

    steps = rounds(p, budget_bytes=64 << 20)       # pure: the same on every rank
    print(peak_bytes(p, steps))                    # staging per rank, known before anything moves
    execute(p, steps, source.read, target.write)   # e.g. MegatronState from state_access.py

Rounds bound the staging memory: in one round a rank sends at most `budget` bytes and receives
at most `budget` bytes, so its staging (send buffers + receive buffers) is at most 2·budget. An
op larger than the budget is split along its box's leading axes into slabs that fit (a slab of
a box is still a box both its source and its destination hold, so the plan stays valid); the
smallest budget is therefore one element of the plan's widest dtype.

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
from collections import defaultdict
from typing import Callable, Optional

import torch
import torch.distributed as dist

from megatron_ext.reshard.boxes import Box, box_shape, numel
from megatron_ext.reshard.plan import Op, TransferPlan
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


def rounds(plan: TransferPlan, budget_bytes: int) -> list[Round]:
    """The plan's ops, in plan order, packed into rounds by next-fit: an op joins the open round
    unless that would push its source's sends or its destination's receives over the budget;
    then a new round opens. Local ops cost no staging and join the open round."""
    widest = max((_itemsize(plan, op) for op in plan.ops), default=1)
    if budget_bytes < widest:
        raise ValueError(
            f"reshard: a memory budget of {budget_bytes} bytes is below the plan's minimum "
            f"({widest} bytes, one element)"
        )
    out: list[Round] = []
    current: list[Op] = []
    sent: dict[int, int] = defaultdict(int)
    received: dict[int, int] = defaultdict(int)
    for whole in plan.ops:
        for op in _split(whole, budget_bytes, _itemsize(plan, whole)):
            if op.local:
                current.append(op)
                continue
            if sent[op.src] + op.nbytes > budget_bytes or received[op.dst] + op.nbytes > budget_bytes:
                out.append(Round(tuple(current)))
                current, sent, received = [], defaultdict(int), defaultdict(int)
            current.append(op)
            sent[op.src] += op.nbytes
            received[op.dst] += op.nbytes
    if current:
        out.append(Round(tuple(current)))
    return out


def peak_bytes(plan: TransferPlan, steps: list[Round]) -> dict[int, int]:
    """Each rank's largest staging in any round: its send buffers plus its receive buffers.
    Local ops copy straight from source to destination and stage nothing."""
    return {
        rank: max((r.sent(rank) + r.received(rank) for r in steps), default=0)
        for rank in range(plan.world)
    }


def _itemsize(plan: TransferPlan, op: Op) -> int:
    return plan.targets[op.target].nbytes // numel(plan.targets[op.target].box)


def _split(op: Op, budget: int, itemsize: int) -> list[Op]:
    """`op` as slabs of at most `budget` bytes: whole rows of its leading axis when a row fits,
    otherwise each row split the same way along the next axis."""
    if op.local or op.nbytes <= budget:
        return [op]
    (lo, hi), rest = op.box[0], op.box[1:]
    row = numel(rest) * itemsize
    if row > budget:
        rows = [dataclasses.replace(op, box=((i, i + 1),) + rest, nbytes=row) for i in range(lo, hi)]
        return [part for r in rows for part in _split_inner(r, budget, itemsize)]
    per = budget // row
    return [
        dataclasses.replace(op, box=((i, min(i + per, hi)),) + rest, nbytes=(min(i + per, hi) - i) * row)
        for i in range(lo, hi, per)
    ]


def _split_inner(row: Op, budget: int, itemsize: int) -> list[Op]:
    """A one-row op split along its remaining axes (the row index is kept)."""
    head, rest = row.box[0], row.box[1:]
    inner = dataclasses.replace(row, box=rest)
    return [dataclasses.replace(p, box=(head,) + p.box) for p in _split(inner, budget, itemsize)]


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
    plan: TransferPlan,
    steps: list[Round],
    read_local: ReadLocal,
    write_local: WriteLocal,
    group: Optional[dist.ProcessGroup] = None,
    channel=None,
    shared_memory: bool = True,
) -> Executed:
    """Run `steps` of `plan` on this rank: plan rank r is rank r of `channel` (default: of
    `group`, default the world; the worker pool has its own channel, see pool.py). Between the
    processes of one host the messages go through shared memory when every rank can
    (`shared_memory`, host tensors only; transport.py), else as point-to-point messages.

    `read_local(source_piece, box)` returns this rank's values of `box` (⊆ the piece's box) in
    the source layout; `write_local(target_piece, box, values)` stores them in the destination
    layout.
    """
    channel = channel or GroupChannel(group)
    by_round = [_by_peer(plan, step, channel.rank) for step in steps]
    transport = None
    network = any(not op.local for step in steps for op in step.ops)
    if shared_memory and network and channel.buffer_device.type == "cpu":
        transport = open_shared_memory(channel, [step.ops for step in steps], plan.world)
    transport = transport or Messages(channel, by_round)
    try:
        for index, (step, (outgoing, incoming)) in enumerate(zip(steps, by_round)):
            send = transport.send_buffers(outgoing)
            for peer, ops in outgoing.items():
                _pack(plan, ops, read_local, send[peer])
            received = transport.start(index, send, incoming)
            for op in step.ops:  # the local copies, while the messages travel
                if op.local and op.dst == channel.rank:
                    write_local(plan.targets[op.target], op.box, read_local(plan.sources[op.source], op.box))
            recv = received()
            for peer, ops in incoming.items():
                _unpack(plan, ops, recv[peer], write_local)
            transport.finish()
        return Executed(transport.staged, transport.name)
    finally:
        transport.close()


def _by_peer(plan: TransferPlan, step: Round, rank: int) -> tuple[dict, dict]:
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
    return _packing_order(plan, outgoing), _packing_order(plan, incoming)


def _packing_order(plan: TransferPlan, by_peer: dict[int, list[Op]]) -> dict[int, list[Op]]:
    # sorted() is stable: within one itemsize, op order.
    return {
        peer: sorted(ops, key=lambda op: -_itemsize(plan, op)) for peer, ops in sorted(by_peer.items())
    }


def _segments(plan: TransferPlan, ops: list[Op], buffer: torch.Tensor):
    """(op, typed view of its part of `buffer` shaped like its box), in packing order."""
    offset = 0
    for op in ops:
        dtype = getattr(torch, plan.targets[op.target].dtype)
        part = buffer[offset : offset + op.nbytes].view(dtype).view(box_shape(op.box))
        offset += op.nbytes
        yield op, part


def _pack(plan: TransferPlan, ops: list[Op], read_local: ReadLocal, buffer: torch.Tensor) -> None:
    for op, part in _segments(plan, ops, buffer):
        part.copy_(read_local(plan.sources[op.source], op.box))


def _unpack(plan: TransferPlan, ops: list[Op], buffer: torch.Tensor, write_local: WriteLocal) -> None:
    for op, part in _segments(plan, ops, buffer):
        write_local(plan.targets[op.target], op.box, part)
