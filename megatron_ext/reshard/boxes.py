"""Axis-aligned boxes in a logical tensor: the geometry the reshard planner is made of.

A box is a tuple of half-open `(start, stop)` ranges, one per dimension. A rank's piece of a
training state is a box of the logical tensor, and a transfer is the intersection of a source
box with a destination box; everything the planner does reduces to the four operations here.
"""

from __future__ import annotations

import math
from typing import Optional

Box = tuple[tuple[int, int], ...]


def box_shape(box: Box) -> tuple[int, ...]:
    return tuple(stop - start for start, stop in box)


def numel(box: Box) -> int:
    return math.prod(box_shape(box))


def intersect(a: Box, b: Box) -> Optional[Box]:
    """The common part of two boxes, or None when they do not overlap."""
    common = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b))
    return common if all(start < stop for start, stop in common) else None


def contains(outer: Box, inner: Box) -> bool:
    return all(o0 <= i0 and i1 <= o1 for (o0, o1), (i0, i1) in zip(outer, inner))


def subtract(a: Box, b: Box) -> list[Box]:
    """`a` minus `b` as at most 2·ndim disjoint boxes: peel off, one dimension at a time, the
    slabs of `a` below and above `b`, then narrow that dimension to the overlap."""
    common = intersect(a, b)
    if common is None:
        return [a]
    rest, out = list(a), []
    for d, (lo, hi) in enumerate(common):
        if rest[d][0] < lo:
            out.append(tuple(rest[:d] + [(rest[d][0], lo)] + rest[d + 1 :]))
        if hi < rest[d][1]:
            out.append(tuple(rest[:d] + [(hi, rest[d][1])] + rest[d + 1 :]))
        rest[d] = (lo, hi)
    return out


def flat_range_boxes(box: Box, start: int, stop: int) -> list[tuple[Box, int]]:
    """The elements at row-major positions [start, stop) of `box`, as sub-boxes that are each
    contiguous in row-major order, with the position of each one's first element.

    A distributed-optimizer shard is a flat range of a parameter's TP shard; this turns it back
    into at most 2·ndim−1 boxes: a partial leading run, a full middle slab and a partial
    trailing run, recursively per dimension.
    """
    corner = tuple(lo for lo, _ in box)
    return [
        (tuple((c + lo, c + hi) for c, (lo, hi) in zip(corner, sub)), pos)
        for sub, pos in _runs(box_shape(box), start, stop)
    ]


def _runs(shape: tuple[int, ...], start: int, stop: int) -> list[tuple[Box, int]]:
    if start >= stop:
        return []
    if not shape:
        return [((), 0)]
    inner = math.prod(shape[1:])
    full_rest = tuple((0, n) for n in shape[1:])
    first, head = divmod(start, inner)
    last, tail = divmod(stop, inner)
    if first == last:  # inside one slice of the leading dimension
        return _in_slice(first, inner, _runs(shape[1:], head, tail))
    out = []
    if head:
        out += _in_slice(first, inner, _runs(shape[1:], head, inner))
        first += 1
    if first < last:
        out.append((((first, last),) + full_rest, first * inner))
    if tail:
        out += _in_slice(last, inner, _runs(shape[1:], 0, tail))
    return out


def _in_slice(index: int, inner: int, runs: list[tuple[Box, int]]) -> list[tuple[Box, int]]:
    return [(((index, index + 1),) + sub, index * inner + pos) for sub, pos in runs]
