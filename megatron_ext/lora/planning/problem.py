"""A LoRA sweep as the planners see it: its jobs, the hardware, the memory and cost models, the
(tp, dp) shapes the model splits into, and the pack timings and memory checks the planners ask
for again and again (remembered per problem)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

from megatron_ext.lora.job import LoraJob
from megatron_ext.lora.planning.costmodel import CostModel
from megatron_ext.lora.planning.memory import Hardware, MemoryModel
from megatron_ext.lora.planning.plan import Pack
from megatron_ext.lora.planning.simulate import run_pack
from megatron_ext.lora.planning.workload import pass_jobs, tp_divides

Shape = tuple[int, int]  # (tp, dp)


@dataclass(frozen=True)
class Problem:
    jobs: tuple[LoraJob, ...]
    hardware: Hardware
    memory: MemoryModel
    cost: CostModel
    max_tp: int = 8  # TP stays inside a node
    max_dp: int = 1 << 20

    def __post_init__(self) -> None:
        object.__setattr__(self, "jobs", tuple(self.jobs))
        names = [j.name for j in self.jobs]
        if len(set(names)) != len(names):
            raise ValueError(f"lora sweep: duplicate job names {sorted({n for n in names if names.count(n) > 1})}")
        if not self.jobs:
            raise ValueError("lora sweep: no jobs")

    @functools.cached_property
    def shapes(self) -> tuple[Shape, ...]:
        """(tp, dp) degrees, powers of two, that the model splits evenly and the devices hold."""
        powers = [2**i for i in range(self.hardware.devices.bit_length()) if 2**i <= self.hardware.devices]
        return tuple(
            (tp, dp)
            for tp in powers
            if tp <= self.max_tp and tp_divides(self.memory.shapes, tp)
            for dp in powers
            if tp * dp <= self.hardware.devices and dp <= self.max_dp
        )

    def fits(self, jobs: Sequence[LoraJob], slots: int, shape: Shape) -> bool:
        key = (tuple(j.name for j in jobs), slots, shape)
        if key not in self._fits:
            self._fits[key] = pack_memory_bound(self.memory, jobs, slots, shape) <= self.hardware.usable_bytes
        return self._fits[key]

    def solo_duration(self, job: LoraJob, shape: Shape) -> float:
        return self.duration((job.name,), shape, 1)

    def duration(self, names: Sequence[str], shape: Shape, slots: int) -> float:
        """Time a pack of this queue takes from its start to its last job's end."""
        key = (tuple(names), shape, slots)
        if key not in self._durations:
            pack = Pack(key[0], shape[0], shape[1], slots, tuple(range(shape[0] * shape[1])))
            self._durations[key] = run_pack(pack, self.by_name, 0.0, None, self)[1]
        return self._durations[key]

    def pass_time(self, jobs: Sequence[LoraJob], tp: int, dp: int) -> float:
        """The cost model's time of a packed step of `jobs`, remembered (the heuristic meets the
        same sets often): one pass, or under the runtime's cap (memory.max_pass_tokens) the
        sum of its passes, each paying the per-pass costs again."""
        key = (tuple(j.name for j in jobs), tp, dp)
        if key not in self._pass_times:
            passes = pass_jobs(jobs, dp, self.memory.max_pass_tokens)
            self._pass_times[key] = sum(self.cost.pass_time(p, tp, dp) for p in passes)
        return self._pass_times[key]

    @functools.cached_property
    def _durations(self) -> dict:
        return {}

    @functools.cached_property
    def _pass_times(self) -> dict:
        return {}

    @functools.cached_property
    def _chains(self) -> dict:
        return {}

    @functools.cached_property
    def _fits(self) -> dict:
        return {}

    @functools.cached_property
    def by_name(self) -> dict[str, LoraJob]:
        return {j.name: j for j in self.jobs}


def pack_memory_bound(memory: MemoryModel, jobs: Sequence[LoraJob], slots: int, shape: Shape) -> int:
    """Bytes per device that no `slots` jobs of `jobs` active together can exceed: the base, the
    largest adapters and the bound on activations (memory.activation_bound)."""
    tp, dp = shape
    adapters = sorted((memory.adapter_bytes(j, tp) for j in jobs), reverse=True)[:slots]
    return memory.base_bytes(tp) + sum(adapters) + memory.activation_bound(jobs, slots, tp, dp)
