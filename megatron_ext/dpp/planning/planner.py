"""Step planners: DPP (chunking + longest-first 1F1B + grouping DP + checkpointing ILP, its
counts trimmed to what each stage needs, with the slice number K searched per batch) and the
static baselines it is compared with, all producing StepPlans that the simulator and the
runtime execute.

Policies:
- `packed`: whole sequences packed first-fit-decreasing to the context length, FIFO 1F1B, one
  uniform recompute count chosen offline to fit the worst case (full-context micro-batches).
- `split`: Seq1F1B-like static token split: the packed micro-batches cut into fixed spans of
  context / N tokens (spans of one sequence run as slices), uniform recompute fitting the worst
  case, N tuned offline.
- `chunkflow`: ChunkFlow-like: long sequences cut into chunks of a fixed ChunkSize, short ones
  packed to it; of each sequence's chunks only the last `keep` keep their activations, the others
  recompute every layer. ChunkSize and keep tuned offline.
- `dpp`, and the ablations `dpp_no_balance` (even token mesh, packing to the token target only),
  `dpp_no_ckpt` (no recomputation), `dpp_full_ckpt` (every layer recomputed). DPP searches the
  even mesh beside the balanced one: a balanced mesh's first slice is its largest, and where
  memory binds (the prefix's K/V and dK/dV of a very long sequence) only even slices may fit.
  Where memory splits the step into pipelines anyway (or nothing fits), DPP also plans the
  longest sequence in a pipeline of its own and the rest in another, each on its own mesh, so
  the few large slices the longest may need do not set every other chunk's size.
Static policies are tuned once per (model, context, pp, budget) by `tune_static` on a tuning
batch and then plan each batch with `plan_static`; nothing is re-tuned per batch. Every policy
plans against the budget less the memory model's stated error (`costmodel.usable_budget`).
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Sequence

from megatron_ext.dpp.planning import recompute
from megatron_ext.dpp.planning.chunking import chunk_batch, chunk_on_mesh
from megatron_ext.dpp.planning.costmodel import CostModel, budget_for, stage_layers, usable_budget
from megatron_ext.dpp.planning.plan import Chunk, Group, Segment, StepPlan, padded
from megatron_ext.dpp.planning.recompute import BudgetTooSmall, Mode
from megatron_ext.dpp.planning.schedule import group_dp, longest_first, one_f_one_b, units, with_recompute
from megatron_ext.dpp.planning.simulate import memory_peaks, simulate

# policy -> (the meshes searched: True = equal-time (balanced), False = even; recompute mode)
BOTH_MESHES = (True, False)
BLENDS = (0.75, 0.5, 0.25)  # shares of the equal-time mesh a lone long sequence also tries
DPP_POLICIES = {
    "dpp": (BOTH_MESHES, "ilp"),
    "dpp_no_balance": ((False,), "ilp"),
    "dpp_no_ckpt": (BOTH_MESHES, "none"),
    "dpp_full_ckpt": (BOTH_MESHES, "full"),
}
STATIC_POLICIES = ("packed", "split", "chunkflow")
POLICIES = STATIC_POLICIES + tuple(DPP_POLICIES)
K_CANDIDATES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
MIN_SLICE_TOKENS = 64


@dataclass(frozen=True)
class PlanInfo:
    policy: str
    k: int  # DPP: slice number; static: the tuned parameter (N spans, or ChunkSize)
    groups: int
    predicted_iter_s: float
    peak_bytes: tuple[float, ...]
    planner_s: float
    ckpt_solves: int = 0
    ckpt_solve_s: float = 0.0  # total time in the checkpointing solver
    ckpt_solve_max_s: float = 0.0


def _renumber(chunks: Sequence[Chunk], groups: Sequence[Group], pp: int, seq_lengths: Sequence[int]) -> StepPlan:
    """Give chunks ids in execution (first-stage forward) order."""
    order = [o.chunk for g in groups for o in g.ops[0] if o.kind == "F"]
    new = {old: i for i, old in enumerate(order)}
    out_chunks = tuple(dataclasses.replace(chunks[c], id=new[c]) for c in order)
    out_groups = tuple(
        Group(tuple(tuple(type(o)(o.kind, new[o.chunk], o.recompute) for o in ops) for ops in g.ops)) for g in groups
    )
    return StepPlan(pp, tuple(seq_lengths), out_chunks, out_groups)


def _classes(unit_list: list[tuple[int, ...]]) -> list[list[tuple[int, ...]]]:
    """Runs of units with the same chunk count (units already longest first)."""
    out: list[list[tuple[int, ...]]] = []
    for u in unit_list:
        if out and len(out[-1][0]) == len(u):
            out[-1].append(u)
        else:
            out.append([u])
    return out


@dataclass
class _Stats:
    solves: int = 0
    solve_s: float = 0.0
    solve_max_s: float = 0.0
    # per chunking that fits no budget, a function giving the budget it needs; evaluated only
    # when no chunking fits (it replays memory over every grouping: a third of a search's time)
    needs: list = field(default_factory=list)
    extra: dict = field(default_factory=dict)

    def min_budget(self) -> float:
        return min((need() for need in self.needs), default=math.inf)


def _plan_chunks(chunks: tuple[Chunk, ...], lengths: Sequence[int], cost: CostModel, pp: int, budget: float,
                 layers: Sequence[int], mode: Mode, max_groups: int, gap: float, stats: _Stats) -> StepPlan | None:
    """Group the units of `chunks` into 1F1B pipelines and choose recompute counts (Eq. 14)."""
    unit_list = longest_first(units(chunks), lambda c: cost.layer_forward_s(chunks[c]))
    classes = _classes(unit_list)
    solved: dict[tuple[int, int, bool], tuple[Group, recompute.RecomputePlan | None]] = {}

    def group_of(i: int, j: int, exact: bool = False):
        # The grouping DP compares ranges by the LP relaxation's recompute cost; only the
        # chosen ranges are solved as integer programs.
        if (i, j, exact) not in solved:
            grp = one_f_one_b([u for cl in classes[i:j] for u in cl], pp)
            sol = recompute.solve(grp, chunks, lengths, cost, layers, budget, mode, gap, relax=not exact)
            stats.solves += 1
            if sol is not None:
                stats.solve_s += sol.solve_s
                stats.solve_max_s = max(stats.solve_max_s, sol.solve_s)
            solved[(i, j, exact)] = (grp, sol)
        return solved[(i, j, exact)]

    def cost_of(i: int, j: int) -> float:
        grp, sol = group_of(i, j)
        if sol is None:
            return math.inf
        ids = [c for cl in classes[i:j] for u in cl for c in u]
        per_chunk = [cost.forward_s(chunks[c], max(layers), False) * (1 + cost.bwd_ratio) for c in ids]
        # One warm-up/cool-down per pipeline (the paper's delta) plus the recompute time.
        return (pp - 1) * sum(per_chunk) / len(per_chunk) + sol.cost_s

    total, ranges = group_dp(len(classes), cost_of, max_groups)
    if total == math.inf:
        def need(i: int, j: int) -> float:
            grp = group_of(i, j)[0]
            rec = {(p, c): (layers[p] if mode != "none" else 0) for p in range(pp) for c in range(len(chunks))}
            return max(memory_peaks(StepPlan(pp, tuple(lengths), chunks, (with_recompute(grp, rec),)), cost, layers))
        stats.needs.append(lambda: group_dp(len(classes), need, max_groups, combine=max)[0])
        return None
    groups = []
    for i, j in ranges:
        grp, sol = group_of(i, j, True)
        rec = recompute.trim(grp, chunks, lengths, cost, layers, budget, sol.recompute) if mode == "ilp" else sol.recompute
        groups.append(with_recompute(grp, rec))
    return _renumber(chunks, groups, pp, lengths)


def _search_meshes(lengths, cost, pp, budget, layers, policy, k_candidates, max_groups, gap, stats, multiple,
                   meshes=None) -> tuple[StepPlan | None, int, float]:
    """The fastest plan over the searched meshes (the policy's, or `meshes`: shares of
    `chunking.blended_mesh`) and slice numbers K, chunks padded to `multiple` tokens: (plan,
    K, iteration s)."""
    policy_meshes, mode = DPP_POLICIES[policy]
    meshes = policy_meshes if meshes is None else meshes
    best, best_k, best_time = None, 0, math.inf
    longest = max(lengths)
    # Recompute and extra pipelines only add time, so the plain one-group schedule of a
    # chunking bounds its plan from below: try (mesh, K) in order of that bound and stop at the
    # first whose bound cannot beat the best plan found (branch and bound).
    bounded = []
    for balanced in meshes:
        for k in k_candidates:
            if k > 1 and longest / k < MIN_SLICE_TOKENS:
                break
            chunks = padded(chunk_batch(lengths, cost, k, balanced), multiple)
            order = longest_first(units(chunks), lambda c: cost.layer_forward_s(chunks[c]))  # noqa: B023 (called here)
            bound = simulate(_renumber(chunks, [one_f_one_b(order, pp)], pp, lengths), cost, layers, check=False).iter_s
            bounded.append((bound, k, -float(balanced), chunks))
    for bound, k, _, chunks in sorted(bounded, key=lambda x: x[:3]):
        if bound >= best_time:
            break
        plan = _plan_chunks(chunks, lengths, cost, pp, budget, layers, mode, max_groups, gap, stats)
        if plan is None:
            continue
        t = simulate(plan, cost, layers, check=False).iter_s
        if t < best_time:
            best, best_k, best_time = plan, k, t
    return best, best_k, best_time


def _joined(parts: Sequence[tuple[StepPlan, Sequence[int]]], pp: int, lengths: Sequence[int]) -> StepPlan:
    """Plans of disjoint sub-batches (each with the batch indices of its sequences) run one
    after another as one step plan of the whole batch."""
    chunks: list[Chunk] = []
    groups: list[Group] = []
    for plan, seqs in parts:
        base = len(chunks)
        chunks += [dataclasses.replace(c, id=base + c.id, segments=tuple(Segment(seqs[s.seq], s.start, s.length) for s in c.segments))
                   for c in plan.chunks]
        groups += [Group(tuple(tuple(type(o)(o.kind, base + o.chunk, o.recompute) for o in ops) for ops in g.ops))
                   for g in plan.groups]
    return _renumber(chunks, groups, pp, lengths)


def _plan_dpp(lengths, cost, pp, budget, layers, policy, k_candidates, max_groups, gap, stats, multiple):
    best, best_k, best_time = _search_meshes(lengths, cost, pp, budget, layers, policy, k_candidates, max_groups, gap,
                                             stats, multiple)
    # When memory already splits the step into pipelines (or no plan fits), one mesh for the
    # whole batch is the longest sequence's: few, large slices that it alone may need (its K/V
    # kept for later slices grows with K) also make the rest's chunks large and memory-bound.
    # So also try the longest sequence in a pipeline of its own and the rest in another, each
    # chunked on its own mesh (13B, 128K, PP 4, GitHub-like: 407 s -> 353 s simulated).
    if max_groups > 1 and len(lengths) > 1 and (best is None or len(best.groups) > 1):
        longest = max(range(len(lengths)), key=lambda i: (lengths[i], -i))
        rest = [i for i in range(len(lengths)) if i != longest]
        # The parts' budget needs are not the batch's: a refusal names the one-mesh search's.
        parts = _Stats()
        # One sequence plans fast: also try meshes between the even and the equal-time one
        # (13B, 128K, PP 4: slices of 58% and 42% fit, 167 s against 181 s for even ones).
        meshes = DPP_POLICIES[policy][0]
        blends = tuple(sorted({*meshes, *BLENDS}, reverse=True)) if set(meshes) == {True, False} else meshes
        alone = _search_meshes([lengths[longest]], cost, pp, budget, layers, policy, k_candidates, 1, gap, parts,
                               multiple, blends)
        if alone[0] is not None:
            others = _search_meshes([lengths[i] for i in rest], cost, pp, budget, layers, policy, k_candidates,
                                    max_groups - 1, gap, parts, multiple)
            if others[0] is not None:
                plan = _joined([(alone[0], [longest]), (others[0], rest)], pp, lengths)
                t = simulate(plan, cost, layers, check=False).iter_s
                if t < best_time:
                    best, best_k, best_time = plan, others[1], t
        stats.solves += parts.solves
        stats.solve_s += parts.solve_s
        stats.solve_max_s = max(stats.solve_max_s, parts.solve_max_s)
    stats.extra["k"] = best_k
    return best


def _states(cost: CostModel, layers: Sequence[int]) -> list[float]:
    """Model-state bytes of each stage (the embedding on the first, the output layer on the last)."""
    return [cost.model_state_bytes(n, p == 0, p == len(layers) - 1) for p, n in enumerate(layers)]


def plan_step_info(
    lengths: Sequence[int],
    cost_model: CostModel,
    pp: int,
    budget_bytes: float,
    policy: str = "dpp",
    layers: Sequence[int] | None = None,
    static: "StaticConfig | None" = None,
    k_candidates: Sequence[int] = K_CANDIDATES,
    max_groups: int = 2,
    mip_rel_gap: float = 0.02,
    token_multiple: int = 1,
) -> tuple[StepPlan, PlanInfo]:
    """Plan one global batch with `policy`, every chunk padded to a multiple of
    `token_multiple` tokens (the tensor-parallel size under sequence parallelism; a static
    policy's is its StaticConfig's); raises BudgetTooSmall (naming the minimum feasible
    budget) when no plan of the policy fits `budget_bytes` on every stage."""
    if policy not in POLICIES:
        raise ValueError(f"dpp: unknown policy {policy!r}; known: {POLICIES}")
    if not lengths or min(lengths) < 1:
        raise ValueError("dpp: a batch needs at least one sequence, all of positive length")
    layers = tuple(layers or stage_layers(cost_model.num_layers, pp))
    states = max(_states(cost_model, layers))
    if states >= budget_bytes:
        raise BudgetTooSmall(budget_bytes, states, "the model states alone")
    # CPU time of this process (the solver's threads included): the planner's own cost,
    # whatever else shares the machine.
    t = time.process_time()
    stats = _Stats()
    if policy in DPP_POLICIES:
        usable = usable_budget(budget_bytes, min(_states(cost_model, layers)))
        plan = _plan_dpp(lengths, cost_model, pp, usable, layers, policy, k_candidates, max_groups, mip_rel_gap, stats,
                         token_multiple)
        if plan is None:
            raise BudgetTooSmall(budget_bytes, budget_for(stats.min_budget(), min(_states(cost_model, layers))),
                                 f"this batch ({len(lengths)} sequences, longest {max(lengths)}) with {policy}")
        k = stats.extra["k"]
    else:
        if static is None or static.policy != policy:
            raise ValueError(f"dpp: policy {policy!r} needs its StaticConfig (tune_static)")
        if static.token_multiple != token_multiple:
            raise ValueError(f"dpp: the {policy} configuration pads chunks to {static.token_multiple} tokens, "
                             f"this plan needs {token_multiple}")
        plan, k = plan_static(lengths, static, cost_model, pp), static.param
    planner_s = time.process_time() - t
    sim = simulate(plan, cost_model, layers, budget_bytes)
    info = PlanInfo(policy, k, len(plan.groups), sim.iter_s, sim.peak_bytes, planner_s, stats.solves, stats.solve_s, stats.solve_max_s)
    return plan, info


def plan_step(lengths: Sequence[int], cost_model: CostModel, pp: int, budget_bytes: float, policy: str = "dpp", **kw) -> StepPlan:
    """The plan of one global batch of sequences of `lengths` tokens on a `pp`-stage pipeline
    within `budget_bytes` of memory per stage: its chunks (packed, split and hybrid), their
    order on each stage (1F1B over chunks of unequal size) and the layers each stage recomputes
    for each chunk. `policy` "dpp" is InfiniPipe's planner (balanced chunking, grouping and the
    recompute integer program); the others are the static baselines it is measured against.
    Raises ValueError for an unknown policy or a batch without sequences, and BudgetTooSmall
    (naming the minimum feasible budget) when no plan fits the budget. `plan_step_info` also
    returns the planner's time and the simulated step."""
    return plan_step_info(lengths, cost_model, pp, budget_bytes, policy, **kw)[0]


