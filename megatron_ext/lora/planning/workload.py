"""What a LoRA job asks of the hardware: the shapes it touches and the passes it needs.

Shared by the memory model (memory.py) and the cost model (costmodel.py) so both see the same
work. A *pass* is one packed forward/backward: every active job contributes one micro-batch of
its samples; the packed batch is right-padded to the longest sequence among them (as
`batching.pack` does), so a pack's token count is `sum(samples) * max(length)`.

A job's length is what its samples really hold, measured from its data (LoraJob.mean_tokens,
longest_tokens: conversations of SFT data are as long as they are, each micro-batch padded to
its longest), else `seq_length`: time counts the mean (`tokens_per_sample`), memory the
largest (`longest_sample`).

With DP degree `dp`, a job's global batch is split over the replicas: each replica trains
`ceil(global_batch / dp)` samples per optimizer step, in micro-batches of at most
`micro_batch_size` samples.

Under a cap on a pass's tokens (`split_passes`, the runtime's `max_pass_tokens`) a packed step
is several passes, each of whole micro-batches in slot order, grouped by their jobs' longest
samples (as the runtime groups them, alike on every DP rank) and padded to its own longest
sequence.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

from megatron_ext.config.schema import ModelConfig
from megatron_ext.lora.job import LoraJob

# Column-parallel linears split their output over TP, row-parallel ones their input.
COLUMN_PARALLEL = ("linear_qkv", "linear_fc1")


@dataclass(frozen=True)
class Shapes:
    """The per-layer sizes of a LLaMA-style GPT that memory and time depend on."""

    layers: int
    hidden: int
    ffn: int
    heads: int
    groups: int
    head_dim: int
    vocab: int

    @property
    def linears(self) -> dict[str, tuple[int, int]]:
        """Logical (in, out) of each adaptable linear of one layer (fc1 is gate+up, SwiGLU)."""
        q, kv = self.heads * self.head_dim, self.groups * self.head_dim
        return {
            "linear_qkv": (self.hidden, q + 2 * kv),
            "linear_proj": (q, self.hidden),
            "linear_fc1": (self.hidden, 2 * self.ffn),
            "linear_fc2": (self.ffn, self.hidden),
        }

    def base_parameters(self) -> int:
        """Every weight of the frozen base: linears, two norms per layer, final norm, embedding
        (tied with the output layer, as the presets are)."""
        per_layer = sum(i * o for i, o in self.linears.values()) + 2 * self.hidden
        return self.layers * per_layer + self.hidden + self.vocab * self.hidden

    def adapter_parameters(self, rank: int, targets: Sequence[str]) -> int:
        linears = self.linears
        return self.layers * sum(rank * sum(linears[t]) for t in targets)

    def adapter_parameters_per_device(self, rank: int, targets: Sequence[str], tp: int) -> int:
        """The adapter's share on one TP rank: B is split with a column-parallel base's output,
        A with a row-parallel base's input; the other factor is replicated (lora/runtime/layers.py)."""
        total = 0
        for t in targets:
            d_in, d_out = self.linears[t]
            total += rank * (d_in + d_out // tp) if t in COLUMN_PARALLEL else rank * (d_in // tp + d_out)
        return self.layers * total


def shapes_of(model: ModelConfig) -> Shapes:
    if model.num_experts:
        raise ValueError(f"lora planner: model {model.name!r} is a MoE; only dense GPT models are modelled")
    if model.vocab_size is None:
        raise ValueError(f"lora planner: model {model.name!r} needs vocab_size set (the tokenizer's size)")
    align = model.make_vocab_size_divisible_by
    return Shapes(
        layers=model.num_layers,
        hidden=model.hidden_size,
        ffn=model.ffn_hidden_size,
        heads=model.num_attention_heads,
        groups=model.num_query_groups or model.num_attention_heads,
        head_dim=model.hidden_size // model.num_attention_heads,
        vocab=math.ceil(model.vocab_size / align) * align,
    )


def tp_divides(shapes: Shapes, tp: int) -> bool:
    """Megatron splits heads, query groups and the FFN evenly over TP ranks."""
    return shapes.heads % tp == 0 and shapes.groups % tp == 0 and shapes.ffn % tp == 0


@dataclass(frozen=True)
class ReplicaWork:
    """A job's share of one DP replica: samples per pass and passes in the whole run."""

    samples_per_pass: int
    passes_per_step: int
    steps: int

    @property
    def passes(self) -> int:
        return self.passes_per_step * self.steps


def replica_work(job: LoraJob, dp: int) -> ReplicaWork:
    samples = math.ceil(job.global_batch_size / dp)
    per_pass = min(job.micro_batch_size, samples)
    return ReplicaWork(per_pass, math.ceil(samples / per_pass), job.steps)


def padded_length(jobs: Sequence[LoraJob]) -> float:
    """The mean length a pass of `jobs` is padded to: the longest of their mean samples."""
    return max(j.tokens_per_sample for j in jobs)


def longest_padded_length(jobs: Sequence[LoraJob]) -> int:
    """The most a pass of `jobs` is ever padded to."""
    return max(j.longest_sample for j in jobs)


def split_passes(sizes: Sequence[tuple[int, int]], max_tokens: Optional[int]) -> list[list[int]]:
    """Micro-batches of (samples, sequence length), in order, grouped into passes: greedily,
    whole micro-batches, a pass's padded tokens (its samples x its longest length) at most
    `max_tokens`; a micro-batch over the cap is a pass of its own. None: all in one pass."""
    if max_tokens is None:
        return [list(range(len(sizes)))] if sizes else []
    passes: list[list[int]] = []
    samples = longest = 0
    for i, (batch, seq) in enumerate(sizes):
        if passes and (samples + batch) * max(longest, seq) <= max_tokens:
            passes[-1].append(i)
            samples, longest = samples + batch, max(longest, seq)
        else:
            passes.append([i])
            samples, longest = batch, seq
    return passes


def pass_jobs(jobs: Sequence[LoraJob], dp: int, max_tokens: Optional[int]) -> list[list[LoraJob]]:
    """The passes of one packed step of `jobs` (in slot order) on each of `dp` replicas, as the
    runtime splits it: by the jobs' longest samples."""
    sizes = [(replica_work(j, dp).samples_per_pass, j.longest_sample) for j in jobs]
    return [[jobs[i] for i in group] for group in split_passes(sizes, max_tokens)]
