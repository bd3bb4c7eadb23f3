"""Workload-balanced sequence chunking (InfiniPipe's Alg. 1).

The longest sequence of the batch is cut into K slices of equal forward time (later slices are
shorter: they attend to a longer prefix). Those boundaries, the mesh, are applied to every
sequence: full mesh cells become split chunks, a leftover piece past the last full cell a tail
slice, and a sequence shorter than the first cell a short sequence. Each tail opens a bucket;
short sequences go best-fit-decreasing into buckets under a time target (one mesh cell's time)
and a token target (the first, largest, cell). Buckets with a tail become hybrid chunks (split,
if nothing joined the tail); buckets of short sequences only become packed chunks.

Chunks of one long sequence are created in slice order; the schedule relies on it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

from megatron_ext.dpp.planning.costmodel import CostModel
from megatron_ext.dpp.planning.plan import Chunk, Segment


def equal_time_mesh(longest: int, k: int, cost: CostModel) -> tuple[int, ...]:
    """Boundaries 0 = b_0 < ... < b_k = longest of k slices with (nearly) equal layer time."""
    k = max(1, min(k, longest))

    def cover(t: float) -> tuple[int, ...]:
        bounds = [0]
        while bounds[-1] < longest and len(bounds) <= k:
            bounds.append(min(longest, bounds[-1] + max(1, cost.slice_tokens(t, bounds[-1]))))
        return tuple(bounds)

    lo, hi = 0.0, cost.time_from_work(cost.segment_work(longest, 0), longest)
    for _ in range(60):  # bisect the per-slice time until k slices just cover the sequence
        mid = (lo + hi) / 2
        if cover(mid)[-1] < longest or len(cover(mid)) > k + 1:
            lo = mid
        else:
            hi = mid
    return cover(hi)


def even_mesh(longest: int, k: int) -> tuple[int, ...]:
    k = max(1, min(k, longest))
    return tuple(round(i * longest / k) for i in range(k + 1))


@dataclass
class _Bucket:
    segments: list[Segment] = field(default_factory=list)
    tokens: int = 0
    work: float = 0.0
    has_tail: bool = False

    def add(self, seg: Segment, work: float) -> None:
        self.segments.append(seg)
        self.tokens += seg.length
        self.work += work


def _pieces(lengths: Sequence[int], mesh: tuple[int, ...]) -> tuple[list[list[Segment]], list[Segment], list[Segment]]:
    """(full-cell slices per long sequence, tail slices, short sequences)."""
    splits, tails, shorts = [], [], []
    for seq, n in enumerate(lengths):
        if n <= mesh[1]:  # fits the first cell whole: a short sequence, packed
            shorts.append(Segment(seq, 0, n))
            continue
        full = [Segment(seq, a, b - a) for a, b in zip(mesh, mesh[1:]) if b <= n]
        splits.append(full)
        end = full[-1].start + full[-1].length
        if end < n:
            tails.append(Segment(seq, end, n - end))
    return splits, tails, shorts


def _pack(tails: list[Segment], shorts: list[Segment], cost: CostModel, time_target: float, token_target: int) -> list[_Bucket]:
    buckets = []
    for t in tails:
        b = _Bucket(has_tail=True)
        b.add(t, cost.segment_work(t.length, t.prefix))
        buckets.append(b)
    shorts = sorted(shorts, key=lambda s: (-cost.segment_work(s.length, 0), s.seq))
    for s in shorts:
        work = cost.segment_work(s.length, 0)
        time_of = lambda b: cost.time_from_work(b.work + work, b.tokens + s.length)  # noqa: E731, B023 (used in this iteration)
        if not buckets or min(b.tokens for b in buckets) + s.length > token_target:
            b = _Bucket()
            b.add(s, work)
            buckets.append(b)
            continue
        # A low time/token ratio marks a bucket with little long-sequence (prefix) content.
        ordered = sorted(buckets, key=lambda b: cost.time_from_work(b.work, b.tokens) / b.tokens)
        fits = [b for b in ordered if b.tokens + s.length <= token_target and time_of(b) <= time_target]
        if not fits:
            # Relax the time target to what the least loaded bucket would reach.
            fits = [min((b for b in ordered if b.tokens + s.length <= token_target), key=time_of)]
            time_target = max(time_target, time_of(fits[0]))
        fits[0].add(s, work)
    return buckets


def blended_mesh(longest: int, k: int, cost: CostModel, share: float) -> tuple[int, ...]:
    """Boundaries `share` of the way from the even mesh's to the equal-time mesh's (0: even,
    1: equal time). Memory may admit a first slice larger than an even one's but not as large
    as an equal-time one's."""
    if share >= 1:
        return equal_time_mesh(longest, k, cost)
    even = even_mesh(longest, k)
    if share <= 0:
        return even
    return tuple(round((1 - share) * a + share * b) for a, b in zip(even, equal_time_mesh(longest, k, cost)))


def chunk_batch(lengths: Sequence[int], cost: CostModel, k: int, balanced: bool | float = True) -> tuple[Chunk, ...]:
    """Chunks of a global batch with slice number k; ids in creation order: the slices of each
    long sequence (its hybrid tail last), then the packed chunks. `balanced=False` is the
    ablation: an even token mesh and packing to the token target only; a share in (0, 1) a
    blended mesh (`blended_mesh`) packed like a balanced one."""
    longest = max(lengths)
    mesh = blended_mesh(longest, k, cost, float(balanced))
    time_target = cost.time_from_work(cost.segment_work(mesh[1], 0), mesh[1]) if balanced else math.inf
    return chunk_on_mesh(lengths, cost, mesh, time_target)


def chunk_on_mesh(lengths: Sequence[int], cost: CostModel, mesh: Sequence[int], time_target: float) -> tuple[Chunk, ...]:
    """Chunks from given slice boundaries (the mesh must reach the longest sequence)."""
    mesh = tuple(mesh)
    splits, tails, shorts = _pieces(lengths, mesh)
    buckets = _pack(tails, shorts, cost, time_target, token_target=mesh[1])
    tail_bucket = {b.segments[0].seq: b for b in buckets if b.has_tail}
    chunks: list[Chunk] = []
    for full in splits:
        for seg in full:
            chunks.append(Chunk(len(chunks), "split", (seg,)))
        b = tail_bucket.get(full[0].seq)
        if b is not None:
            chunks.append(Chunk(len(chunks), "hybrid" if len(b.segments) > 1 else "split", tuple(b.segments)))
    for b in buckets:
        if not b.has_tail:
            chunks.append(Chunk(len(chunks), "packed", tuple(b.segments)))
    return tuple(chunks)
