"""The budget router: from a target budget to one size per axis kind (or per axis).

For each key of the choice grid (a kind such as "ffn" for homogeneous submodels, or an axis name
such as "ffn/3" for heterogeneous ones) a small MLP maps the one-hot budget to logits over the
key's allowed sizes. Training samples a choice with the straight-through Gumbel-softmax (logits
multiplied by an annealed scale, divided by an annealed temperature): the forward sees a hard
choice (the exact size, and a gate exactly 1.0), the backward the soft probabilities. Two losses
reach the router: the relative gap between the sampled submodel's parameter count (total, or
active for MoE) and the budget's target, and, through the gates, the distillation loss.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Optional

import torch
import torch.nn.functional as F
from torch import nn

from megatron_ext.elastic.pipeline import stage_sum
from megatron_ext.elastic.space import ElasticSpace, grid_configs

# Above this many grid points reachability is checked from the extremes only.
_ENUMERATION_LIMIT = 200_000


@dataclass
class RouterConfig:
    hidden: int = 64
    lr: float = 1e-2
    tau_start: float = 1.0
    tau_end: float = 0.05
    scale_start: float = 1.0
    scale_end: float = 10.0
    # Steps over which temperature and logit scale move (geometrically) from start to end.
    anneal_steps: int = 100
    # "params" (total) or "active_params" (what one token uses: MoE counts top-k experts).
    cost: str = "params"
    # Weight of the cost-gap loss.
    cost_weight: float = 1.0


@dataclass
class Choice:
    """A sampled submodel: integer sizes (for the model) and, per key, the differentiable size
    and gate of the choice (for the losses)."""

    sizes: dict[str, int]
    # Hard in value (the exact size), soft in gradient.
    soft_sizes: dict[str, torch.Tensor]
    # The size expected under the relaxed sample (what the cost-gap loss sees: params are a sum
    # of products of distinct keys' sizes, so with independent keys this is the expected cost).
    expected_sizes: dict[str, torch.Tensor]
    gates: dict[str, torch.Tensor]


def annealed(start: float, end: float, step: int, steps: int) -> float:
    t = min(max(step, 0), steps) / max(steps, 1)
    return start * (end / start) ** t


class BudgetRouter(nn.Module):
    def __init__(self, budgets: list[float], grid: Mapping[str, list[int]], cfg: RouterConfig, seed: int = 0) -> None:
        super().__init__()
        self.budgets, self.cfg = list(budgets), cfg
        self.keys = list(grid)
        generator = torch.random.fork_rng(devices=[])
        with generator:
            torch.manual_seed(seed)  # every rank builds the same router
            self.nets = nn.ModuleDict(
                {
                    _key(k): nn.Sequential(
                        nn.Linear(len(budgets), cfg.hidden), nn.LeakyReLU(), nn.Linear(cfg.hidden, len(grid[k]))
                    )
                    for k in self.keys
                }
            )
        for k in self.keys:
            self.register_buffer(f"choices_{_key(k)}", torch.tensor(sorted(grid[k]), dtype=torch.float32))

    def choices(self, key: str) -> torch.Tensor:
        return getattr(self, f"choices_{_key(key)}")

    def logits(self, budget: int) -> dict[str, torch.Tensor]:
        x = F.one_hot(torch.tensor(budget), len(self.budgets)).to(next(self.parameters()).dtype)
        return {k: self.nets[_key(k)](x) for k in self.keys}

    def sample(self, budget: int, step: int, generator: Optional[torch.Generator] = None) -> Choice:
        tau = annealed(self.cfg.tau_start, self.cfg.tau_end, step, self.cfg.anneal_steps)
        scale = annealed(self.cfg.scale_start, self.cfg.scale_end, step, self.cfg.anneal_steps)
        sizes, soft, expected, gates = {}, {}, {}, {}
        for k, logits in self.logits(budget).items():
            u = torch.rand(logits.shape, generator=generator).clamp(1e-9, 1 - 1e-9)
            y_soft = ((logits * scale - torch.log(-torch.log(u))) / tau).softmax(-1)
            index = int(y_soft.argmax())
            # hard + (soft - soft): exactly one-hot in value, the soft gradient in backward.
            y = F.one_hot(torch.tensor(index), len(y_soft)).float() + (y_soft - y_soft.detach())
            sizes[k] = int(self.choices(k)[index])
            soft[k] = (y * self.choices(k)).sum()
            expected[k] = (y_soft * self.choices(k)).sum()
            gates[k] = y[index]
        return Choice(sizes, soft, expected, gates)

    @torch.no_grad()
    def select(self, budget: int) -> dict[str, int]:
        """The router's choice for a budget: the most likely size of every key (no noise)."""
        return {k: int(self.choices(k)[int(v.argmax())]) for k, v in self.logits(budget).items()}


def _key(name: str) -> str:
    return name.replace("/", "_")


# --- cost ---------------------------------------------------------------------------------------


def cost_of(space: ElasticSpace, sizes: Mapping, cost: str) -> torch.Tensor | int:
    """The whole model's cost: this pipeline stage's summed over the stages."""
    return stage_sum(space.active_params(sizes) if cost == "active_params" else space.params(sizes))


