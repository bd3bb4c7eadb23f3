"""Width-elastic megatron modules: parameters read as the active slice of the full tensor.

`make_elastic(module)` gives a megatron module (any class: linears, norms, embeddings, Mamba
mixers, experts) a per-parameter list of slicing rules. Reading `module.weight` then returns the
full tensor cut along each rule's dimension to what the axes that own the rules make active; the
full `nn.Parameter` stays registered under its own name, so `state_dict()`, megatron's
`sharded_state_dict()`, DDP grad buffers and the optimizer all see the parent's tensors, and the
gradient of a sliced read flows back into the full parameter.

Why slicing and not masking: the elastic forward at a budget then runs exactly the matmuls of the
exported submodel, on the same values in the same contiguous layout, so its logits equal the
exported model's bitwise (a masked forward differs in norm statistics and MoE routing unless each
is corrected, and costs the full model's FLOPs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch
from torch import nn

from megatron_ext.platform.module_class_swap import is_registered, mix_in, registered_tensor

# What a rule says for the current sizes: None (keep the whole dimension), n (its prefix of
# length n) or an index tensor (these positions, in this order).
Cut = Union[None, int, torch.Tensor]


@dataclass
class SliceRule:
    dim: int
    cut: Callable[[], Cut]
    # Optional gate (a 0-d tensor equal to 1.0 in value) the sliced tensor is multiplied by, so a
    # router gets gradients through the choice without changing a single bit of the forward.
    gate: Optional[Callable[[], Optional[torch.Tensor]]] = None


class ElasticMixin:
    """Mixed into an elastic module's class as its first base (see `make_elastic`)."""

    _elastic_rules: dict[str, list[SliceRule]]

    def __getattr__(self, name: str):
        value = super().__getattr__(name)
        rules = self.__dict__.get("_elastic_rules", {}).get(name)
        if rules and value is not None:
            value = sliced(value, rules)
        transform = self.__dict__.get("_elastic_transforms", {}).get(name)
        if transform is not None and value is not None:
            value = transform(value)
        return value


def sliced(tensor: torch.Tensor, rules: list[SliceRule]) -> torch.Tensor:
    """`tensor` cut by every rule; the tensor itself when no rule cuts (the full budget)."""
    out = tensor
    gate = None
    for rule in rules:
        cut = rule.cut()
        if cut is None:
            continue
        if isinstance(cut, int):
            if cut != out.shape[rule.dim]:
                out = out.narrow(rule.dim, 0, cut)
        else:
            out = out.index_select(rule.dim, cut.to(out.device))
        if rule.gate is not None:
            g = rule.gate()
            gate = g if gate is None or g is None else gate * g
    if out is not tensor:
        # The exported model holds these values as its own contiguous tensor: the same layout
        # keeps the matmuls bitwise equal.
        out = out.contiguous()
    if gate is not None:
        out = out * gate.to(out.dtype)
    return out


def make_elastic(module: nn.Module) -> nn.Module:
    """Make `module` elastic in place (idempotent): its class becomes a subclass that slices
    parameter reads by the rules added with `add_rule`."""
    mix_in(module, ElasticMixin)
    module.__dict__.setdefault("_elastic_rules", {})
    return module


def add_rule(module: nn.Module, param: str, rule: SliceRule) -> None:
    """Slice `module.<param>` by `rule` (after the rules added before it)."""
    if not is_registered(module, param):
        raise ValueError(f"{type(module).__name__} has no parameter or buffer {param!r}")
    make_elastic(module)
    module._elastic_rules.setdefault(param, []).append(rule)


def set_transform(module: nn.Module, param: str, transform: Optional[Callable[[torch.Tensor], torch.Tensor]]) -> None:
    """Read `module.<param>` through `transform` after slicing (None removes it): an elementwise
    map keeps every slice a slice of the transformed parent (FP8 fake quantisation, `fp8.py`)."""
    make_elastic(module)
    transforms = module.__dict__.setdefault("_elastic_transforms", {})
    if transform is None:
        transforms.pop(param, None)
    else:
        transforms[param] = transform


def full_tensor(module: nn.Module, name: str) -> torch.Tensor:
    """The registered (unsliced) parameter or buffer."""
    return registered_tensor(module, name)
