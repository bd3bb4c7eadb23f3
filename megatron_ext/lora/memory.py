"""Memory of a pack of LoRA jobs on one device: the planner's feasibility model.

    mem = MemoryModel(shapes_of(model), BF16)
    mem.per_device(jobs, tp=2, dp=1).total <= hardware.usable_bytes

Per device, for TP degree `tp` and DP degree `dp` (the base and the adapters are replicated
over DP, each replica trains its share of every job's batch):
  - base weights once, split over TP (frozen: no gradient, no optimizer state);
  - per job, its adapter's parameters on this TP rank (layers.py layout) times the bytes of
    its training state (parameter, gradient, Adam moments, fp32 main copy in low precision);
  - activations saved for backward of one packed pass: the tokens of every job's micro-batch,
    padded to the longest sequence in the pack.

Activation elements per token per layer (no sequence parallel, no recomputation): the inputs of
the two RMSNorms and of the two column-parallel linears (4h, replicated over TP), q/k/v and the
attention output ((2 q + 2 kv) / tp), fc1's gate+up output and the SwiGLU output (3 ffn / tp);
unfused attention (the CPU path) adds its softmax probabilities (heads / tp * seq per token).
The low-rank activations x A^T add `rank` per adapted linear. Logits and their softmax are kept
in fp32 (vocab / tp, twice). The frozen linears need no input for a weight gradient, but
megatron's linear saves it anyway, and LoRA's A gradient needs it: it is counted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from megatron_ext.lora.job import LoraJob
from megatron_ext.lora.workload import Shapes, padded_length, replica_work


@dataclass(frozen=True)
class Precision:
    weight_bytes: int  # one base weight
    adapter_state_bytes: int  # one adapter parameter's training state
    activation_bytes: int  # one saved activation element


# fp32: param 4 + grad 4 + Adam m, v 8. bf16: param 2 + fp32 main 4 + fp32 grad 4 + Adam 8.
FP32 = Precision(weight_bytes=4, adapter_state_bytes=16, activation_bytes=4)
BF16 = Precision(weight_bytes=2, adapter_state_bytes=18, activation_bytes=2)


@dataclass(frozen=True)
class MemoryBreakdown:
    base: int
    adapters: int
    activations: int

    @property
    def total(self) -> int:
        return self.base + self.adapters + self.activations


@dataclass(frozen=True)
class MemoryModel:
    shapes: Shapes
    precision: Precision
    fused_attention: bool = True  # flash / fused attention keeps no seq x seq probabilities

    def base_bytes(self, tp: int) -> int:
        return self.shapes.base_parameters() * self.precision.weight_bytes // tp

    def adapter_bytes(self, job: LoraJob, tp: int) -> int:
        params = self.shapes.adapter_parameters_per_device(job.rank, job.target_modules, tp)
        return params * self.precision.adapter_state_bytes

    def activation_bytes(self, jobs: Sequence[LoraJob], tp: int, dp: int, seq: int | None = None) -> int:
        """Saved activations of one pass of `jobs`, padded to `seq` (default: their longest)."""
        if not jobs:
            return 0
        s = self.shapes
        seq = seq or padded_length(jobs)
        q, kv = s.heads * s.head_dim, s.groups * s.head_dim
        per_token = 4 * s.hidden + (2 * q + 2 * kv + 3 * s.ffn) // tp
        if not self.fused_attention:
            per_token += s.heads // tp * seq
        elements = 0
        for job in jobs:
            tokens = replica_work(job, dp).samples_per_pass * seq
            elements += tokens * s.layers * (per_token + job.rank * len(job.target_modules))
        logits = sum(replica_work(j, dp).samples_per_pass for j in jobs) * seq * 2 * (s.vocab // tp)
        return elements * self.precision.activation_bytes + logits * 4

    def per_device(self, jobs: Sequence[LoraJob], tp: int, dp: int) -> MemoryBreakdown:
        """Memory on each device of a (tp x dp) group training `jobs` together."""
        return MemoryBreakdown(
            base=self.base_bytes(tp),
            adapters=sum(self.adapter_bytes(j, tp) for j in jobs),
            activations=self.activation_bytes(jobs, tp, dp),
        )


@dataclass(frozen=True)
class Hardware:
    devices: int
    memory_bytes: int  # per device
    # Held back per device for the runtime (CUDA context, allocator fragmentation, buffers).
    reserve_bytes: int = 0

    @property
    def usable_bytes(self) -> int:
        return self.memory_bytes - self.reserve_bytes


def gib(n: float) -> int:
    return int(n * 2**30)
