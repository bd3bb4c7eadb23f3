"""An elastic model's search space: its axes, the sizes they take, and what a size choice costs.

Sizes are given per axis kind (homogeneous: `{"hidden": 96, "heads": 2, "ffn": 192}` sets every
layer alike) and/or per axis name (heterogeneous: `{"ffn/0": 128, "ffn/1": 256}`); names win over
kinds, and an axis named by neither stays at its full size.
"""

from __future__ import annotations

import itertools
from contextlib import contextmanager
from typing import Iterator, Mapping, Sequence, Union

from torch import nn

from megatron_ext.elastic.axes import Axis, Size
from megatron_ext.elastic.discovery import discover
from megatron_ext.elastic.pipeline import chunks_of, merge_stages


class ElasticSpace:
    def __init__(self, model: Union[nn.Module, Sequence[nn.Module]]) -> None:
        # A rank's model chunks (one per virtual pipeline stage; one module without VPP): the
        # axes are all of theirs. `model` is the first chunk (its config is every chunk's).
        self.chunks = chunks_of(model)
        self.model = self.chunks[0]
        self.axes: list[Axis] = discover(self.chunks)
        self.by_name = {a.name: a for a in self.axes}
        # (kind, full, quantum) of every axis of the whole model by name: under pipeline
        # parallelism `axes` are this stage's (a hybrid stage may have no MoE layer at all),
        # while grids, sizes and the router name the whole model's kinds and axes.
        self.model_axes = merge_stages({a.name: (a.kind, a.full, a.quantum) for a in self.axes})

    @property
    def kinds(self) -> list[str]:
        return list(dict.fromkeys(kind for kind, _, _ in self.model_axes.values()))

    def full(self) -> dict[str, int]:
        return {a.name: a.full for a in self.axes}

    def full_of(self, kind: str) -> int:
        return next(full for k, full, _ in self.model_axes.values() if k == kind)

    def quantum_of(self, kind: str) -> int:
        return next(quantum for k, _, quantum in self.model_axes.values() if k == kind)

    def expand(self, sizes: Mapping[str, Size]) -> dict[str, Size]:
        """Per-axis sizes (of this stage's axes) of a (partly) per-kind choice."""
        unknown = [k for k in sizes if k not in self.model_axes and k not in self.kinds]
        if unknown:
            raise ValueError(f"elastic: unknown axis or kind {unknown}; this model has kinds {self.kinds}")
        return {a.name: sizes.get(a.name, sizes.get(a.kind, a.full)) for a in self.axes}

    def check(self, sizes: Mapping[str, Size]) -> dict[str, int]:
        """Per-axis integer sizes, every one checked before any is applied."""
        per_axis = {k: int(v) for k, v in self.expand(sizes).items()}
        for name, size in per_axis.items():
            self.by_name[name].check(size)
        return per_axis

    def apply(self, sizes: Mapping[str, Size]) -> None:
        for name, size in self.check(sizes).items():
            self.by_name[name].activate(size)

    def active(self) -> dict[str, int]:
        return {a.name: a.active for a in self.axes}

    @contextmanager
    def at(self, sizes: Mapping[str, Size]) -> Iterator[None]:
        """The model at `sizes` inside the block, at its previous sizes after."""
        before = self.active()
        self.apply(sizes)
        try:
            yield
        finally:
            self.apply(before)

    def clear_gates(self) -> None:
        for a in self.axes:
            a.gate = None

    # --- cost -----------------------------------------------------------------------------------

    def params(self, sizes: Mapping[str, Size]) -> Size:
        """Parameters of the submodel at `sizes` (differentiable in tensor sizes)."""
        per_axis = self.expand(sizes)
        return sum(a.params(per_axis) for a in self.axes)

    def active_params(self, sizes: Mapping[str, Size]) -> Size:
        per_axis = self.expand(sizes)
        return sum(a.active_params(per_axis) for a in self.axes)

    # --- export -----------------------------------------------------------------------------------

    def homogeneous(self, sizes: Mapping[str, Size]) -> dict[str, int]:
        """The per-kind sizes of a choice that sizes every layer of a kind alike."""
        per_axis = self.check(sizes)
        by_kind: dict[str, set[int]] = {}
        for name, size in per_axis.items():
            by_kind.setdefault(self.by_name[name].kind, set()).add(size)
        mixed = {k: sorted(v) for k, v in by_kind.items() if len(v) > 1}
        if mixed:
            raise ValueError(f"elastic: sizes differ between layers for {mixed}: not a homogeneous submodel")
        return {k: v.pop() for k, v in by_kind.items()}

    def export_fields(self, sizes: Mapping[str, Size]) -> dict:
        """Model-config fields of the homogeneous submodel at `sizes`."""
        fields: dict = {}
        per_axis = self.check(sizes)
        for a in self.axes:
            fields.update(a.export_fields(per_axis[a.name]))
        self.homogeneous(sizes)
        return fields


def grid_configs(grid: Mapping[str, list[int]]) -> list[dict[str, int]]:
    """Every homogeneous choice of a per-kind grid."""
    kinds = list(grid)
    return [dict(zip(kinds, combo)) for combo in itertools.product(*(grid[k] for k in kinds))]
