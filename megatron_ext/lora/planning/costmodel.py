"""Time of one packed pass (forward + backward of every active job's micro-batch) on a group of
tp x dp devices: the planner's cost model.

Two models answer `pass_time(jobs, tp, dp)`:
  - `LinearCostModel`: seconds = c . features(pass), features = (1, jobs, base GFLOP, LoRA GFLOP,
    attention GFLOP, TP all-reduce GB), the coefficients fitted to timed real passes on this
    machine (`fit`, measured by lora/calibrate.py) and checked on held-out passes.
  - `GpuCostModel`: an analytic roofline for a GPU (datasheet peak FLOP/s, HBM and NVLink
    bandwidth, a GEMM efficiency that falls for small GEMMs, launch latency) for simulating a
    cluster this machine does not have.

The frozen base costs a forward and an input-gradient GEMM per linear (no weight gradient);
every adapter adds six thin GEMMs per adapted linear (x A, S B forward; dB, dS, dA, dx backward)
on its own rows. Packing K jobs turns K small base GEMMs into one large one: the gain is the
GEMM efficiency and per-pass overheads, not fewer FLOPs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np
from scipy.optimize import nnls

from megatron_ext.lora.job import LoraJob
from megatron_ext.lora.planning.workload import COLUMN_PARALLEL, Shapes, padded_length, replica_work


class CostModel(Protocol):
    def pass_time(self, jobs: Sequence[LoraJob], tp: int, dp: int) -> float: ...


@dataclass(frozen=True)
class PassWork:
    """What one pass of `jobs` does on each device of a tp x dp group."""

    jobs: int
    tokens: float  # packed, padded tokens on one replica (samples of their mean length)
    base_flops: float  # frozen linears and the output layer: forward + input gradient
    lora_flops: float
    attention_flops: float
    tp_allreduce_bytes: float  # bf16/fp32-agnostic: elements * 2 bytes, summed over collectives

    def features(self) -> np.ndarray:
        return np.array(
            [1.0, self.jobs, self.base_flops / 1e9, self.lora_flops / 1e9, self.attention_flops / 1e9,
             self.tp_allreduce_bytes / 1e9]
        )


def lora_shards(shapes: Shapes, target: str, tp: int) -> tuple[int, int]:
    """(in of A, out of B) on one TP rank (lora/runtime/layers.py: B split for column, A for row bases)."""
    d_in, d_out = shapes.linears[target]
    return (d_in, d_out // tp) if target in COLUMN_PARALLEL else (d_in // tp, d_out)


def pass_work(shapes: Shapes, jobs: Sequence[LoraJob], tp: int, dp: int) -> PassWork:
    seq = padded_length(jobs)
    samples = [replica_work(j, dp).samples_per_pass for j in jobs]
    tokens = sum(samples) * seq
    linear_params = sum(i * o for i, o in shapes.linears.values()) * shapes.layers
    base = 4.0 * tokens * (linear_params + shapes.hidden * shapes.vocab) / tp
    # Causal attention: QK^T and PV over half the seq x seq scores, backward 2.5x forward.
    attention = 3.5 * 2.0 * tokens * seq * shapes.heads * shapes.head_dim / tp * shapes.layers
    lora = 0.0
    for job, n in zip(jobs, samples):
        for t in job.target_modules:
            a_in, b_out = lora_shards(shapes, t, tp)
            lora += 6.0 * n * seq * job.rank * (a_in + b_out) * shapes.layers
    allreduce = 0.0
    if tp > 1:
        lowrank = sum(n * seq * j.rank for j, n in zip(jobs, samples))
        allreduce = 2.0 * shapes.layers * (4 * tokens * shapes.hidden + 4 * lowrank) + 2.0 * tokens * shapes.hidden
    return PassWork(len(jobs), tokens, base, lora, attention, allreduce)


@dataclass(frozen=True)
class LinearCostModel:
    """seconds = coefficients . PassWork.features(); fitted by `fit`."""

    shapes: Shapes
    coefficients: tuple[float, ...]

    def pass_time(self, jobs: Sequence[LoraJob], tp: int, dp: int) -> float:
        return float(np.dot(self.coefficients, pass_work(self.shapes, jobs, tp, dp).features()))


@dataclass(frozen=True)
class Sample:
    """One timed pass: `jobs` trained together on a tp x dp group took `seconds`."""

    jobs: tuple[LoraJob, ...]
    tp: int
    dp: int
    seconds: float


@dataclass(frozen=True)
class Fit:
    model: LinearCostModel
    train_error: float  # mean relative error on the samples it was fitted to
    heldout_error: float  # mean relative error on samples it never saw
    heldout_max_error: float


def _solve(shapes: Shapes, samples: Sequence[Sample]) -> LinearCostModel:
    x = np.stack([pass_work(shapes, s.jobs, s.tp, s.dp).features() for s in samples])
    y = np.array([s.seconds for s in samples])
    # Relative least squares: small passes matter as much as large ones to a planner. A
    # feature absent from every sample (no TP > 1 measured) keeps a zero coefficient.
    weights = 1.0 / y
    coefficients, _ = nnls(x * weights[:, None], y * weights)
    return LinearCostModel(shapes, tuple(float(c) for c in coefficients))


def _relative_errors(model: LinearCostModel, samples: Sequence[Sample]) -> np.ndarray:
    return np.array([abs(model.pass_time(s.jobs, s.tp, s.dp) - s.seconds) / s.seconds for s in samples])


def fit(shapes: Shapes, train: Sequence[Sample], heldout: Sequence[Sample]) -> Fit:
    """Fit the linear model on `train`, report its error on `heldout` (disjoint passes)."""
    if len(train) < len(PassWork(0, 0, 0, 0, 0, 0).features()) - 1:
        raise ValueError(f"cost model fit: {len(train)} samples are too few for the model's coefficients")
    model = _solve(shapes, train)
    held = _relative_errors(model, heldout) if heldout else np.array([math.nan])
    return Fit(model, float(_relative_errors(model, train).mean()), float(held.mean()), float(held.max()))


@dataclass(frozen=True)
class GpuSpec:
    """A GPU's datasheet numbers plus the efficiencies the roofline needs (assumptions, stated)."""

    name: str
    memory_bytes: int
    peak_flops: float  # dense bf16 tensor-core FLOP/s
    hbm_bytes_per_s: float
    link_bytes_per_s: float  # NVLink, one direction, per GPU
    link_latency_s: float = 8e-6  # per all-reduce ring step
    launch_s: float = 5e-6  # per kernel
    gemm_efficiency: float = 0.75  # best fraction of peak a large GEMM reaches
    gemm_half_size: int = 256  # smallest GEMM side at which half of that is reached
    attention_efficiency: float = 0.5  # flash attention, fraction of peak
    pass_overhead_s: float = 3e-3  # framework work per pass (Python, data, loss)
    step_overhead_s: float = 1e-3  # per job and optimizer step (its own Adam, clip, schedule)


