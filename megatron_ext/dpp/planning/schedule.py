"""Plan-driven non-interleaved 1F1B over chunks of unequal size (InfiniPipe §III-C1/C2).

A unit is a set of chunks chained by sequences they share (the slices of one long sequence,
its hybrid tail included; a packed chunk alone). Units run longest first (most chunks), so the
steady phase always has a backward available. A unit's chunks run forward in order and backward
in reverse (a slice's dK/dV flows to the earlier slices it attended to).

Every stage runs the forwards in the SAME chunk order and the backwards in the same order. Stage
p runs its i-th backward after `need_i + (pp - 1 - p)` forwards (capped at the chunk count),
need_i the running maximum over j <= i of `max(dep_j, j + depth_j)`: dep_j is the number of
forwards the j-th backward depends on (all slices of its sequence), and depth_j, the longest
unit at or after backward j, keeps that many chunks in flight on the last stage, so a stage
never drains while a long sequence's slices are waiting. Once the long units are done, depth
falls and the short chunks run with plain 1F1B's in-flight count (with units of one chunk this
is plain 1F1B). The forward count before the i-th backward never decreases with i nor grows
with p, and covers that backward's chunk, so both sides of every transfer meet in the same
order and the pipeline cannot deadlock (the simulator checks it).
"""

from __future__ import annotations

import math
import operator
from typing import Callable, Mapping, Sequence

from megatron_ext.dpp.planning.plan import Chunk, Group, Op


def units(chunks: Sequence[Chunk]) -> list[tuple[int, ...]]:
    """Chunk ids grouped by shared sequences, each unit in id order, units by first id."""
    parent = {c.id: c.id for c in chunks}

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    owner: dict[int, int] = {}
    for c in chunks:
        for s in c.segments:
            if s.seq in owner:
                parent[root(c.id)] = root(owner[s.seq])
            else:
                owner[s.seq] = c.id
    members: dict[int, list[int]] = {}
    for c in chunks:
        members.setdefault(root(c.id), []).append(c.id)
    return sorted((tuple(sorted(m)) for m in members.values()), key=lambda u: u[0])


def longest_first(unit_list: Sequence[tuple[int, ...]], chunk_time: Callable[[int], float]) -> list[tuple[int, ...]]:
    return sorted(unit_list, key=lambda u: (-len(u), -sum(chunk_time(c) for c in u), u[0]))


def backward_order(unit_list: Sequence[tuple[int, ...]]) -> list[int]:
    return [c for u in unit_list for c in reversed(u)]


def one_f_one_b(
    unit_list: Sequence[tuple[int, ...]],
    pp: int,
    recompute: Mapping[tuple[int, int], int] | None = None,
) -> Group:
    """Per-stage op lists of one 1F1B group over `unit_list` (already in run order);
    `recompute[(stage, chunk)]` is stored on the forward ops."""
    recompute = recompute or {}
    fwd = [c for u in unit_list for c in u]
    bwd = backward_order(unit_list)
    fpos = {c: i for i, c in enumerate(fwd)}
    need, most = [], 0
    for i, (c, depth) in enumerate(zip(bwd, _depths(unit_list))):
        most = max(most, fpos[c] + 1, i + depth)
        need.append(most)
    stages = []
    for p in range(pp):
        ops, done = [], 0
        for i, c in enumerate(bwd):
            while done < min(len(fwd), need[i] + pp - 1 - p):
                ops.append(Op("F", fwd[done], recompute.get((p, fwd[done]), 0)))
                done += 1
            ops.append(Op("B", c))
        stages.append(tuple(ops))
    return Group(tuple(stages))


def _depths(unit_list: Sequence[tuple[int, ...]]) -> list[int]:
    """Per backward position, the longest unit at or after it: the lead of forwards over
    backwards that lets every later unit be fully forwarded before its first backward without
    the pipeline refilling. Longest first, it shrinks as the long units finish, so short
    chunks run with plain 1F1B's in-flight count instead of the longest unit's."""
    depths, longest = [], 1
    for u in reversed(unit_list):
        longest = max(longest, len(u))
        depths += [longest] * len(u)
    return depths[::-1]


def with_recompute(group: Group, recompute: Mapping[tuple[int, int], int]) -> Group:
    return Group(tuple(
        tuple(Op(o.kind, o.chunk, recompute.get((p, o.chunk), 0)) if o.kind == "F" else o for o in ops)
        for p, ops in enumerate(group.ops)
    ))


def group_dp(n_classes: int, cost: Callable[[int, int], float], max_groups: int | None = None,
             combine: Callable[[float, float], float] = operator.add) -> tuple[float, list[tuple[int, int]]]:
    """Cut classes 0..n-1 into contiguous ranges [i, j), one 1F1B group each, minimising the
    sum of `cost(i, j)` (math.inf when a range cannot run) with at most `max_groups` ranges
    (the paper's Eq. 14); `combine=max` minimises the largest range cost instead (costs must
    be non-negative). Returns (total cost, ranges)."""
    g_max = n_classes if max_groups is None else min(max_groups, n_classes)
    best = [[math.inf] * (n_classes + 1) for _ in range(g_max + 1)]
    back = [[-1] * (n_classes + 1) for _ in range(g_max + 1)]
    best[0][0] = 0.0
    for g in range(1, g_max + 1):
        # The last level only has to reach the end; it spares the cost calls of other ranges.
        for j in range(1, n_classes + 1) if g < g_max else [n_classes]:
            for i in range(j):
                if best[g - 1][i] == math.inf:
                    continue
                total = combine(best[g - 1][i], cost(i, j))
                if total < best[g][j]:
                    best[g][j], back[g][j] = total, i
    g = min(range(1, g_max + 1), key=lambda g: best[g][n_classes]) if n_classes else 0
    if not n_classes or best[g][n_classes] == math.inf:
        return math.inf, []
    ranges, j = [], n_classes
    for gg in range(g, 0, -1):
        i = back[gg][j]
        ranges.append((i, j))
        j = i
    return best[g][n_classes], ranges[::-1]
