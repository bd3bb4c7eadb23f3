"""Box geometry of the reshard planner, checked element by element on small tensors."""

from __future__ import annotations

import itertools

import pytest
import torch

from megatron_ext.reshard.boxes import (
    box_shape,
    contains,
    flat_range_boxes,
    intersect,
    numel,
    subtract,
)


def mark(shape, boxes) -> torch.Tensor:
    counts = torch.zeros(shape, dtype=torch.int32)
    for box in boxes:
        counts[tuple(slice(a, b) for a, b in box)] += 1
    return counts


def test_intersect_and_contains():
    a, b = ((0, 4), (2, 6)), ((3, 8), (0, 3))
    assert intersect(a, b) == ((3, 4), (2, 3))
    assert intersect(a, ((4, 5), (0, 9))) is None  # touching is not overlapping
    assert contains(a, ((1, 3), (2, 6))) and not contains(a, b)
    assert numel(a) == 16 and box_shape(a) == (4, 4)


@pytest.mark.parametrize(
    "b", [((1, 3), (2, 5)), ((0, 6), (0, 6)), ((5, 9), (1, 2)), ((7, 9), (7, 9))]
)
def test_subtract_leaves_exactly_the_rest(b):
    a = ((0, 6), (1, 6))
    rest = subtract(a, b)
    expected = mark((10, 10), [a]) - mark((10, 10), [intersect(a, b)] if intersect(a, b) else [])
    assert torch.equal(mark((10, 10), rest), expected)  # disjoint, and nothing of b


@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 4)])
def test_flat_range_boxes_are_contiguous_and_exact(shape):
    offsets = tuple(range(1, len(shape) + 1))
    box = tuple((o, o + n) for o, n in zip(offsets, shape))
    total = numel(box)
    positions = torch.arange(total).view(shape)  # row-major position of each element of box
    for start, stop in itertools.combinations(range(total + 1), 2):
        pieces = flat_range_boxes(box, start, stop)
        assert len(pieces) <= 2 * len(shape) - 1
        covered = []
        for sub, pos in pieces:
            assert contains(box, sub)
            run = positions[tuple(slice(a - o, b - o) for (a, b), o in zip(sub, offsets))].flatten()
            assert torch.equal(run, torch.arange(pos, pos + numel(sub)))  # contiguous, at pos
            covered += run.tolist()
        assert sorted(covered) == list(range(start, stop))
    assert flat_range_boxes(box, 3, 3) == []