# NVIDIA A100-SXM4-80GB datasheet: 312 TFLOP/s bf16 dense, 2039 GB/s HBM2e, NVLink3 600 GB/s
# (both directions). The efficiency fields keep GpuSpec's defaults: assumed, not measured.
A100_80GB = GpuSpec("A100-SXM4-80GB", 80 * 10**9, 312e12, 2.039e12, 300e9)


@dataclass(frozen=True)
class GpuCostModel:
    shapes: Shapes
    gpu: GpuSpec
    bytes_per_element: int = 2  # bf16 weights and activations

    def _gemm(self, m: int, k: int, n: int) -> float:
        """Roofline of one [m, k] x [k, n] GEMM whose efficiency falls with its smallest side."""
        g = self.gpu
        smallest = min(m, k, n)
        efficiency = g.gemm_efficiency * smallest / (smallest + g.gemm_half_size)
        compute = 2.0 * m * k * n / (g.peak_flops * efficiency)
        traffic = self.bytes_per_element * (m * k + k * n + m * n) / g.hbm_bytes_per_s
        return g.launch_s + max(compute, traffic)

    def _allreduce(self, nbytes: float, ranks: int) -> float:
        if ranks == 1:
            return 0.0
        g = self.gpu
        return 2 * (ranks - 1) / ranks * nbytes / g.link_bytes_per_s + 2 * (ranks - 1) * g.link_latency_s

    def pass_time(self, jobs: Sequence[LoraJob], tp: int, dp: int) -> float:
        s, g, e = self.shapes, self.gpu, self.bytes_per_element
        seq = padded_length(jobs)
        work = [(j, replica_work(j, dp)) for j in jobs]
        tokens = sum(w.samples_per_pass for _, w in work) * seq
        layer = 0.0
        for d_in, d_out in shapes_sharded(s, tp):
            layer += self._gemm(tokens, d_in, d_out) + self._gemm(tokens, d_out, d_in)
        work_attention = pass_work(s, jobs, tp, dp).attention_flops / s.layers
        layer += work_attention / (g.peak_flops * g.attention_efficiency)
        # Norms, RoPE, SwiGLU, residuals: memory bound; each saved element is written in the
        # forward, read and its gradient written in the backward.
        q, kv = s.heads * s.head_dim, s.groups * s.head_dim
        elementwise = tokens * (4 * s.hidden + (2 * q + 2 * kv + 3 * s.ffn) // tp)
        layer += 3 * e * elementwise / g.hbm_bytes_per_s + 30 * g.launch_s
        for job, w in work:
            m = w.samples_per_pass * seq
            for t in job.target_modules:
                a_in, b_out = lora_shards(s, t, tp)
                r = job.rank
                layer += self._gemm(m, a_in, r) + self._gemm(m, r, b_out)  # forward
                layer += self._gemm(m, b_out, r) + self._gemm(b_out, m, r)  # dS, dB
                layer += self._gemm(r, m, a_in) + self._gemm(m, r, a_in)  # dA, dx
        lowrank = sum(w.samples_per_pass * seq * j.rank for j, w in work)
        layer += 4 * self._allreduce(e * tokens * s.hidden, tp) + 4 * self._allreduce(e * lowrank, tp)
        head = self._gemm(tokens, s.hidden, s.vocab // tp) * 2 + 3 * 4 * tokens * s.vocab / tp / g.hbm_bytes_per_s
        # Each job's adapter gradients are summed over DP and its optimizer steps, once per
        # optimizer step: spread over the passes of that step.
        per_step = 0.0
        for job, w in work:
            grads = 4 * s.adapter_parameters_per_device(job.rank, job.target_modules, tp)
            per_step += (self._allreduce(grads, dp) + g.step_overhead_s) / w.passes_per_step
        return s.layers * layer + head + self._allreduce(e * tokens * s.hidden, tp) + g.pass_overhead_s + per_step


def shapes_sharded(shapes: Shapes, tp: int) -> list[tuple[int, int]]:
    """(in, out) of each frozen linear of a layer on one TP rank."""
    return [(i, o // tp) if t in COLUMN_PARALLEL else (i // tp, o) for t, (i, o) in shapes.linears.items()]
