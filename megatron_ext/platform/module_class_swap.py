"""A mixin given to a live torch module, and its registered tensors read past the mixin.

A module built by megatron can be given a behaviour after the fact by swapping its class, in
place, for a subclass with a mixin as first base (the elastic plugin slices parameter reads so).
That leans on torch internals (checked with the torch of `versions.CHECKED["module_class_swap"]`):
`nn.Module` keeps parameters and buffers in its `_parameters` / `_buffers` dicts, not in the
instance dict, so every read of them reaches `__getattr__`, which a mixin can override; and
the subclass has the module's object layout, so Python lets the class be swapped.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

_MIXED: dict[tuple[type, type], type] = {}


def set_mixed_class(cls: type, mixin: type, mixed: type) -> None:
    """`mixed` is what `mix_in(module, mixin)` gives a module of class `cls`: for classes whose
    object layout refuses `mixin` as first base."""
    _MIXED.setdefault((cls, mixin), mixed)


def mix_in(module: nn.Module, mixin: type) -> nn.Module:
    """Swap `module`'s class in place for a subclass with `mixin` as first base (idempotent)."""
    cls = type(module)
    if issubclass(cls, mixin):
        return module
    if (cls, mixin) not in _MIXED:
        _MIXED[cls, mixin] = type(f"{mixin.__name__.removesuffix('Mixin')}{cls.__name__}", (mixin, cls), {})
    module.__class__ = _MIXED[cls, mixin]
    return module


def is_registered(module: nn.Module, name: str) -> bool:
    """Whether `name` is a parameter or buffer registered on `module` itself (it may be None)."""
    return name in module._parameters or name in module._buffers


def registered_tensor(module: nn.Module, name: str) -> Optional[torch.Tensor]:
    """The parameter or buffer registered under `name`, as registered: past any `__getattr__`
    of a mixin. KeyError when there is none."""
    if name in module._parameters:
        return module._parameters[name]
    return module._buffers[name]