# --- static baselines -------------------------------------------------------------------------

@dataclass(frozen=True)
class StaticConfig:
    policy: str
    context: int
    param: int  # split: N spans per context; chunkflow: ChunkSize; packed: the context
    recompute: int = 0  # packed / split: layers recomputed on every stage for every chunk
    keep: int = 0  # chunkflow: chunks per sequence that keep their activations
    token_multiple: int = 1  # every chunk padded to a multiple of this many tokens


def pack_ffd(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Sequence ids packed first-fit-decreasing into bins of at most `capacity` tokens."""
    bins: list[list[int]] = []
    room: list[int] = []
    for s in sorted(range(len(lengths)), key=lambda s: (-lengths[s], s)):
        for b in range(len(bins)):
            if room[b] >= lengths[s]:
                bins[b].append(s)
                room[b] -= lengths[s]
                break
        else:
            bins.append([s])
            room.append(capacity - lengths[s])
    return bins


def _spans(lengths: Sequence[int], bin_seqs: list[int], span: int) -> list[tuple[Segment, ...]]:
    """Cut the token stream of one packed micro-batch into spans of `span` tokens."""
    out, cur, room = [], [], span
    for s in bin_seqs:
        start = 0
        while start < lengths[s]:
            take = min(room, lengths[s] - start)
            cur.append(Segment(s, start, take))
            start += take
            room -= take
            if room == 0:
                out.append(tuple(cur))
                cur, room = [], span
    if cur:
        out.append(tuple(cur))
    return out


def _kind(segs: tuple[Segment, ...], lengths: Sequence[int]) -> str:
    partial = [s for s in segs if s.start > 0 or s.length < lengths[s.seq]]
    return "packed" if not partial else ("split" if len(segs) == 1 else "hybrid")


def _static_chunks(lengths: Sequence[int], cfg: StaticConfig, cost: CostModel) -> tuple[Chunk, ...]:
    if cfg.policy == "chunkflow":
        mesh = list(range(0, max(lengths), cfg.param)) + [max(lengths)]
        return padded(chunk_on_mesh(lengths, cost, mesh, math.inf), cfg.token_multiple)
    span = cfg.context if cfg.policy == "packed" else math.ceil(cfg.context / cfg.param)
    segs = [sp for b in pack_ffd(lengths, cfg.context) for sp in _spans(lengths, b, span)]
    return padded(tuple(Chunk(i, _kind(s, lengths), s) for i, s in enumerate(segs)), cfg.token_multiple)


def plan_static(lengths: Sequence[int], cfg: StaticConfig, cost: CostModel, pp: int, layers: Sequence[int] | None = None) -> StepPlan:
    layers = tuple(layers or stage_layers(cost.num_layers, pp))
    lengths = [min(n, cfg.context) for n in lengths]
    chunks = _static_chunks(lengths, cfg, cost)
    unit_list = units(chunks)  # data order: static schedules do not reorder
    if cfg.policy == "chunkflow":
        rec = {(p, c): layers[p] for u in unit_list for c in u[: max(0, len(u) - cfg.keep)] for p in range(pp)}
    else:
        rec = {(p, c.id): min(cfg.recompute, layers[p]) for c in chunks for p in range(pp)}
    return _renumber(chunks, [one_f_one_b(unit_list, pp, rec)], pp, lengths)


def _static_candidates(policy: str, context: int, num_layers: int, pp: int, multiple: int) -> list[StaticConfig]:
    per_stage = num_layers // pp
    spans = [n for n in (1, 2, 4, 8, 16, 32, 64) if context // n >= MIN_SLICE_TOKENS]
    if policy == "packed":
        return [StaticConfig("packed", context, context, c, token_multiple=multiple) for c in range(per_stage + 1)]
    if policy == "split":
        return [StaticConfig("split", context, n, c, token_multiple=multiple) for n in spans for c in range(per_stage + 1)]
    return [StaticConfig("chunkflow", context, context // n, 0, keep, token_multiple=multiple)
            for n in spans for keep in (1, 2, 4) if keep <= n]


def tune_static(policy: str, tuning_lengths: Sequence[int], cost: CostModel, pp: int, budget_bytes: float, context: int,
                layers: Sequence[int] | None = None, token_multiple: int = 1) -> StaticConfig:
    """The offline choice a user would make: among configurations that fit the budget on the
    worst case (every sequence as long as the context) and on a tuning batch, the fastest on
    the tuning batch; for
    packed/split the least recompute that fits. If none fits, the most memory-frugal one
    (full recompute, finest split), which the simulator will flag OOM on large batches."""
    layers = tuple(layers or stage_layers(cost.num_layers, pp))
    usable = usable_budget(budget_bytes, min(_states(cost, layers)))
    batches = ([context] * (pp + 2), tuning_lengths)
    fitting, frugal, frugal_peak = [], None, math.inf
    for cfg in _static_candidates(policy, context, cost.num_layers, pp, token_multiple):
        if fitting and fitting[-1].policy != "chunkflow" and fitting[-1].param == cfg.param:
            continue  # the least recompute that fits this span size is already found
        peak = max(max(memory_peaks(plan_static(b, cfg, cost, pp, layers), cost, layers)) for b in batches)
        if peak <= usable:
            fitting.append(cfg)
        elif peak < frugal_peak:
            frugal, frugal_peak = cfg, peak
    if not fitting:
        return frugal
    return min(fitting, key=lambda cfg: simulate(plan_static(tuning_lengths, cfg, cost, pp, layers), cost, layers, check=False).iter_s)
