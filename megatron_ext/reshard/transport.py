"""How a round's packed messages travel from rank to rank (see execute.py).

Two transports with one interface:

- `Messages`: each message is a point-to-point send over the channel (gloo or NCCL); its
  buffers live on the channel's device. A gloo message is copied into a socket and out of it
  again: two copies of every byte on top of packing and unpacking.
- `SharedMemory`: when every rank of the channel is a process of one host, each rank packs its
  round's messages into its own arena in shared memory (/dev/shm) that its peers have mapped,
  and after a barrier every peer unpacks its part straight from there. Only the packing and
  unpacking copies remain. A second barrier per round keeps a rank from packing the next round
  over a message not yet read. `open_shared_memory` falls back to `Messages` (returns None)
  when any rank cannot create its arena (a full /dev/shm: the space is reserved up front, so a
  full tmpfs is an error here and never a SIGBUS later) or cannot map a peer's (another host).

A rank's arena file is unlinked as soon as its peers have mapped it (at the end of the setup's
collectives), so a worker killed during the transfer leaves nothing behind in /dev/shm.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Optional

import torch

from megatron_ext.reshard.plan import Op

SHM_DIR = Path("/dev/shm")

ByPeer = dict[int, list[Op]]  # a rank's ops of one round, by peer, in packing order


def slices(arena: torch.Tensor, by_peer: ByPeer) -> dict[int, torch.Tensor]:
    """Each peer's message: consecutive parts of `arena`, in peer order."""
    buffers, offset = {}, 0
    for peer, ops in by_peer.items():
        buffers[peer] = arena[offset : offset + size(ops)]
        offset += size(ops)
    return buffers


def size(ops: list[Op]) -> int:
    return sum(op.nbytes for op in ops)


def size_all(by_peer: ByPeer) -> int:
    return sum(size(ops) for ops in by_peer.values())


def arena(nbytes: int, device: torch.device) -> torch.Tensor:
    """A staging buffer that every round reuses, written once here: fresh host memory is mapped
    on first write, and faulting in new buffers every round doubled a 100M model's transfer."""
    return torch.zeros(nbytes, dtype=torch.uint8, device=device)


class Messages:
    """Point-to-point messages over `channel`, staged in one send and one receive arena."""

    name = "messages"

    def __init__(self, channel, by_round: list[tuple[ByPeer, ByPeer]]) -> None:
        self.channel = channel
        device = channel.buffer_device
        self.send_arena = arena(max((size_all(out) for out, _ in by_round), default=0), device)
        self.recv_arena = arena(max((size_all(inc) for _, inc in by_round), default=0), device)
        self.staged = max((size_all(out) + size_all(inc) for out, inc in by_round), default=0)

    def send_buffers(self, outgoing: ByPeer) -> dict[int, torch.Tensor]:
        return slices(self.send_arena, outgoing)

    def start(self, index: int, send: dict[int, torch.Tensor], incoming: ByPeer) -> Callable[[], dict]:
        """Post the round's messages; returns the wait for its received buffers."""
        recv = slices(self.recv_arena, incoming)
        requests = self.channel.exchange(recv, send, index)

        def received() -> dict[int, torch.Tensor]:
            for request in requests:
                request.wait()
            return recv

        return received

    def finish(self) -> None:
        """The round's received buffers are unpacked (nothing to wait for)."""

    def close(self) -> None:
        pass


class SharedMemory:
    """Each rank's messages in its own shared-memory arena, read in place by its peers. The
    arena starts with a header: where this round's message to each rank begins (a receiver
    knows only its own messages, not what its peer sends the others)."""

    name = "shared memory"

    def __init__(self, channel, mine: torch.Tensor, peers: dict[int, torch.Tensor], world: int) -> None:
        self.channel = channel
        self.mine, self.peers = mine, peers  # this rank's arena; those of the ranks it hears from
        self.header = 8 * world
        self.staged = mine.numel() - self.header

    def send_buffers(self, outgoing: ByPeer) -> dict[int, torch.Tensor]:
        starts = self.mine[: self.header].view(torch.int64)
        offset = self.header
        for peer, ops in outgoing.items():
            starts[peer] = offset
            offset += size(ops)
        return slices(self.mine[self.header :], outgoing)

    def start(self, index: int, send: dict[int, torch.Tensor], incoming: ByPeer) -> Callable[[], dict]:
        """Nothing to post: the wait is for every rank to have packed (this rank's local copies
        run meanwhile), then the messages are read where their senders packed them."""

        def received() -> dict[int, torch.Tensor]:
            _barrier(self.channel)
            rank = self.channel.rank
            starts = {peer: int(self.peers[peer][: self.header].view(torch.int64)[rank]) for peer in incoming}
            return {peer: self.peers[peer][starts[peer] : starts[peer] + size(ops)] for peer, ops in incoming.items()}

        return received

    def finish(self) -> None:
        _barrier(self.channel)  # every rank has unpacked: arenas may be packed again

    def close(self) -> None:
        self.mine, self.peers = None, {}


def open_shared_memory(channel, by_round: list[tuple[ByPeer, ByPeer]], world: int) -> Optional[SharedMemory]:
    """Shared-memory arenas for a transfer whose rounds (this rank's messages by peer, out and
    in; as many rounds on every rank) are `by_round`: every rank calls this; None, on every
    rank, when some rank cannot take part."""
    rank = channel.rank
    header = 8 * world
    token = _common_token(channel)
    path = _arena_path(token, rank)
    mine = _create(path, header + max((size_all(out) for out, _ in by_round), default=0))
    if _any_failed(channel, mine is None):
        _unlink(path)
        return None
    senders = {peer for _, incoming in by_round for peer in incoming}
    peers = {src: _map(_arena_path(token, src)) for src in senders}
    failed = _any_failed(channel, any(p is None for p in peers.values()))
    _unlink(path)  # every peer has mapped it (or given up): the mapping outlives the name
    if failed:
        return None
    return SharedMemory(channel, mine, peers, world)


def _arena_path(token: int, rank: int) -> Path:
    return SHM_DIR / f"megatron_ext-reshard-{token:016x}-{rank}"


def _create(path: Path, nbytes: int) -> Optional[torch.Tensor]:
    """This rank's arena, its space reserved now (ENOSPC here rather than SIGBUS mid-copy)."""
    try:
        fd = os.open(path, os.O_CREAT | os.O_TRUNC | os.O_RDWR, 0o600)
        try:
            os.posix_fallocate(fd, 0, max(nbytes, 1))
        finally:
            os.close(fd)
        return torch.from_file(str(path), shared=True, size=max(nbytes, 1), dtype=torch.uint8)[:nbytes]
    except (OSError, RuntimeError):  # RuntimeError: torch could not map it
        return None


def _map(path: Path) -> Optional[torch.Tensor]:
    try:
        return torch.from_file(str(path), shared=True, size=path.stat().st_size, dtype=torch.uint8)
    except (OSError, RuntimeError):
        return None


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass


def _common_token(channel) -> int:
    """A random number of the channel's rank 0, on every rank: names this transfer's files."""
    mine = int.from_bytes(os.urandom(8), "little") >> 2 if channel.rank == 0 else 0
    token = torch.tensor([mine], dtype=torch.int64)
    channel.all_reduce_sum(token)
    return int(token.item())


def _any_failed(channel, failed: bool) -> bool:
    flag = torch.tensor([int(failed)], dtype=torch.int64)
    channel.all_reduce_sum(flag)
    return bool(flag.item())


def _barrier(channel) -> None:
    channel.all_reduce_sum(torch.zeros(1, dtype=torch.int64))
