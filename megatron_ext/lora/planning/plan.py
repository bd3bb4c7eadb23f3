"""What a sweep plan is: the value the planner produces, the simulator times and the packed
runtime executes.

A `Pack` is a group of `tp * dp` devices holding the frozen base once and training a queue of
jobs, at most `slots` at a time: when a job finishes, the next job of the queue takes its slot
while the others keep training. On each device, the packs that use it run in plan order; a
pack starts when all of its devices are free.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Pack:
    jobs: tuple[str, ...]  # queue order
    tp: int
    dp: int
    slots: int
    devices: tuple[int, ...]

    @property
    def size(self) -> int:
        return self.tp * self.dp


@dataclass(frozen=True)
class Plan:
    strategy: str
    packs: tuple[Pack, ...]

    def check(self, job_names: list[str], devices: int) -> None:
        """Refuse a malformed plan: every job exactly once, devices that exist, sane packs."""
        problems = []
        placed = [j for p in self.packs for j in p.jobs]
        missing = sorted(set(job_names) - set(placed))
        twice = sorted({j for j in placed if placed.count(j) > 1})
        unknown = sorted(set(placed) - set(job_names))
        for label, names in (("not scheduled", missing), ("scheduled twice", twice), ("unknown", unknown)):
            if names:
                problems.append(f"job(s) {label}: {names}")
        for i, p in enumerate(self.packs):
            if len(p.devices) != p.size or len(set(p.devices)) != p.size:
                problems.append(f"pack {i} needs {p.size} distinct devices (tp={p.tp} x dp={p.dp}), has {list(p.devices)}")
            if any(not 0 <= d < devices for d in p.devices):
                problems.append(f"pack {i} uses devices {list(p.devices)} outside 0..{devices - 1}")
            if p.slots < 1 or not p.jobs:
                problems.append(f"pack {i} has {p.slots} slots and {len(p.jobs)} jobs")
        if problems:
            raise ValueError(f"lora plan {self.strategy!r}: " + "; ".join(problems))
