"""One LoRA fine-tuning job of a sweep: the adapter, its data and its optimisation.

A `LoraJob` is a plain value: the planner (planning/planner.py) reads it to size and order packs, the
packed runtime (runtime/batching.py, runtime/optim.py) trains it in a slot next to other jobs on one frozen base.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

# The megatron-core linears an adapter can sit on (names of the GPT layer's submodules).
# linear_qkv / linear_fc1 are column-parallel, linear_proj / linear_fc2 row-parallel.
TARGET_MODULES = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


@dataclass(frozen=True)
class LoraJob:
    name: str
    # Adapter.
    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = TARGET_MODULES
    # Optimisation (AdamW with its own state, step counter and schedule per job).
    lr: float = 1e-4
    min_lr: float = 0.0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    lr_warmup_steps: int = 0
    lr_decay_style: str = "constant"  # constant | linear | cosine
    clip_grad: float = 1.0  # on this adapter's own grad norm; 0 disables
    # Batches: `global_batch_size` samples per optimizer step, gathered in micro-batches of
    # `micro_batch_size` (grad accumulation when larger).
    micro_batch_size: int = 1
    global_batch_size: int = 1
    seq_length: int = 128
    steps: int = 100
    # Data: what datasets.py resolves (synthetic, task:<name>, SFT files or a weighted mix).
    dataset: str = "stdlib"
    seed: int = 1234
    eval_interval: int = 0  # 0: evaluate at the end only
    eval_iters: int = 2
    # What the job's samples really hold, measured from its data before planning
    # (datasets.SweepData): the mean and the largest tokens per sample, each micro-batch padded
    # to its longest sample. None: every sample holds seq_length tokens.
    mean_tokens: Optional[float] = None
    longest_tokens: Optional[int] = None

    def __post_init__(self) -> None:
        # Accept lists from YAML / Hydra; keep the value hashable.
        object.__setattr__(self, "target_modules", tuple(self.target_modules))
        self.validate()

    def validate(self) -> None:
        """Refuse a job that cannot be trained, naming the field."""
        problems = []
        unknown = [m for m in self.target_modules if m not in TARGET_MODULES]
        if unknown:
            problems.append(f"unknown target module(s) {unknown}; known: {list(TARGET_MODULES)}")
        if not self.target_modules:
            problems.append("target_modules is empty")
        if self.rank < 1:
            problems.append(f"rank must be >= 1, got {self.rank}")
        if not 0.0 <= self.dropout < 1.0:
            problems.append(f"dropout must be in [0, 1), got {self.dropout}")
        if self.micro_batch_size < 1 or self.global_batch_size % self.micro_batch_size:
            problems.append(
                f"global_batch_size ({self.global_batch_size}) must be a positive multiple of "
                f"micro_batch_size ({self.micro_batch_size})"
            )
        if self.steps < 1 or self.seq_length < 1:
            problems.append(f"steps ({self.steps}) and seq_length ({self.seq_length}) must be >= 1")
        if (self.mean_tokens is None) != (self.longest_tokens is None) or (
            self.mean_tokens is not None and not 1 <= self.mean_tokens <= self.longest_tokens <= self.seq_length
        ):
            problems.append(f"measured tokens per sample (mean {self.mean_tokens}, longest {self.longest_tokens}) "
                            f"must both be set, with 1 <= mean <= longest <= seq_length ({self.seq_length})")
        if self.lr_decay_style not in ("constant", "linear", "cosine"):
            problems.append(f"lr_decay_style {self.lr_decay_style!r} is not constant|linear|cosine")
        if problems:
            raise ValueError(f"lora job {self.name!r}: " + "; ".join(problems))

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    @property
    def accumulation_steps(self) -> int:
        """Micro-batches per optimizer step."""
        return self.global_batch_size // self.micro_batch_size

    @property
    def tokens_per_sample(self) -> float:
        """The tokens a sample of this job holds on average (its passes' time): measured, else
        seq_length."""
        return self.seq_length if self.mean_tokens is None else self.mean_tokens

    @property
    def longest_sample(self) -> int:
        """The most tokens a sample of this job holds (its passes' memory): measured, else
        seq_length."""
        return self.seq_length if self.longest_tokens is None else self.longest_tokens

    def replace(self, **changes) -> "LoraJob":
        return dataclasses.replace(self, **changes)


def jobs_from_dicts(entries: list[dict], defaults: Optional[dict] = None) -> list[LoraJob]:
    """Jobs from a multi-job config file: each entry overrides `defaults`; names must be unique."""
    jobs = [LoraJob(**{**(defaults or {}), **entry}) for entry in entries]
    names = [j.name for j in jobs]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"lora jobs: duplicate job name(s) {duplicates}")
    return jobs
