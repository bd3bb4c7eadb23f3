"""Memory of a pack of LoRA jobs on one device: the planner's feasibility model.

    mem = MemoryModel(shapes_of(model), BF16)
    mem.per_device(jobs, tp=2, dp=1).total <= hardware.usable_bytes

Per device, for TP degree `tp` and DP degree `dp` (the base and the adapters are replicated
over DP, each replica trains its share of every job's batch):
  - base weights once, split over TP (frozen: no gradient, no optimizer state);
  - per job, its adapter's parameters on this TP rank (lora/runtime/layers.py layout) times the bytes of
    its training state (parameter, gradient, Adam moments, fp32 main copy in low precision);
  - activations saved for backward of one packed pass: the tokens of every job's micro-batch,
    padded to the longest sequence in the pack (each job's largest sample: LoraJob.longest_sample,
    its data's when measured). Under the runtime's cap on a pass's tokens
    (`max_pass_tokens`) a packed step is several passes, one after another (workload.split_passes),
    and only the largest pass's activations are held at once.

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
from typing import Optional, Sequence

from megatron_ext.lora.job import LoraJob
from megatron_ext.lora.planning.workload import Shapes, longest_padded_length, pass_jobs, replica_work


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
    max_pass_tokens: Optional[int] = None  # the runtime's cap on one pass's padded tokens

    def base_bytes(self, tp: int) -> int:
        return self.shapes.base_parameters() * self.precision.weight_bytes // tp

    def adapter_bytes(self, job: LoraJob, tp: int) -> int:
        params = self.shapes.adapter_parameters_per_device(job.rank, job.target_modules, tp)
        return params * self.precision.adapter_state_bytes

    def token_bytes(self, job: LoraJob, tp: int, seq: int) -> int:
        """Saved activations of one of `job`'s tokens in a pass padded to `seq` (grows with
        `seq` only through unfused attention's probabilities)."""
        s = self.shapes
        q, kv = s.heads * s.head_dim, s.groups * s.head_dim
        per_token = 4 * s.hidden + (2 * q + 2 * kv + 3 * s.ffn) // tp
        if not self.fused_attention:
            per_token += s.heads // tp * seq
        layers = s.layers * (per_token + job.rank * len(job.target_modules)) * self.precision.activation_bytes
        return layers + 2 * (s.vocab // tp) * 4

    def activation_bytes(self, jobs: Sequence[LoraJob], tp: int, dp: int, seq: int | None = None) -> int:
        """Saved activations of one pass of `jobs`, padded to `seq` (default: their longest)."""
        if not jobs:
            return 0
        seq = seq or longest_padded_length(jobs)
        return sum(replica_work(j, dp).samples_per_pass * seq * self.token_bytes(j, tp, seq) for j in jobs)

    def step_activation_bytes(self, jobs: Sequence[LoraJob], tp: int, dp: int) -> int:
        """Saved activations at the peak of a packed step of `jobs` (in slot order): those of
        its largest pass, each pass padded to its own longest sequence."""
        return max((self.activation_bytes(p, tp, dp) for p in pass_jobs(jobs, dp, self.max_pass_tokens)), default=0)

    def activation_bound(self, jobs: Sequence[LoraJob], slots: int, tp: int, dp: int) -> int:
        """Saved activations that no `slots` of `jobs` active together exceed, in any slot
        order: the `slots` largest, padded to the longest sequence of all; under a cap a pass
        holds no more than that, and either one micro-batch alone or at most the cap's tokens,
        each at most the costliest job's bytes per token at that length."""
        seq = longest_padded_length(jobs)
        alone = sorted((self.activation_bytes([j], tp, dp, seq) for j in jobs), reverse=True)
        together = sum(alone[:slots])
        if self.max_pass_tokens is None:
            return together
        capped = self.max_pass_tokens * max(self.token_bytes(j, tp, seq) for j in jobs)
        return min(together, max(alone[0], capped))

    def per_device(self, jobs: Sequence[LoraJob], tp: int, dp: int) -> MemoryBreakdown:
        """Memory on each device of a (tp x dp) group training `jobs` (in slot order) together."""
        return MemoryBreakdown(
            base=self.base_bytes(tp),
            adapters=sum(self.adapter_bytes(j, tp) for j in jobs),
            activations=self.step_activation_bytes(jobs, tp, dp),
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
