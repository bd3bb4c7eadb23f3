"""A parallel layout as an immutable value: its sizes, its validity for a model, its rank order.

Two layouts must coexist during a live reshard (the running one and the destination), so a
layout is a plain value rather than megatron's global parallel state. Which rank holds which
coordinates is megatron's `RankGenerator` numbering (order "tp-cp-ep-dp-pp"), mixed-radix
arithmetic computed here per rank (the generator lists every group of the world: seconds at
16,384 ranks; tests check the two agree); validity comes from the runtime's config rules.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence, Union

from megatron_ext.config.schema import Config, ModelConfig, ParallelConfig, TrainConfig
from megatron_ext.config.validate import ConfigError, resolve_dp, violations

# megatron-core's default rank order: TP fastest, then CP, EP, DP, and PP slowest.
ORDER = "tp-cp-ep-dp-pp"


@dataclasses.dataclass(frozen=True)
class ParallelLayout:
    """How `world` ranks are cut into tensor- (tp), pipeline- (pp, with `vpp` virtual stages
    each), data- (dp), expert- (ep, inside the data-parallel ranks) and context-parallel (cp)
    groups: the first tp·pp·dp·cp ranks train, the rest stand by and hold no state. A frozen
    value: the Trainer holds the running one (`Trainer.layout`), its layout controller enters
    another (`LayoutController.install`), and a planner compares two
    (`megatron_ext.reshard.plan.plan(model, a, b)`).
    `from_config` resolves dp from a run's `parallel` section once; `check` names the runtime's
    rules a layout breaks for a model or run (ConfigError); `rank_coords`, `ranks_of` and
    `group` map ranks to positions and groups in megatron's rank order. Raises ValueError for
    a size below 1 or a world smaller than the ranks that train."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1
    cp: int = 1
    vpp: Optional[int] = None
    # Uneven pipeline stages: layers on the first / last stage (None: an even share). Part of
    # the layout's identity, since they move layers between pipeline ranks.
    first_stage_layers: Optional[int] = None
    last_stage_layers: Optional[int] = None
    world: Optional[int] = None
    # These two change where optimizer state lives (sharded or not; bucket boundaries).
    distributed_optimizer: bool = True
    overlap_grad_reduce: bool = False

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "ep", "cp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ParallelLayout.{name} must be a positive integer, got {value!r}")
        if self.world is None:
            object.__setattr__(self, "world", self.active)
        if self.world < self.active:
            raise ValueError(f"world ({self.world}) is smaller than tp·pp·dp·cp ({self.active})")

    @property
    def active(self) -> int:
        """Ranks that hold state: tp·pp·dp·cp."""
        return self.tp * self.pp * self.dp * self.cp

    @property
    def edp(self) -> int:
        """Expert data-parallel size (megatron: world of the layout / (etp·ep·pp), etp = tp)."""
        return self.active // (self.tp * self.ep * self.pp)

    @classmethod
    def from_config(cls, parallel: ParallelConfig, world: int, plugins: Sequence[str] = ()) -> "ParallelLayout":
        """`parallel` on `world` ranks, dp resolved for them. `plugins`: the run's; where one of
        them keeps standby workers, an explicit dp may leave ranks of `world` standing by."""
        return cls(
            tp=parallel.tp,
            pp=parallel.pp,
            dp=resolve_dp(Config(parallel=parallel, plugins=list(plugins)), world),
            ep=parallel.ep,
            cp=parallel.cp,
            vpp=parallel.vpp,
            first_stage_layers=parallel.first_stage_layers,
            last_stage_layers=parallel.last_stage_layers,
            world=world,
            distributed_optimizer=parallel.use_distributed_optimizer,
            overlap_grad_reduce=parallel.overlap_grad_reduce,
        )

    def to_config(self, base: Optional[ParallelConfig] = None) -> ParallelConfig:
        """This layout's sizes in `base` (the run's other parallel settings kept)."""
        return dataclasses.replace(
            base or ParallelConfig(),
            tp=self.tp,
            pp=self.pp,
            dp=self.dp,
            ep=self.ep,
            cp=self.cp,
            vpp=self.vpp,
            first_stage_layers=self.first_stage_layers,
            last_stage_layers=self.last_stage_layers,
            use_distributed_optimizer=self.distributed_optimizer,
            overlap_grad_reduce=self.overlap_grad_reduce,
        )

    def violations(
        self, cfg: Union[Config, ModelConfig], device: Optional[str] = None
    ) -> list[tuple[str, str]]:
        """The runtime's broken rules for this layout with `cfg` (a run's config, or just a model:
        then batch-size rules, which belong to the run, are not checked), plus the one rule a
        live reshard adds: the run's padded vocabulary is fixed, so tp must divide it."""
        if isinstance(cfg, ModelConfig):
            # Sequence parallelism places no state differently; a model alone is checked as a
            # run that uses it where it must (megatron trains MoE at tp > 1 only with it).
            parallel = ParallelConfig(sequence_parallel=self.tp > 1 and cfg.num_experts is not None)
            cfg = Config(model=cfg, parallel=parallel, train=TrainConfig(global_batch_size=None))
        cfg = dataclasses.replace(cfg, parallel=self.to_config(cfg.parallel))
        found = violations(cfg, self.active, device)
        vocab = cfg.model.vocab_size
        if vocab is not None and vocab % self.tp:
            rule = f"the run's padded vocabulary ({vocab}) must be divisible by tp ({self.tp})"
            found.append(("parallel.tp", rule))
        return found

    def check(self, cfg: Union[Config, ModelConfig], device: Optional[str] = None) -> None:
        """Raise ConfigError naming every rule this layout breaks for `cfg`."""
        found = self.violations(cfg, device)
        if found:
            (field, rule), *others = found
            raise ConfigError(field, rule, others)

    def rank_coords(self, rank: int) -> dict[str, int]:
        """Megatron's coordinates of `rank`: tp, cp, dp, pp, dp_cp (the rank's index in the dense
        distributed-optimizer group, DP and CP folded), ep, edp (expert tensor parallel is tp,
        megatron's default, which the runtime keeps). Standby: {}."""
        if rank >= self.active:
            return {}
        dense, expert = _digits(self, rank, False), _digits(self, rank, True)
        return {
            "tp": dense["tp"], "cp": dense["cp"], "dp": dense["dp"], "pp": dense["pp"],
            "dp_cp": dense["cp"] + self.cp * dense["dp"], "ep": expert["ep"], "edp": expert["dp"],
        }

    def ranks_of(self, **coords: int) -> list[int]:
        """The ranks whose coordinates include all of `coords`, ascending."""
        table = [self.rank_coords(r) for r in range(self.active)]
        return [r for r, c in enumerate(table) if all(c[k] == v for k, v in coords.items())]

    def group(self, rank: int, token: str, expert: bool = False) -> list[int]:
        """The ranks of `rank`'s megatron group `token` ("tp", "dp-cp", "tp-ep-pp", ...), sorted
        as torch.distributed numbers a group's members."""
        if not 0 <= rank < self.active:
            raise ValueError(f"rank {rank} is not an active rank of {self}")
        dims, digits = _dims(self, expert), _digits(self, rank, expert)
        varying = token.split("-")
        fixed = sum(digits[d] * stride for d, (_, stride) in dims.items() if d not in varying)
        members = [fixed]
        for d in varying:  # megatron's RankGenerator: rank = Σ digit · stride in ORDER
            size, stride = dims[d]
            members = [m + i * stride for i in range(size) for m in members]
        return sorted(members)

    def group_position(self, rank: int, token: str, expert: bool = False) -> tuple[int, int]:
        """(`rank`'s index in its group `token`, the group's size), without listing the group:
        sorted members are ordered by their digits, the largest stride first."""
        dims, digits = _dims(self, expert), _digits(self, rank, expert)
        index, size = 0, 1
        for d in sorted(token.split("-"), key=lambda d: dims[d][1]):
            index += digits[d] * size
            size *= dims[d][0]
        return index, size

    def __str__(self) -> str:
        parts = [f"tp{self.tp}", f"pp{self.pp}", f"dp{self.dp}"]
        parts += [f"{k}{getattr(self, k)}" for k in ("ep", "cp") if getattr(self, k) > 1]
        if self.vpp:
            parts.append(f"vpp{self.vpp}")
        if self.first_stage_layers:
            parts.append(f"first{self.first_stage_layers}")
        if self.last_stage_layers:
            parts.append(f"last{self.last_stage_layers}")
        if self.world > self.active:
            parts.append(f"+{self.world - self.active} standby")
        return "·".join(parts)


def _dims(layout: ParallelLayout, expert: bool) -> dict[str, tuple[int, int]]:
    """Dimension -> (size, stride) of the rank order, as megatron's RankGenerator numbers ranks
    (ORDER, TP fastest); the expert generator has ep and the expert DP in place of cp and dp."""
    if expert:
        sizes = {"tp": layout.tp, "cp": 1, "ep": layout.ep, "dp": layout.edp, "pp": layout.pp}
    else:
        sizes = {"tp": layout.tp, "cp": layout.cp, "ep": 1, "dp": layout.dp, "pp": layout.pp}
    dims, stride = {}, 1
    for d in ORDER.split("-"):
        dims[d] = (sizes[d], stride)
        stride *= sizes[d]
    return dims


def _digits(layout: ParallelLayout, rank: int, expert: bool) -> dict[str, int]:
    return {d: rank // stride % size for d, (size, stride) in _dims(layout, expert).items()}
