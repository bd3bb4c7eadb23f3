"""Multi-adapter LoRA on megatron-core's tensor-parallel linears.

`MultiLoraLinear` wraps one frozen `ColumnParallelLinear` / `RowParallelLinear` and adds, for
the batch columns of each active adapter slot i, `alpha_i/r_i * dropout_i(x_i) A_i^T B_i^T`.
The base runs once over the whole packed batch; only the low-rank path is per adapter.

Sharding under tensor parallelism (each rank holds the slice below of the logical A [r, in]
and B [out, r]):
  - column-parallel base (linear_qkv, linear_fc1): the input is replicated, the output split.
    A is replicated, B split by output rows like the base weight. dS sums over the TP ranks'
    output shards: one all-reduce in backward (identity forward).
  - row-parallel base (linear_proj, linear_fc2): the input is split, the output reduced.
    A is split by input columns, B replicated; the partial S is all-reduced in forward (identity
    backward) and the adapter output is added after the base's own reduction.
Neither layout constrains the rank by the TP size. All slots of a layer share one collective.
The TP group is the wrapped linear's own (megatron's `tp_group`), not parallel_state's: a
sweep builds each pack's base on that pack's groups (groups.py).

Each slot holds its own-rank A and B as separate parameters: every job gets its own optimizer
state, and a finished job's slot takes the next job's tensors without touching the others.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
)
from torch import nn

from megatron_ext.lora.job import TARGET_MODULES, LoraJob
from megatron_ext.lora.runtime import kernels

# Where each target lives in a megatron TransformerLayer.
TARGET_PARENTS = {
    "linear_qkv": "self_attention",
    "linear_proj": "self_attention",
    "linear_fc1": "mlp",
    "linear_fc2": "mlp",
}


@dataclass(frozen=True)
class Segment:
    """Batch columns [start, stop) of the packed micro-batch belong to adapter `slot`; its
    samples hold `length` positions (the rest is padding to its pass partners' length)."""

    slot: int
    start: int
    stop: int
    length: int


@dataclass
class Routing:
    """Which batch columns each slot owns in the current forward, shared by all LoRA layers of a
    model. `generators`: a slot's dropout RNG (its own stream: packing never changes a job's
    dropout masks)."""

    segments: list[Segment] = field(default_factory=list)
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    kernel: str = "auto"


class SlotAdapter(nn.Module):
    """One adapter's A and B on this TP rank, with its scaling and dropout."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor, scaling: float, dropout: float) -> None:
        super().__init__()
        self.a = nn.Parameter(a)
        self.b = nn.Parameter(b)
        self.scaling = scaling
        self.dropout = dropout

    @property
    def rank(self) -> int:
        return self.a.shape[0]


class MultiLoraLinear(nn.Module):
    def __init__(self, base: nn.Module, target: str, layer_number: int, routing: Routing) -> None:
        super().__init__()
        if isinstance(base, ColumnParallelLinear):
            self.column = True
            self.in_features, self.out_features = base.input_size, base.output_size
        elif isinstance(base, RowParallelLinear):
            self.column = False
            self.in_features, self.out_features = base.input_size, base.output_size
        else:
            raise TypeError(
                f"lora: {target} is a {type(base).__name__}; only megatron's ColumnParallelLinear / "
                f"RowParallelLinear are supported (use model.spec=local)"
            )
        if base.sequence_parallel:
            raise ValueError("lora: sequence parallelism is not supported; set parallel.sequence_parallel=false")
        self.base = base
        self.target = target
        self.layer_number = layer_number
        self.routing = routing
        self.glu = target == "linear_fc1" and base.config.gated_linear_unit
        self.adapters = nn.ModuleDict()
        self.tp_group = base.tp_group
        self.tp, self.tp_rank = self.tp_group.size(), self.tp_group.rank()

    # --- slots --------------------------------------------------------------------------------

    def build(self, a: torch.Tensor, b: torch.Tensor, scaling: float, dropout: float) -> SlotAdapter:
        """A slot adapter from the logical (unsharded) A [r, in] and B [out, r], not yet installed."""
        if a.shape[1] != self.in_features or b.shape[0] != self.out_features or a.shape[0] != b.shape[1]:
            raise ValueError(
                f"lora {self.target} (layer {self.layer_number}): A {tuple(a.shape)} / B {tuple(b.shape)} "
                f"do not fit in={self.in_features}, out={self.out_features}"
            )
        a_local, b_local = self.local_pair(a, b)
        return SlotAdapter(a_local.contiguous().clone(), b_local.contiguous().clone(), scaling, dropout)

    def put(self, slot: int, adapter: SlotAdapter) -> None:
        self.adapters[str(slot)] = adapter

    def local_pair(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's shards of logical tensors shaped like A and B (weights, Adam moments, grads),
        in the base weight's dtype and device."""
        dtype, device = self.base.weight.dtype, self.base.weight.device
        a_local, b_local = (a, self._shard_rows(b)) if self.column else (a.chunk(self.tp, dim=1)[self.tp_rank], b)
        return a_local.to(device, dtype), b_local.to(device, dtype)

    def logical_pair(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The inverse of `local_pair`: whole tensors gathered over TP (collective on the TP group)."""
        if self.tp == 1:
            return a.clone(), b.clone()
        if self.column:
            return a.clone(), self._unshard_rows(_all_gather(b, 0, self.tp_group))
        return _all_gather(a, 1, self.tp_group), b.clone()

    def remove(self, slot: int) -> None:
        if str(slot) in self.adapters:
            del self.adapters[str(slot)]

    def slot(self, slot: int) -> Optional[SlotAdapter]:
        return self.adapters[str(slot)] if str(slot) in self.adapters else None

    def logical(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The slot's whole A and B, gathered over TP (collective on the TP group)."""
        adapter = self.adapters[str(slot)]
        return self.logical_pair(adapter.a.detach(), adapter.b.detach())

    def sharded(self, slot: int) -> dict[str, bool]:
        """Which of the slot's tensors are split over TP (the rest are replicated)."""
        return {"a": not self.column and self.tp > 1, "b": self.column and self.tp > 1}

    def _shard_rows(self, b: torch.Tensor) -> torch.Tensor:
        if not self.glu:
            return b.chunk(self.tp, dim=0)[self.tp_rank]
        # fc1's local output is [gate shard; up shard] of megatron's logical [gate; up].
        gate, up = b.chunk(2, dim=0)
        return torch.cat([gate.chunk(self.tp)[self.tp_rank], up.chunk(self.tp)[self.tp_rank]])

    def _unshard_rows(self, gathered: torch.Tensor) -> torch.Tensor:
        if not self.glu:
            return gathered
        shards = [s.chunk(2, dim=0) for s in gathered.chunk(self.tp, dim=0)]
        return torch.cat([s[0] for s in shards] + [s[1] for s in shards])

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None) -> dict:
        """The base's, under the base's own keys: checkpoints and exports of the base model do
        not see the wrapper (adapters are saved per job, see lora/export.py)."""
        return self.base.sharded_state_dict(prefix, sharded_offsets, metadata)

    # --- forward ------------------------------------------------------------------------------

    def forward(self, x: torch.Tensor, *args, **kwargs):
        out, bias = self.base(x, *args, **kwargs)
        segments = [s for s in self.routing.segments if str(s.slot) in self.adapters]
        if not segments:
            return out, bias
        return out + self._lora(x, segments, out), bias

    def _lora(self, x: torch.Tensor, segments: list[Segment], out: torch.Tensor) -> torch.Tensor:
        """The low-rank delta for the whole [s, b, out] output (zero for columns of no slot)."""
        seq = x.shape[0]
        adapters = [self.adapters[str(s.slot)] for s in segments]
        # Rows of a segment in [b, s] order: one adapter's samples are then contiguous rows.
        xs = [self._dropped(part, s, a.dropout).transpose(0, 1).reshape(-1, x.shape[-1])
              for s, a, part in zip(segments, adapters, _columns(x, segments))]
        kernel = kernels.select(x.device, x.dtype, self.routing.kernel)
        ss = kernel.shrink(xs, [a.a for a in adapters])
        ss = self._tp_shrink_collective(ss)
        ys = kernel.expand(ss, [a.b for a in adapters], [a.scaling for a in adapters])
        pieces, column = [], 0
        for s, y in zip(segments, ys):
            if s.start > column:
                pieces.append(out.new_zeros(seq, s.start - column, out.shape[-1]))
            pieces.append(y.reshape(s.stop - s.start, seq, -1).transpose(0, 1))
            column = s.stop
        if column < out.shape[1]:
            pieces.append(out.new_zeros(seq, out.shape[1] - column, out.shape[-1]))
        return torch.cat(pieces, dim=1)

    def _tp_shrink_collective(self, ss: list[torch.Tensor]) -> list[torch.Tensor]:
        if self.tp == 1:
            return ss
        flat = torch.cat([s.reshape(-1) for s in ss])
        region = copy_to_tensor_model_parallel_region if self.column else reduce_from_tensor_model_parallel_region
        mapped = region(flat, group=self.tp_group)
        return [piece.view_as(s) for piece, s in zip(mapped.split([s.numel() for s in ss]), ss)]

    def _dropped(self, x: torch.Tensor, segment: Segment, p: float) -> torch.Tensor:
        """x [s, rows, in] of `segment` with its dropout."""
        if p == 0.0 or not self.training:
            return x
        # The mask is drawn over the logical input and sliced, so it does not depend on TP; and
        # over the segment's own positions, so it does not depend on the padding its partners'
        # lengths add (the slot's generator runs on through every layer). Padding keeps all.
        shape = (segment.length, *x.shape[1:-1], self.in_features)
        keep = torch.rand(shape, generator=self.routing.generators[segment.slot], dtype=torch.float32) >= p
        keep = torch.cat([keep, keep.new_ones(x.shape[0] - segment.length, *shape[1:])])
        if not self.column:
            keep = keep.chunk(self.tp, dim=-1)[self.tp_rank]
        return x * keep.to(x.device, x.dtype) / (1.0 - p)


def _columns(x: torch.Tensor, segments: list[Segment]) -> list[torch.Tensor]:
    """Each segment's columns of x [s, b, h] (segments in column order), from one split: its
    backward joins the segments' gradients in one concatenation, where slicing x once per
    segment would make every segment's backward fill and add a gradient of x's full size
    (K times x's work per linear for K adapters)."""
    sizes, kept, column = [], [], 0
    for s in segments:
        if s.start > column:
            sizes.append(s.start - column)
        kept.append(len(sizes))
        sizes.append(s.stop - s.start)
        column = s.stop
    if column < x.shape[1]:
        sizes.append(x.shape[1] - column)
    parts = x.split(sizes, dim=1)
    return [parts[i] for i in kept]


def _all_gather(t: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


# --- whole models -----------------------------------------------------------------------------


def attach_lora(model: nn.Module, routing: Routing) -> dict[tuple[int, str], MultiLoraLinear]:
    """Wrap every adaptable linear of a megatron GPTModel (this pipeline stage) in a
    MultiLoraLinear and freeze the base. Returns the wrappers by (global layer number, target)."""
    for p in model.parameters():
        p.requires_grad_(False)
    wrappers = {}
    for layer in model.decoder.layers:
        for target in TARGET_MODULES:
            parent = getattr(layer, TARGET_PARENTS[target])
            base = getattr(parent, target)
            wrapper = MultiLoraLinear(base, target, layer.layer_number, routing)
            setattr(parent, target, wrapper)
            wrappers[(layer.layer_number, target)] = wrapper
    return wrappers


def init_adapter(job: LoraJob, layer_number: int, target: str, in_features: int, out_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A job's fresh logical A and B for one linear, drawn at the job's own rank from a generator
    seeded by (job seed, layer, target): the same in every pack, slot and TP layout. A is
    uniform(±1/sqrt(in)) (PEFT's default kaiming-uniform), B is zero."""
    seed = (job.seed * 1_000_003 + layer_number * len(TARGET_MODULES) + TARGET_MODULES.index(target)) % (2**63)
    generator = torch.Generator().manual_seed(seed)
    bound = 1.0 / math.sqrt(in_features)
    a = (torch.rand(job.rank, in_features, generator=generator, dtype=torch.float64) * 2 - 1) * bound
    return a, torch.zeros(out_features, job.rank, dtype=torch.float64)


def install_job(wrappers: dict[tuple[int, str], MultiLoraLinear], slot: int, job: LoraJob, weights: Optional[dict] = None) -> list[nn.Parameter]:
    """Install `job` into `slot` of every wrapper it targets, fresh or from `weights`
    ({(layer, target): (A, B)} logical tensors, exactly one pair per targeted linear). Returns
    the slot's parameters. All-or-nothing: every adapter is built and checked before any wrapper
    changes, so a bad job or weight leaves the slot and every other slot as they were."""
    targeted = [key for key in wrappers if key[1] in job.target_modules]
    if weights is not None and set(weights) != set(targeted):
        missing, unused = sorted(set(targeted) - set(weights)), sorted(set(weights) - set(targeted))
        raise ValueError(f"lora job {job.name!r}: weights missing for {missing}, unused for {unused} (layer, target)")
    built = {}
    for key in targeted:
        wrapper = wrappers[key]
        a, b = weights[key] if weights is not None else init_adapter(job, *key, wrapper.in_features, wrapper.out_features)
        try:
            built[key] = wrapper.build(a, b, job.scaling, job.dropout)
        except ValueError as error:
            raise ValueError(f"lora job {job.name!r}: {error}") from error
    for key, wrapper in wrappers.items():
        wrapper.remove(slot)
        if key in built:
            wrapper.put(slot, built[key])
    return [p for adapter in built.values() for p in (adapter.a, adapter.b)]


def remove_job(wrappers: dict[tuple[int, str], MultiLoraLinear], slot: int) -> None:
    for wrapper in wrappers.values():
        wrapper.remove(slot)


def logical_weights(wrappers: dict[tuple[int, str], MultiLoraLinear], slot: int) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """The slot's logical A and B per (layer, target), gathered over TP."""
    return {key: w.logical(slot) for key, w in wrappers.items() if w.slot(slot) is not None}
