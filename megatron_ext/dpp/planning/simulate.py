"""Discrete-event execution of a StepPlan under a cost model.

Each stage runs its ops in plan order; a forward waits for the previous stage's forward of the
chunk (plus the p2p time), a backward for the next stage's backward. Memory is counted per stage
by replaying the ops with the cost model's per-chunk bytes (`StageMemory`): this is independent
of the checkpointing ILP's own (diagonal, matrix) accounting, so it checks the ILP's claims.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from megatron_ext.dpp.planning.costmodel import CostModel, stage_layers
from megatron_ext.dpp.planning.plan import Chunk, StepPlan


class PlanError(ValueError):
    """A plan that breaks a dependency rule (coverage, order, recompute range)."""


class Deadlock(RuntimeError):
    """No stage can run its next op."""


@dataclass(frozen=True)
class Event:
    stage: int
    kind: str  # "F" | "B"
    chunk: int
    group: int
    start: float
    end: float
    recompute_s: float = 0.0


@dataclass(frozen=True)
class SimResult:
    iter_s: float
    bubble_ratio: float
    recompute_fraction: float
    peak_bytes: tuple[float, ...]  # per stage, model states included
    state_bytes: tuple[float, ...]
    budget_bytes: float | None
    events: tuple[Event, ...]
    memory: tuple[tuple[tuple[float, float], ...], ...]  # per stage: (time, bytes) steps

    @property
    def oom(self) -> tuple[bool, ...]:
        return tuple(self.budget_bytes is not None and m > self.budget_bytes for m in self.peak_bytes)

    @property
    def peak_act_bytes(self) -> tuple[float, ...]:
        return tuple(m - s for m, s in zip(self.peak_bytes, self.state_bytes))


def hand_down(handed: dict[int, float], chunk: Chunk, cost: CostModel, layers: int) -> float:
    """Update `handed` (sequence -> dK/dV bytes held for its earlier slices) for the backward of
    `chunk`: a segment takes what later slices handed it and hands its own prefix's down.
    Returns the change in bytes held."""
    change = 0.0
    for s in chunk.segments:
        change -= handed.pop(s.seq, 0.0)
        if s.prefix:
            handed[s.seq] = cost.handed_grad_bytes(s.prefix, layers)
            change += handed[s.seq]
    return change


class StageMemory:
    """Activation bytes of one stage as its ops run in order: what each chunk keeps between its
    forward and backward, the dK/dV handed between slices, and the peak with the transients of
    backward. Bytes start at `start` (the model states)."""

    def __init__(self, plan: StepPlan, cost: CostModel, layers: int, last: bool, start: float = 0.0) -> None:
        self.plan, self.cost, self.layers, self.last = plan, cost, layers, last
        self.bytes = self.peak = start
        self._live: dict[int, float] = {}
        self._recompute: dict[int, int] = {}
        self._handed: dict[int, float] = {}

    def forward(self, chunk: int, recompute: int) -> float:
        """Run a forward; returns the bytes held after it."""
        c = self.plan.chunks[chunk]
        self._recompute[chunk] = recompute
        self._live[chunk] = self.cost.activation_bytes(c, self.plan.seq_lengths, self.layers, recompute, self.last)
        self.bytes += self._live[chunk]
        self.peak = max(self.peak, self.bytes)
        return self.bytes

    def backward(self, chunk: int) -> float:
        """Run a backward; returns the bytes held at its peak (`self.bytes` is what is left)."""
        c = self.plan.chunks[chunk]
        during = self.bytes + self.cost.backward_transient_bytes(c, self.plan.seq_lengths, self.layers, self._recompute.pop(chunk), self.last)
        self.bytes += hand_down(self._handed, c, self.cost, self.layers) - self._live.pop(chunk)
        self.peak = max(self.peak, during, self.bytes)
        return during


def check_plan(plan: StepPlan, layers: Sequence[int]) -> None:
    """Raise PlanError unless the plan covers every token once and runs in a valid order."""
    if any(c.id != i for i, c in enumerate(plan.chunks)):
        raise PlanError("chunk ids must equal their positions")
    cover: dict[int, list[tuple[int, int]]] = {}
    for c in plan.chunks:
        for s in c.segments:
            cover.setdefault(s.seq, []).append((s.start, s.length))
    for seq, n in enumerate(plan.seq_lengths):
        pieces = sorted(cover.get(seq, []))
        ends = [0] + [a + b for a, b in pieces]
        if [a for a, _ in pieces] != ends[:-1] or ends[-1] != n or any(b <= 0 for _, b in pieces):
            raise PlanError(f"sequence {seq} (length {n}) is not covered exactly once: {pieces}")
    pieces_of: dict[int, list[tuple[int, int]]] = {}
    for c in plan.chunks:
        for s in c.segments:
            pieces_of.setdefault(s.seq, []).append((c.id, s.start))
    if len(plan.groups) == 0 or any(len(g.ops) != plan.pp for g in plan.groups):
        raise PlanError("every group needs one op list per stage")
    orders = set()
    for p in range(plan.pp):
        ops = [o for g in plan.groups for o in g.ops[p]]
        f = [o.chunk for o in ops if o.kind == "F"]
        b = [o.chunk for o in ops if o.kind == "B"]
        if sorted(f) != list(range(len(plan.chunks))) or sorted(b) != sorted(f):
            raise PlanError(f"stage {p}: every chunk needs one forward and one backward")
        orders.add((tuple(f), tuple(b)))
        done_f = set()
        for o in ops:
            if o.kind == "F":
                if not 0 <= o.recompute <= layers[p]:
                    raise PlanError(f"stage {p}: recompute {o.recompute} of chunk {o.chunk} outside 0..{layers[p]}")
                done_f.add(o.chunk)
            elif o.chunk not in done_f:
                raise PlanError(f"stage {p}: backward of chunk {o.chunk} before its forward")
        fpos = {o.chunk: i for i, o in enumerate(ops) if o.kind == "F"}
        bpos = {o.chunk: i for i, o in enumerate(ops) if o.kind == "B"}
        for seq, owners in pieces_of.items():
            by_f = [start for _, start in sorted(owners, key=lambda x: fpos[x[0]])]
            by_b = [start for _, start in sorted(owners, key=lambda x: bpos[x[0]])]
            if by_f != sorted(by_f) or by_b != sorted(by_b, reverse=True):
                raise PlanError(f"stage {p}: slices of sequence {seq} must run forward in order, backward in reverse")
            # Every slice's backward needs the last slice forwarded (it attended to them all).
            last_f = max(fpos[c] for c, _ in owners)
            if any(bpos[c] < last_f for c, _ in owners):
                raise PlanError(f"stage {p}: a backward of sequence {seq} runs before its last slice's forward")
    if len(orders) != 1:
        raise PlanError("every stage must run forwards in the same chunk order, and backwards too")


def simulate(plan: StepPlan, cost: CostModel, layers: Sequence[int] | None = None, budget_bytes: float | None = None,
             check: bool = True) -> SimResult:
    """Run `plan` under the cost model `cost`, event by event: each stage executes its ops in
    plan order, a forward waiting for the previous stage's forward of the chunk (plus the p2p
    time) and a backward for the next stage's backward. Returns the step's time, bubble and
    recompute shares, and each stage's memory over time and peak (against `budget_bytes` when
    given). `check` first verifies the plan (`check_plan`: every token covered once, a valid
    order)."""
    layers = tuple(layers or stage_layers(cost.num_layers, plan.pp))
    if check:
        check_plan(plan, layers)
    pp, last = plan.pp, plan.pp - 1
    chunks = plan.chunks
    ops = [[(g, o) for g, grp in enumerate(plan.groups) for o in grp.ops[p]] for p in range(pp)]
    state = tuple(cost.model_state_bytes(layers[p], p == 0, p == last) for p in range(pp))
    end: dict[tuple[str, int, int], float] = {}
    rec: dict[tuple[int, int], int] = {}
    free, nxt = [0.0] * pp, [0] * pp
    stages = [StageMemory(plan, cost, layers[p], p == last, state[p]) for p in range(pp)]
    memory = [[(0.0, state[p])] for p in range(pp)]
    events, busy, recompute_s = [], 0.0, 0.0
    remaining = sum(len(o) for o in ops)
    while remaining:
        progressed = False
        for p in range(pp):
            while nxt[p] < len(ops[p]):
                g, o = ops[p][nxt[p]]
                c = chunks[o.chunk]
                if o.kind == "F":
                    dep = 0.0 if p == 0 else end.get(("F", o.chunk, p - 1))
                    hop = 0.0 if p == 0 else cost.p2p_s(c)
                else:
                    dep = end.get(("F", o.chunk, p)) if p == last else end.get(("B", o.chunk, p + 1))
                    hop = 0.0 if p == last else cost.p2p_s(c)
                if dep is None:
                    break
                start = max(free[p], dep + hop)
                if o.kind == "F":
                    dur, r_s = cost.forward_s(c, layers[p], p == last), 0.0
                    rec[(p, o.chunk)] = o.recompute
                    memory[p].append((start + dur, stages[p].forward(o.chunk, o.recompute)))
                else:
                    r = rec[(p, o.chunk)]
                    dur = cost.backward_s(c, layers[p], r, p == last)
                    r_s = r * cost.layer_forward_s(c) * cost.runtime_scale("B", c.tokens)
                    memory[p].append((start, stages[p].backward(o.chunk)))
                    memory[p].append((start + dur, stages[p].bytes))
                end[(o.kind, o.chunk, p)] = free[p] = start + dur
                events.append(Event(p, o.kind, o.chunk, g, start, start + dur, r_s))
                busy += dur
                recompute_s += r_s
                nxt[p] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {p: ops[p][nxt[p]][1] for p in range(pp) if nxt[p] < len(ops[p])}
            raise Deadlock(f"no stage can proceed; next ops: {stuck}")
    span = max(free)
    return SimResult(
        # The step's fixed work (gradient finalisation) follows the schedule; the bubble ratio
        # is the schedule's own.
        iter_s=span + cost.step_fixed_s,
        bubble_ratio=1.0 - busy / (pp * span) if span > 0 else 0.0,
        recompute_fraction=recompute_s / busy if busy > 0 else 0.0,
        peak_bytes=tuple(m.peak for m in stages),
        state_bytes=state,
        budget_bytes=budget_bytes,
        events=tuple(events),
        memory=tuple(tuple(m) for m in memory),
    )


def memory_peaks(plan: StepPlan, cost: CostModel, layers: Sequence[int] | None = None) -> tuple[float, ...]:
    """Per-stage peak bytes (states included) from op order alone; timing does not matter."""
    layers = tuple(layers or stage_layers(cost.num_layers, plan.pp))
    last, peaks = plan.pp - 1, []
    for p in range(plan.pp):
        stage = StageMemory(plan, cost, layers[p], p == last, cost.model_state_bytes(layers[p], p == 0, p == last))
        for g in plan.groups:
            for o in g.ops[p]:
                if o.kind == "F":
                    stage.forward(o.chunk, o.recompute)
                else:
                    stage.backward(o.chunk)
        peaks.append(stage.peak)
    return tuple(peaks)
