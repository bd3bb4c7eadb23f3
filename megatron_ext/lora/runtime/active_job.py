"""A job of the packed runtime while it holds a slot (`ActiveJob`: its optimizer, data and
counters) and what the runtime reports about it (`JobResult`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Optional

from megatron_ext.lora.job import LoraJob
from megatron_ext.lora.runtime.batching import MicroBatch
from megatron_ext.lora.runtime.optim import JobOptimizer


@dataclass
class JobResult:
    name: str
    status: str = "queued"  # queued | running | done | diverged | failed (could not start)
    steps: int = 0
    losses: list[float] = field(default_factory=list)  # per optimizer step
    eval_losses: dict[int, float] = field(default_factory=dict)  # step -> eval loss
    tokens: int = 0  # trained tokens (loss-counted or not; padding not)
    started_s: Optional[float] = None
    finished_s: Optional[float] = None
    error: Optional[str] = None  # why a failed job could not start


@dataclass
class ActiveJob:
    job: LoraJob
    slot: int
    optimizer: JobOptimizer
    data: Iterator[MicroBatch]
    eval_data: list[MicroBatch]
    result: JobResult
    micro: int = 0  # micro-batches (over all DP ranks) accumulated towards the next optimizer step
    step_loss: float = 0.0
    consumed: int = 0  # micro-batches of the job's stream trained on, over all DP ranks