def cost_gap_loss(space: ElasticSpace, choice: Choice, target: float, cost: str) -> torch.Tensor:
    """|expected cost of the relaxed sample - target| / target. As the temperature anneals the
    relaxed sample hardens and this becomes the chosen submodel's own cost gap."""
    return (cost_of(space, choice.expected_sizes, cost) - target).abs() / target


class ExpectedGap:
    """E_pi |cost(submodel) - target| / target over every homogeneous submodel of the grid, with
    pi the product of the keys' annealed softmaxes. Exact and differentiable (no sampling noise);
    unlike the gap of the expected cost it is not met by a mixture of a too-small and a
    too-large submodel, so the most likely choice itself converges to the target."""

    def __init__(self, space: ElasticSpace, router: BudgetRouter) -> None:
        configs = grid_configs({k: router.choices(k).int().tolist() for k in router.keys})
        self.index = torch.tensor(
            [[router.choices(k).int().tolist().index(c[k]) for k in router.keys] for c in configs]
        )
        self.costs = torch.tensor([float(cost_of(space, c, router.cfg.cost)) for c in configs], dtype=torch.float64)

    @staticmethod
    def fits(router: BudgetRouter) -> bool:
        return math.prod(len(router.choices(k)) for k in router.keys) <= 20_000

    def __call__(self, router: BudgetRouter, budget: int, target: float, step: int) -> torch.Tensor:
        tau = annealed(router.cfg.tau_start, router.cfg.tau_end, step, router.cfg.anneal_steps)
        scale = annealed(router.cfg.scale_start, router.cfg.scale_end, step, router.cfg.anneal_steps)
        probs = [(v * scale / tau).softmax(-1) for v in router.logits(budget).values()]
        p = torch.ones(len(self.costs), dtype=torch.float64)
        for j, pk in enumerate(probs):
            p = p * pk.double()[self.index[:, j]]
        return (p * (self.costs - target).abs()).sum() / target


def apply_choice(space: ElasticSpace, choice: Choice) -> None:
    """Set the model to the sampled sizes, with the router's gates on the axes they size."""
    space.apply(choice.sizes)
    for axis in space.axes:
        axis.gate = choice.gates.get(axis.name, choice.gates.get(axis.kind))


# --- bad input ------------------------------------------------------------------------------------


def check_grid(space: ElasticSpace, grid: Mapping[str, list[int]]) -> None:
    """Every choice must be a size its axes can take (multiple of the axis quantum, e.g. the
    query groups, within the parent's size); the error names the nearest valid sizes."""
    for key, choices in grid.items():
        if key not in space.model_axes and key not in space.kinds:
            raise ValueError(f"elastic.grid: unknown axis or kind {key!r}; this model has kinds {space.kinds}")
        if not choices:
            raise ValueError(f"elastic.grid.{key}: no sizes given")
        axes = [a for a in space.axes if key in (a.name, a.kind)]  # this pipeline stage's
        for size in choices:
            for axis in axes:
                try:
                    axis.check(size)
                except ValueError:
                    q, full = axis.quantum, axis.full
                    lower = max(q, size // q * q)
                    near = sorted({min(lower, full), min(lower + q, full)})
                    raise ValueError(
                        f"elastic.grid.{key}: size {size} breaks {axis.name} (multiples of {q} up to "
                        f"{full}); nearest valid sizes: {near}; budgets this grid reaches with them: "
                        f"{_reachable_summary(space, {**grid, key: sorted(set(grid[key]) - {size} | set(near))})}"
                    ) from None


def reachable_fractions(space: ElasticSpace, grid: Mapping[str, list[int]], cost: str = "params") -> list[float]:
    """The budgets (fractions of the parent's cost) the grid's submodels have, ascending."""
    full = float(cost_of(space, space.full(), cost))
    n = math.prod(len(v) for v in grid.values())
    configs = (
        grid_configs(grid)
        if n <= _ENUMERATION_LIMIT
        else [{k: min(v) for k, v in grid.items()}, {k: max(v) for k, v in grid.items()}]
    )
    return sorted({round(float(cost_of(space, c, cost)) / full, 4) for c in configs})


def _reachable_summary(space: ElasticSpace, grid: Mapping[str, list[int]], around: Optional[float] = None) -> str:
    fractions = reachable_fractions(space, grid)
    if around is not None:
        fractions = sorted(sorted(fractions, key=lambda f: abs(f - around))[:5])
    elif len(fractions) > 8:
        fractions = fractions[:4] + fractions[-4:]
    return ", ".join(f"{f:.1%}" for f in fractions)


def check_budgets(
    space: ElasticSpace, grid: Mapping[str, list[int]], budgets: list[float], tolerance: float, cost: str = "params"
) -> None:
    """Each budget must be within `tolerance` (relative) of a submodel of the grid; the error
    lists the nearest budgets the grid reaches."""
    fractions = reachable_fractions(space, grid, cost)
    for b in budgets:
        if not 0 < b <= 1:
            raise ValueError(f"elastic.budgets: {b} is not a fraction in (0, 1]")
        if min(abs(f - b) for f in fractions) > tolerance * b:
            raise ValueError(
                f"elastic.budgets: {b:.1%} of the parent's {cost} is not reachable by the choice grid "
                f"(tolerance {tolerance:.0%}); nearest reachable budgets: {_reachable_summary(space, grid, b)}"
            )
