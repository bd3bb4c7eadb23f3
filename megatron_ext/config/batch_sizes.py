"""The batch-size schedules a config states, read as Megatron-LM reads them and checked
against its rules: `train.step_batch_size_schedule` (--step-batch-size-schedule) and
`train.rampup_batch_size` (--rampup-batch-size). Free of torch and megatron: the config's rules
read them before anything starts; training/batch_schedule.py runs them.
"""

from __future__ import annotations

from typing import Optional

from megatron_ext.config.schema import TrainConfig

# Megatron-LM's suffixes of schedule numbers.
MULTIPLIERS = {"K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}


def schedule_number(text: str) -> int:
    """A schedule number as Megatron-LM reads it: a float with an optional K/M/B/T suffix,
    truncated to an integer ("2.4B" is 2400000000). Raises ValueError."""
    text = text.strip().upper()
    multiplier = MULTIPLIERS.get(text[-1:], 1)
    if multiplier != 1:
        text = text[:-1]
    return int(float(text) * multiplier)


def parse_step_schedule(text: str, seq_length: int) -> tuple[tuple[int, int], ...]:
    """`"THRESHOLD:BATCH THRESHOLD:BATCH ..."` (spaces or commas between entries) as
    (threshold in samples, global batch) pairs, sorted by threshold; thresholds are tokens
    (floor-divided by `seq_length`). Raises ValueError naming the entry that does not parse."""
    entries = []
    for entry in text.strip().replace(",", " ").split():
        threshold, colon, batch = entry.partition(":")
        if not colon:
            raise ValueError(f'entry "{entry}" is not THRESHOLD:BATCH_SIZE')
        try:
            entries.append((schedule_number(threshold) // seq_length, schedule_number(batch)))
        except ValueError:
            raise ValueError(f'entry "{entry}": THRESHOLD and BATCH_SIZE are numbers (K, M, B, T suffixes allowed)') from None
    return tuple(sorted(entries, key=lambda e: e[0]))


def step_schedule_problems(schedule: tuple[tuple[int, int], ...]) -> list[str]:
    """Megatron-LM's rules for a parsed step schedule, plus its training loop's: the number of
    micro-batches never decreases."""
    if not schedule:
        return ["needs at least one THRESHOLD:BATCH_SIZE entry"]
    problems = []
    if schedule[0][0] != 0:
        problems.append(f"the first threshold must be 0, got {schedule[0][0]} samples")
    for (before, _), (after, _) in zip(schedule, schedule[1:]):
        if after <= before:
            problems.append(f"thresholds must be strictly increasing in samples (tokens // seq_length), got {before} then {after}")
    problems += [f"batch sizes must be positive, got {batch}" for _, batch in schedule if batch <= 0]
    for (_, before), (_, after) in zip(schedule, schedule[1:]):
        if 0 < after < before:
            problems.append(f"batch sizes must not decrease, got {before} then {after}")
    return problems


def rampup_problems(rampup: list[int], global_batch_size: int) -> list[str]:
    """megatron-core 0.16's rules for [start, increment, ramp samples] ramping up to
    `global_batch_size` (and where it would divide by zero: no increments, no ramp samples)."""
    if len(rampup) != 3:
        return [f"three integers: <start batch size> <batch size increment> <ramp-up samples>, got {len(rampup)}"]
    start, increment, samples = rampup
    problems = [
        f"{what} must be positive, got {value}"
        for what, value in (("the start batch size", start), ("the increment", increment), ("the ramp-up samples", samples))
        if value <= 0
    ]
    if problems:
        return problems
    if start >= global_batch_size:
        return [f"the start batch size ({start}) must be below the global batch size ({global_batch_size})"]
    if (global_batch_size - start) % increment:
        return [f"the global batch size minus the start ({global_batch_size} - {start}) must be divisible by the increment ({increment})"]
    return []


def schedule_key(train: TrainConfig) -> Optional[str]:
    """The config key of the run's batch-size schedule; None for a fixed global batch."""
    if train.rampup_batch_size is not None:
        return "train.rampup_batch_size"
    if train.step_batch_size_schedule is not None:
        return "train.step_batch_size_schedule"
    return None


def scheduled_batch_sizes(train: TrainConfig, seq_length: int, global_batch_size: int) -> list[int]:
    """Every global batch the run's schedule gives, in order (one for a fixed batch). The
    schedule is taken to be valid (`step_schedule_problems`, `rampup_problems`)."""
    if train.step_batch_size_schedule is not None:
        return [batch for _, batch in parse_step_schedule(train.step_batch_size_schedule, seq_length)]
    if train.rampup_batch_size is not None:
        start, increment, _ = train.rampup_batch_size
        return list(range(start, global_batch_size + 1, increment))
    return [global_batch_size]
