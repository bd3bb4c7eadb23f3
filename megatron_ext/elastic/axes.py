"""Width axes: the unit of elasticity. Every other part of `megatron_ext.elastic` works on axes.

An axis is one width dimension of the parent model with a size that can shrink: the embedding
channels (one global axis, "hidden"), the attention heads of one layer ("heads/3"), the FFN
neurons of one layer ("ffn/3"); the hybrid model adds Mamba heads and head channels, MoE experts
and expert FFN width (`mamba_axes.py`, `moe_axes.py`). An axis knows

  * which tensors it cuts, and along which dimension (slicing rules on elastic modules,
    `modules.py`), and which module attributes follow its size (e.g. megatron's
    `num_attention_heads_per_partition`);
  * how to score its units from a calibration forward (`observe()` installs hooks that
    accumulate `score`);
  * how to reorder its units once, function-preservingly, so that rank order equals index
    order (`permute(order)`); every submodel is then a prefix (per group where the axis is
    grouped: heads inside each query group, Mamba heads inside each Mamba group);
  * how many parameters the tensors it owns hold at given sizes (`params(sizes)`, differentiable
    in the sizes, so a router's expected cost has a gradient; `active_params` for MoE).

Interface for a new axis (subclass `Axis`):

    kind: str                   # "hidden", "heads", "ffn", "mamba_heads", "moe_experts", ...
    layer: int | None           # global layer index (0-based); None for model-wide axes
    full: int                   # the parent's size (global, i.e. over all TP ranks)
    quantum: int                # sizes must be multiples of it (e.g. query groups for heads)
    groups: int                 # units are ranked within `groups` equal contiguous blocks
    attach()                    # add slicing rules / nothing else; called once
    resize(size)                # set module attributes that follow the size (rules read `active`)
    observe() -> list[handle]   # forward hooks adding per-unit importance into `self.score`
    permute(order)              # reorder the parent's tensors in place (order: LongTensor[full])
    params(sizes) -> number     # parameters of the tensors this axis owns (each tensor is owned
                                #   by exactly one axis: the one that says so in its docstring)
    active_params(sizes)        # the same, counting only what one token uses (MoE); default params
    export_fields(size) -> dict # the model-config fields this axis sets in an exported submodel

`sizes` maps axis names (`axis.name`) to sizes (ints or 0-d tensors). A model's axes come from
`discover(model)` (`discovery.py`): the model-wide hidden axis plus, for each decoder layer, what
the first registered layer adapter that recognises it returns (`register_layer_adapter`): the
axes of that layer and the tensors in it that read or write the residual stream (`Touch`es of
the hidden axis). The dense adapter (attention + SwiGLU MLP) lives in `dense_axes.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional, Sequence, Union

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from torch import nn

from megatron_ext.elastic.modules import SliceRule, add_rule, full_tensor

Size = Union[int, torch.Tensor]


class Axis:
    kind: str = ""
    layer: Optional[int] = None
    full: int = 0
    quantum: int = 1
    groups: int = 1
    # True where each TP rank holds a block of the units (and scores only its own).
    tp_sharded: bool = False

    def __init__(self) -> None:
        self.active = self.full
        self.score = torch.zeros(self.full, dtype=torch.float64)
        # A 0-d tensor equal to 1.0 set by the router for the step (gradient path), or None.
        self.gate: Optional[torch.Tensor] = None

    @property
    def name(self) -> str:
        return self.kind if self.layer is None else f"{self.kind}/{self.layer}"

    # --- sizes -------------------------------------------------------------------------------

    def check(self, size: int) -> None:
        if not 0 < size <= self.full or size % self.quantum:
            raise ValueError(
                f"elastic axis {self.name}: size {size} is not a multiple of {self.quantum} "
                f"in (0, {self.full}]"
            )

    def activate(self, size: int) -> None:
        self.check(size)
        self.active = size
        self.resize(size)

    def cut(self) -> Optional[int]:
        """The prefix rule: None at the full size (the parent's own tensor is read)."""
        return None if self.active == self.full else self.active

    def gate_value(self) -> Optional[torch.Tensor]:
        return self.gate

    def statistics(self) -> list[torch.Tensor]:
        """What calibration accumulates and `reduce_scores` sums over ranks (besides `score`,
        e.g. the MoE experts' token counts)."""
        return [self.score]

    # --- to implement --------------------------------------------------------------------------

    def attach(self) -> None:
        raise NotImplementedError

    def resize(self, size: int) -> None:
        pass

    def observe(self) -> list:
        raise NotImplementedError

    def permute(self, order: torch.Tensor) -> None:
        raise NotImplementedError

    def params(self, sizes: Mapping[str, Size]) -> Size:
        raise NotImplementedError

    def active_params(self, sizes: Mapping[str, Size]) -> Size:
        return self.params(sizes)

    def export_fields(self, size: int) -> dict:
        return {}

    # --- ranking -----------------------------------------------------------------------------

    def order(self) -> torch.Tensor:
        """Units by falling importance, ranked within each of `groups` blocks (a stable sort:
        ties keep their index order, so a unit-free score is the identity)."""
        per = self.full // self.groups
        blocks = self.score.view(self.groups, per)
        within = torch.sort(-blocks, dim=1, stable=True).indices
        return (within + torch.arange(self.groups).unsqueeze(1) * per).reshape(-1)


@dataclass
class Touch:
    """A tensor that reads or writes the residual stream: the hidden axis cuts `dim` of it;
    `resize(module, size)` updates the module's size attributes with it."""

    module: nn.Module
    param: str
    dim: int
    resize: Optional[Callable[[nn.Module, int], None]] = None
    # The hidden axis counts this tensor's parameters (False where another axis owns it).
    owned: bool = False
    # Each TP rank holds a block of the tensor along its other dimension (the vocabulary).
    tp_sharded: bool = False
    # It computes the logits: the output layer, or the embedding tied to it on a single stage.
    logits: bool = False


@dataclass
class LayerAxes:
    axes: list[Axis]
    hidden: list[Touch]
    # Modules whose output is a normalized copy of the residual stream: the hidden axis's
    # importance is the magnitude of their outputs per channel.
    norms: list[nn.Module] = field(default_factory=list)


def permute_(tensor: torch.Tensor, dim: int, index: torch.Tensor) -> None:
    """Reorder `tensor` along `dim` in place (the Parameter object, its grad-buffer view and
    the optimizer's reference to it stay the same)."""
    with torch.no_grad():
        tensor.copy_(tensor.index_select(dim, index.to(tensor.device)))


def gather_across_tp(tensor: torch.Tensor, dim: int, runs: Union[int, Sequence[int]] = 1) -> list[torch.Tensor]:
    """The whole of each run of a tensor that each TP rank holds a block of along `dim`, as
    consecutive runs: `runs` equal ones, or runs of the given local lengths (SwiGLU's fc1 holds
    its block's gate rows, then its up rows; the Mamba in_proj its z, x, B, C and dt rows)."""
    sizes = [tensor.shape[dim] // runs] * runs if isinstance(runs, int) else list(runs)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if tp == 1:
        return list(tensor.split(sizes, dim))
    blocks = [torch.empty_like(tensor) for _ in range(tp)]
    dist.all_gather(blocks, tensor.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
    per_rank = [b.split(sizes, dim) for b in blocks]
    return [torch.cat([runs_of[i] for runs_of in per_rank], dim) for i in range(len(sizes))]


def rank_block(order: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """The part of a global `order` that TP rank `rank` applies to its block of `len(order) / tp`
    units, in the block's local indices. For axes ranked within groups that each lie whole on
    one rank (query groups, Mamba groups), so no unit leaves its rank."""
    local = len(order) // tp
    mine = order[rank * local : (rank + 1) * local] - rank * local
    if not torch.equal(mine.sort().values, torch.arange(local)):
        raise ValueError(f"elastic: the order moves units between TP ranks (rank {rank} of {tp})")
    return mine


def permute_across_tp_(tensor: torch.Tensor, dim: int, order: torch.Tensor, halves: int = 1) -> None:
    """Reorder, by a global `order`, the units of a tensor that each TP rank holds a block of
    along `dim` (as `halves` equal runs, `gather_across_tp`). Units move between ranks, so the
    blocks are gathered first."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if tp == 1:
        n = tensor.shape[dim] // halves
        permute_(tensor, dim, torch.cat([order + i * n for i in range(halves)]))
        return
    local = tensor.shape[dim] // halves
    with torch.no_grad():
        mine = order[parallel_state.get_tensor_model_parallel_rank() * local :][:local].to(tensor.device)
        tensor.copy_(torch.cat([whole.index_select(dim, mine) for whole in gather_across_tp(tensor, dim, halves)], dim))


def resize_norm(norm: nn.Module, size: int) -> None:
    norm.normalized_shape = (size,)


# Resize hooks for a megatron linear whose input (output) dimension an axis slices.
def set_input_size(module: nn.Module, size: int) -> None:
    module.input_size = size


def set_output_size(module: nn.Module, size: int) -> None:
    module.output_size = size


def _per_channel(touch: Touch) -> int:
    """Parameters per channel of a touched tensor in the whole model (this rank holds 1/tp of a
    TP-sharded one)."""
    tensor = full_tensor(touch.module, touch.param)
    tp = parallel_state.get_tensor_model_parallel_world_size() if touch.tp_sharded else 1
    return tensor.numel() // tensor.shape[touch.dim] * tp


class HiddenAxis(Axis):
    """The embedding channels (d_e): one size for the embedding, every layer's norms and
    residual-stream projections, the final norm and the output layer. Owns the word embedding,
    the output layer (when untied) and every norm weight it touches."""

    kind = "hidden"

    def __init__(
        self, full: int, touches: list[Touch], norms: list[nn.Module], vocab: int, tied: bool, sequence_parallel: bool = False
    ) -> None:
        self.full = full
        super().__init__()
        self.touches, self.norms, self.vocab, self.tied = touches, norms, vocab, tied
        # Under sequence parallelism each TP rank's norms see its part of the sequence only.
        self.tp_sharded = sequence_parallel

    def attach(self) -> None:
        # One gate per axis is enough for a gradient: on the tensor that computes the logits,
        # which every budget reads (a layer's tensor may be cut away: an MoE layer's last expert),
        # on the last pipeline stage only. It is TP-sharded, as sum_router_grads expects.
        for t in self.touches:
            add_rule(t.module, t.param, SliceRule(t.dim, self.cut, self.gate_value if t.logits else None))

    def resize(self, size: int) -> None:
        for t in self.touches:
            if t.resize is not None:
                t.resize(t.module, size)

    def observe(self) -> list:
        def hook(module, inputs, output):
            out = output[0] if isinstance(output, tuple) else output
            self.score[: out.shape[-1]] += out.detach().abs().double().reshape(-1, out.shape[-1]).sum(0).cpu()

        return [n.register_forward_hook(hook) for n in self.norms]

    def permute(self, order: torch.Tensor) -> None:
        seen = set()
        for t in self.touches:
            tensor = full_tensor(t.module, t.param)
            if id(tensor) in seen:  # a tied weight listed twice
                continue
            seen.add(id(tensor))
            permute_(tensor, t.dim, order)

    def params(self, sizes: Mapping[str, Size]) -> Size:
        h = sizes[self.name]
        owned = sum(_per_channel(t) for t in self.touches if t.owned)
        return h * owned

    def export_fields(self, size: int) -> dict:
        return {"hidden_size": size}


# --- discovery ------------------------------------------------------------------------------

LayerAdapter = Callable[[nn.Module], Optional[LayerAxes]]
_LAYER_ADAPTERS: list[LayerAdapter] = []


def register_layer_adapter(adapter: LayerAdapter) -> LayerAdapter:
    """Register a function that returns the `LayerAxes` of a decoder layer it recognises (or
    None). Later registrations are tried first, so a specialised adapter can take over."""
    _LAYER_ADAPTERS.insert(0, adapter)
    return adapter


def layer_axes(layer: nn.Module) -> LayerAxes:
    """The axes of a decoder layer, from the first registered adapter that recognises it."""
    for adapter in _LAYER_ADAPTERS:
        found = adapter(layer)
        if found is not None:
            return found
    raise ValueError(f"elastic: no axis adapter recognises the decoder layer {type(layer).__name__}")


def reduce_scores(axes: list[Axis], group=None) -> None:
    """Sum calibration scores over the data-parallel replicas `group`, so every replica permutes
    alike (it holds the EP ranks too: each scored its own experts, under their global indices,
    on the tokens of its whole EP group), the scores of TP-sharded axes over the TP ranks (each
    scored its own block, or its part of the sequence), and the model-wide (hidden) axis's over
    the pipeline stages."""
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        for axis in axes:
            _all_reduce(axis, group)
    if parallel_state.model_parallel_is_initialized() and parallel_state.get_tensor_model_parallel_world_size() > 1:
        for axis in axes:
            if axis.tp_sharded:
                _all_reduce(axis, parallel_state.get_tensor_model_parallel_group())
    if parallel_state.model_parallel_is_initialized() and parallel_state.get_pipeline_model_parallel_world_size() > 1:
        # The residual stream runs through every stage: each scored the norms it holds.
        for axis in axes:
            if axis.layer is None:
                _all_reduce(axis, parallel_state.get_pipeline_model_parallel_group())


def _all_reduce(axis: Axis, group) -> None:
    for tensor in axis.statistics():
        dist.all_reduce(tensor, group=group)
