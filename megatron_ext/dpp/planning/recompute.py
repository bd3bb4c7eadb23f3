"""Stage-aware, chunk-level activation recomputation (the paper's checkpointing: InfiniPipe §III-C3, Eq. 20).

c(p, k), the layers of chunk k recomputed on stage p, is an integer in 0..L_p. Recomputing on one
stage delays the stages after it by the same amount, so chunks on one diagonal of the backward
order share a value: the chunk at backward position k on stage p uses C[k + pp - 1 - p]
(n + pp - 1 integers instead of n * pp). Minimise the recompute time on the critical path,
sum_j C_j * (largest per-layer forward time on diagonal j), such that on every stage, after every
forward and during every backward, the saved bytes of the chunks in flight fit the budget left
after the model states. Activation bytes are linear in c; a backward's transient (the
attention's, dK/dV handed between slices, a recomputed layer re-saved) is bounded by its most
over c < L, a constant, plus what recomputing every layer of the stage adds (the top layer
re-saved), switched on by a binary z_j >= C_j - (L - 1).
Solved with scipy's HiGHS MILP.

The diagonal sharing prices recompute well when every stage is equally loaded, but it also makes
a stage recompute what only an earlier stage (more chunks in flight) needs; on the last stage,
which also runs the output layer, that lands on the critical path. `trim` then lowers each
(stage, chunk) count to the least its own stage's memory needs, never raising any count, so no
op gets longer and no stage goes over its budget.
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass
from typing import Literal, Sequence

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_matrix

from megatron_ext.dpp.planning.costmodel import CostModel
from megatron_ext.dpp.planning.plan import Chunk, Group
from megatron_ext.dpp.planning.simulate import hand_down

Mode = Literal["ilp", "none", "full"]


class BudgetTooSmall(ValueError):
    def __init__(self, budget_bytes: float, min_budget_bytes: float, what: str = "this batch") -> None:
        self.budget_bytes, self.min_budget_bytes = budget_bytes, min_budget_bytes
        super().__init__(
            f"dpp: memory budget {budget_bytes / 2**30:.3f} GiB per stage is too small for any plan of {what}; "
            f"the minimum feasible budget is {min_budget_bytes / 2**30:.3f} GiB ({math.ceil(min_budget_bytes)} bytes)"
        )


@dataclass(frozen=True)
class RecomputePlan:
    recompute: dict[tuple[int, int], int]  # (stage, chunk) -> layers recomputed
    cost_s: float  # recompute time on the critical path (sum over diagonals)
    solve_s: float  # CPU seconds
    min_budget_bytes: float  # with every layer recomputed: no group plan needs less


@dataclass(frozen=True)
class _Problem:
    var: dict[tuple[int, int], int]  # (stage, chunk) -> diagonal index
    upper: np.ndarray  # per diagonal
    weight: np.ndarray  # per diagonal, seconds per recomputed layer
    rows: list[tuple[int, float, list[tuple[int, float]], list[tuple[int, float]]]]  # (stage, const, C terms, z terms)
    room: np.ndarray  # per stage: budget minus model states


@functools.lru_cache(maxsize=4096)
def _transients(cost: CostModel, chunk: Chunk, seq_lengths: tuple[int, ...], layers: int, last: bool) -> tuple[float, ...]:
    """The backward transient of `chunk` for every recompute count 0..layers (the grouping DP
    solves many ranges of the same chunks)."""
    return tuple(cost.backward_transient_bytes(chunk, seq_lengths, layers, r, last) for r in range(layers + 1))


def _problem(group: Group, chunks: Sequence[Chunk], seq_lengths: Sequence[int], cost: CostModel,
             layers: Sequence[int], budget_bytes: float) -> _Problem:
    pp = len(group.ops)
    bwd = [o.chunk for o in group.ops[0] if o.kind == "B"]
    bidx = {c: k for k, c in enumerate(bwd)}
    n_var = len(bwd) + pp - 1
    var = {(p, c): bidx[c] + pp - 1 - p for p in range(pp) for c in bwd}
    upper = np.full(n_var, np.inf)
    weight = np.zeros(n_var)
    for (p, c), j in var.items():
        upper[j] = min(upper[j], layers[p])
        weight[j] = max(weight[j], cost.layer_forward_s(chunks[c]))
    upper[upper == np.inf] = 0
    rows = []
    bytes_of: dict[tuple[int, bool, int], tuple[float, float]] = {}
    for p, ops in enumerate(group.ops):
        last = p == pp - 1
        live: dict[int, tuple[float, float]] = {}
        handed: dict[int, float] = {}  # dK/dV held between slices: no recompute changes it
        for o in ops:
            c = chunks[o.chunk]
            if o.kind == "F":
                key = (layers[p], last, o.chunk)
                if key not in bytes_of:
                    full = cost.activation_bytes(c, seq_lengths, layers[p], 0, last)
                    bytes_of[key] = (full, full - cost.activation_bytes(c, seq_lengths, layers[p], 1, last))
                live[o.chunk] = bytes_of[key]
                # No row here: the next op's row (a forward adds to this set, a backward keeps
                # it) dominates it, and every op list ends with a backward.
            else:
                j = var[(p, o.chunk)]
                # The backward's transient: its most over the counts below L as a constant, and
                # what recomputing every layer (z_j) adds to that.
                extra = _transients(cost, c, tuple(seq_lengths), layers[p], last)
                whole = layers[p] == upper[j]
                base = max(extra[: int(upper[j]) + (0 if whole else 1)])
                transient = [(j, extra[-1] - base)] if whole and extra[-1] > base else []
                rows.append((p, sum(a for a, _ in live.values()) + sum(handed.values()) + base,
                             [(var[(p, k)], -d) for k, (_, d) in live.items()], transient))
                del live[o.chunk]
                hand_down(handed, c, cost, layers[p])
    room = np.array([budget_bytes - cost.model_state_bytes(layers[p], p == 0, p == pp - 1) for p in range(pp)])
    return _Problem(var, upper, weight, rows, room)


def _fits(prob: _Problem, C: np.ndarray) -> bool:
    z = ((C >= prob.upper) & (prob.upper > 0)).astype(float)
    return all(const + sum(a * C[j] for j, a in ct) + sum(a * z[j] for j, a in zt) <= prob.room[p] * (1 + 1e-12)
               for p, const, ct, zt in prob.rows)


def _min_budget(prob: _Problem, budget_bytes: float) -> float:
    worst = np.zeros(len(prob.room))
    for p, const, ct, zt in prob.rows:
        worst[p] = max(worst[p], const + sum(a * prob.upper[j] for j, a in ct) + sum(a for j, a in zt if prob.upper[j] > 0))
    return float(np.max(worst + (budget_bytes - prob.room)))


def solve(group: Group, chunks: Sequence[Chunk], seq_lengths: Sequence[int], cost: CostModel,
          layers: Sequence[int], budget_bytes: float, mode: Mode = "ilp", mip_rel_gap: float = 0.02,
          time_limit_s: float = 2.0, relax: bool = False) -> RecomputePlan | None:
    """Recompute counts of one 1F1B group, or None if no choice fits the budget. Past
    `time_limit_s` the best integer solution found so far is used. `relax` solves the LP
    relaxation instead: its cost is a lower bound, for comparing groupings cheaply; its
    recompute counts are not a plan."""
    t = time.process_time()
    prob = _problem(group, chunks, seq_lengths, cost, layers, budget_bytes)
    n = len(prob.upper)
    min_budget = _min_budget(prob, budget_bytes)

    def done(C: np.ndarray) -> RecomputePlan:
        rec = {k: int(C[j]) for k, j in prob.var.items()}
        return RecomputePlan(rec, float(prob.weight @ C), time.process_time() - t, min_budget)

    zero, full = np.zeros(n), prob.upper.copy()
    if mode == "full":
        return done(full) if _fits(prob, full) else None
    if _fits(prob, zero):
        return done(zero)
    if mode == "none" or not _fits(prob, full):
        return None
    # Variables [C_0..C_{n-1}, z_0..z_{n-1}].
    r, c, v, ub = [], [], [], []
    for i, (p, const, ct, zt) in enumerate(prob.rows):
        for j, a in ct:
            r.append(i), c.append(j), v.append(a)
        for j, a in zt:
            r.append(i), c.append(n + j), v.append(a)
        ub.append(prob.room[p] - const)
    m = len(prob.rows)
    for j in range(n):  # C_j - z_j <= L - 1: recomputing every layer switches the transient on
        r += [m + j, m + j]
        c += [j, n + j]
        v += [1.0, -1.0]
        ub.append(float(prob.upper[j]) - 1.0)
    A = coo_matrix((v, (r, c)), shape=(m + n, 2 * n)).tocsr()
    # Scale rows to O(1) (bytes are ~1e10) so HiGHS's feasibility tolerance means the same thing.
    scale = np.maximum(1.0, np.abs(A).max(axis=1).toarray().ravel())
    A = coo_matrix(A.multiply(1.0 / scale[:, None])).tocsr()
    ub = np.array(ub) / scale
    def run(integer: bool):
        return milp(
            c=np.concatenate([prob.weight, np.zeros(n)]),
            constraints=LinearConstraint(A, -np.inf, ub),
            integrality=np.ones(2 * n) if integer else np.zeros(2 * n),
            bounds=Bounds(np.zeros(2 * n), np.concatenate([prob.upper, np.ones(n)])),
            options={"mip_rel_gap": mip_rel_gap, "time_limit": time_limit_s},
        ).x

    x = run(integer=not relax)
    if relax:
        return None if x is None else RecomputePlan({}, float(prob.weight @ x[:n]), time.process_time() - t, min_budget)
    if x is None:  # no integer solution within the time limit: round the relaxation up
        x = run(integer=False)
        x = full if x is None else np.ceil(x[:n] - 1e-9)
    C = np.rint(x[:n])
    # A rounding or tolerance slip must never yield an over-budget plan: repair upward.
    for j in np.argsort(-prob.weight):
        if _fits(prob, C):
            break
        C[j] = prob.upper[j]
    return done(C) if _fits(prob, C) else done(full)


def trim(group: Group, chunks: Sequence[Chunk], seq_lengths: Sequence[int], cost: CostModel, layers: Sequence[int],
         budget_bytes: float, recompute: dict[tuple[int, int], int]) -> dict[tuple[int, int], int]:
    """`recompute` (a choice that fits the budget) with every count lowered as far as its
    stage's memory allows, the slowest chunks first (their recompute costs the most)."""
    prob = _problem(group, chunks, seq_lengths, cost, layers, budget_bytes)
    n = len(prob.upper)
    out = dict(recompute)
    for p in range(len(group.ops)):
        # This stage's rows as matrices over the diagonal indices (one chunk per diagonal here).
        rows = [(const, ct, zt) for q, const, ct, zt in prob.rows if q == p]
        const, per_layer, transient = np.zeros(len(rows)), np.zeros((len(rows), n)), np.zeros((len(rows), n))
        for r, (b, ct, zt) in enumerate(rows):
            const[r] = b
            for j, a in ct:
                per_layer[r, j] += a
            for j, a in zt:
                transient[r, j] += a
        chunk_of = {j: c for (q, c), j in prob.var.items() if q == p}
        x = np.zeros(n)
        for j, c in chunk_of.items():
            x[j] = out[(p, c)]

        def fits() -> bool:  # called within this stage's iteration only
            used = const + per_layer @ x + transient @ (x == layers[p])  # noqa: B023
            return bool(np.all(used <= prob.room[p] * (1 + 1e-12)))  # noqa: B023

        order = sorted(chunk_of, key=lambda j: -cost.layer_forward_s(chunks[chunk_of[j]]))
        changed = True
        while changed:  # until no count can drop (leaving a full recompute frees its transient)
            changed = False
            for j in order:
                current = x[j]
                for lower in range(int(current)):  # the least count that keeps every row in budget
                    x[j] = lower
                    if fits():
                        changed = True
                        break
                    x[j] = current
        for j, c in chunk_of.items():
            out[(p, c)] = int(x[j])
    return out
