"""What a DPP step plan is: the value the planner produces and the runtime executes.

A global batch of whole sequences is cut into chunks (pipeline micro-batches of varying size).
A chunk holds segments: a whole short sequence, or a slice of a long one. A slice attends to the
K/V of every earlier slice of its sequence, so slices run forward in order and backward in
reverse. The chunks run in one or more 1F1B pipelines (groups) per step; gradients accumulate
across groups. Every stage has its own op list, and each forward op says how many of that
stage's layers the chunk recomputes in backward.

Plans are plain frozen values, identical on every rank, so no shape is ever exchanged at run
time: both sides of a p2p transfer know a chunk's token count from the plan.

Under sequence parallelism every chunk's token count must be a multiple of the tensor-parallel
size: `padded` rounds a batch's chunks up with padding tokens.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Literal

ChunkKind = Literal["split", "packed", "hybrid"]
OpKind = Literal["F", "B"]


@dataclass(frozen=True)
class Segment:
    """Tokens [start, start + length) of sequence `seq` of the global batch. `start` > 0 means
    the earlier tokens of the sequence are a KV prefix this segment attends to."""

    seq: int
    start: int
    length: int

    @property
    def prefix(self) -> int:
        return self.start


@dataclass(frozen=True)
class Chunk:
    """One pipeline micro-batch. Segments are laid out in order along the token axis, then
    `padding` tokens of no sequence (no loss, attending to nothing), so that sequence
    parallelism can split the chunk evenly over the tensor-parallel ranks."""

    id: int
    kind: ChunkKind
    segments: tuple[Segment, ...]
    padding: int = 0

    @functools.cached_property
    def sequence_tokens(self) -> int:
        """Tokens of the segments (the chunk's tokens less its padding)."""
        return sum(s.length for s in self.segments)

    @functools.cached_property
    def tokens(self) -> int:  # cached: planners ask for it millions of times per batch
        return self.sequence_tokens + self.padding


def padded(chunks: tuple[Chunk, ...], multiple: int) -> tuple[Chunk, ...]:
    """`chunks` with each token count rounded up to a multiple of `multiple` by padding."""
    if multiple < 1:
        raise ValueError(f"dpp: a chunk's token multiple must be positive, got {multiple}")
    if multiple == 1:  # nothing to pad: the very chunks (planners call this for every candidate)
        return tuple(chunks)
    return tuple(dataclasses.replace(c, padding=-c.sequence_tokens % multiple) for c in chunks)


@dataclass(frozen=True)
class Op:
    """Forward or backward of chunk `chunk` on one stage. `recompute` (forward ops only) is the
    number of this stage's layers, counted from its first, whose activations are dropped after
    the forward and recomputed in backward (megatron's block recompute)."""

    kind: OpKind
    chunk: int
    recompute: int = 0


@dataclass(frozen=True)
class Group:
    """One 1F1B pipeline: `ops[stage]` is that stage's op sequence."""

    ops: tuple[tuple[Op, ...], ...]


@dataclass(frozen=True)
class StepPlan:
    """A whole step: the chunks of the global batch (`chunks[i].id == i`) and the 1F1B groups
    run one after another. `seq_lengths[i]` is the length of sequence i of the batch."""

    pp: int
    seq_lengths: tuple[int, ...]
    chunks: tuple[Chunk, ...]
    groups: tuple[Group, ...]

    def chunk(self, chunk_id: int) -> Chunk:
        return self.chunks[chunk_id]
