"""A parallel layout as an immutable value: its sizes, its validity for a model, its rank order.

Two layouts must coexist during a live reshard (the running one and the destination), so a
layout is a plain value rather than megatron's global parallel state. Which rank holds which
coordinates comes from megatron's own `RankGenerator` (order "tp-cp-ep-dp-pp"), which is pure
arithmetic and needs no process group; validity comes from the runtime's config rules.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Union

from megatron.core.parallel_state import RankGenerator

from megatron_ext.config.schema import Config, ModelConfig, ParallelConfig, TrainConfig
from megatron_ext.config.validate import ConfigError, resolve_dp, violations

# megatron-core's default rank order: TP fastest, then CP, EP, DP, and PP slowest.
ORDER = "tp-cp-ep-dp-pp"

# Coordinates of a rank. Dense: tp, cp, dp, pp and dp_cp (the rank's index in the dense
# distributed-optimizer group, DP and CP folded). Expert: ep, edp (expert tensor parallel is tp,
# megatron's default, which the runtime keeps).
DENSE_TOKENS = {"tp": "tp", "cp": "cp", "dp": "dp", "pp": "pp", "dp_cp": "dp-cp"}
EXPERT_TOKENS = {"ep": "ep", "edp": "dp"}


@dataclasses.dataclass(frozen=True)
class ParallelLayout:
    """How `world` ranks are cut. Ranks from tp·pp·dp·cp on are standby: they hold no state."""

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
    def from_config(cls, parallel: ParallelConfig, world: int) -> "ParallelLayout":
        return cls(
            tp=parallel.tp,
            pp=parallel.pp,
            dp=resolve_dp(Config(parallel=parallel), world),
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
        """Megatron's coordinates of `rank`: tp, cp, dp, pp, dp_cp, ep, edp. Standby: {}."""
        return dict(_coords(self)[rank]) if rank < self.active else {}

    def ranks_of(self, **coords: int) -> list[int]:
        """The ranks whose coordinates include all of `coords`, ascending."""
        table = [dict(c) for c in _coords(self)]
        return [r for r, c in enumerate(table) if all(c[k] == v for k, v in coords.items())]

    def group(self, rank: int, token: str, expert: bool = False) -> list[int]:
        """The ranks of `rank`'s megatron group `token` ("tp", "dp-cp", "tp-ep-pp", ...), sorted
        as torch.distributed numbers a group's members."""
        for ranks in _generator(self, expert).get_ranks(token):
            if rank in ranks:
                return sorted(ranks)
        raise ValueError(f"rank {rank} is not an active rank of {self}")

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


@functools.lru_cache(maxsize=64)
def _generator(layout: ParallelLayout, expert: bool) -> RankGenerator:
    if expert:
        return RankGenerator(
            tp=layout.tp, ep=layout.ep, dp=layout.edp, pp=layout.pp, cp=1, order=ORDER
        )
    return RankGenerator(tp=layout.tp, ep=1, dp=layout.dp, pp=layout.pp, cp=layout.cp, order=ORDER)


@functools.lru_cache(maxsize=64)
def _coords(layout: ParallelLayout) -> tuple[tuple[tuple[str, int], ...], ...]:
    """Every active rank's coordinates: its index in each of its (sorted) megatron groups."""
    table: list[dict[str, int]] = [{} for _ in range(layout.active)]
    for expert, tokens in ((False, DENSE_TOKENS), (True, EXPERT_TOKENS)):
        for coord, token in tokens.items():
            for ranks in _generator(layout, expert).get_ranks(token):
                for index, rank in enumerate(sorted(ranks)):
                    table[rank][coord] = index
    return tuple(tuple(sorted(c.items())) for c in table)
