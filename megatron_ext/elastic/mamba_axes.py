"""Axes of a Mamba2 layer (megatron's MambaLayer with our `TorchMambaMixer`): the heads, ranked
and cut inside each Mamba group (the groups and their shared B/C, and the state size, are never
cut), and the head channels, one channel set for every head (Minitron-SSM's group-aware SSM
pruning).

A channel of the mixer is (head h, channel c) at index h * head_dim + c of z, x, the x part of
the conv, the gated norm and out_proj's input; dt, dt_bias, A_log and D are per head. Both axes
cut those tensors together, so one rule per tensor reads both sizes; the heads axis owns the
mixer's parameters, the channel axis only adds its size to them.

Why the cut is exact: every head and every channel runs independently through the conv, the
scan and the skip; the gated RMSNorm normalises per group, and a group keeps the same number of
heads, so the elastic mixer's group statistics are those of the sliced mixer's.

Under tensor parallelism each rank holds whole groups (megatron's layout: `mamba2.py`), and a
head count is a multiple of the groups, so every rank keeps the same number of its own heads:
the cuts, the head order (ranked inside groups) and the tensors stay rank-local, on the rows of
the rank's [z | x | B | C | dt]. Only the scores are reduced over the ranks.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.ssm.mamba_layer import MambaLayer
from torch import nn

from megatron_ext.elastic.axes import (
    Axis,
    LayerAxes,
    Size,
    Touch,
    permute_,
    rank_block,
    register_layer_adapter,
    resize_norm,
    set_input_size,
    set_output_size,
)
from megatron_ext.elastic.modules import SliceRule, add_rule, full_tensor
from megatron_ext.models.mamba2 import TorchMambaMixer


class _MixerCut:
    """The rows/columns of this TP rank's mixer tensors that the active (heads, head_dim) keep;
    every count is the rank's own (local)."""

    def __init__(self, mixer: TorchMambaMixer) -> None:
        s = mixer.shape
        self.mixer = mixer
        self.heads, self.head_dim, self.per_group = s.local_heads, s.head_dim, s.heads // s.groups
        self.bc = 2 * s.local_bc
        self.kept_heads_n = self.heads
        self.kept_dim_n = self.head_dim

    def heads_kept(self) -> torch.Tensor:
        """The first `n / groups` heads of every group."""
        per = self.kept_heads_n // (self.heads // self.per_group)
        base = torch.arange(self.heads // self.per_group).unsqueeze(1) * self.per_group
        return (base + torch.arange(per)).reshape(-1)

    def channels(self, heads: torch.Tensor, dims: torch.Tensor) -> torch.Tensor:
        return (heads.unsqueeze(1) * self.head_dim + dims).reshape(-1)

    def inner(self) -> Optional[torch.Tensor]:
        if self.kept_heads_n == self.heads and self.kept_dim_n == self.head_dim:
            return None
        return self.channels(self.heads_kept(), torch.arange(self.kept_dim_n))

    def per_head(self) -> Optional[torch.Tensor]:
        return None if self.kept_heads_n == self.heads else self.heads_kept()

    def in_proj_rows(self) -> Optional[torch.Tensor]:
        inner = self.inner()
        if inner is None:
            return None
        d_inner = self.heads * self.head_dim
        dt = 2 * d_inner + self.bc + self.heads_kept()
        return torch.cat([inner, d_inner + inner, 2 * d_inner + torch.arange(self.bc), dt])

    def conv_rows(self) -> Optional[torch.Tensor]:
        inner = self.inner()
        if inner is None:
            return None
        return torch.cat([inner, self.heads * self.head_dim + torch.arange(self.bc)])


class MambaHeadsAxis(Axis):
    """Mamba heads of one layer (a multiple of the groups). Owns every mixer parameter."""

    kind = "mamba_heads"
    tp_sharded = True  # each rank scores its own heads

    def __init__(self, mixer: TorchMambaMixer, layer: int, cut: _MixerCut) -> None:
        s = mixer.shape
        self.layer, self.full = layer, s.heads
        self.quantum = self.groups = s.groups
        super().__init__()
        self.mixer, self.cut_of = mixer, cut
        self.head_dim_axis: Optional["MambaHeadDimAxis"] = None

    def attach(self) -> None:
        m, c = self.mixer, self.cut_of
        gate_dim = lambda: self.head_dim_axis.gate_value() if self.head_dim_axis else None  # noqa: E731
        add_rule(m.in_proj, "weight", SliceRule(0, c.in_proj_rows, gate_dim))
        add_rule(m.conv1d, "weight", SliceRule(0, c.conv_rows))
        add_rule(m.conv1d, "bias", SliceRule(0, c.conv_rows))
        for name in ("dt_bias", "A_log", "D"):
            add_rule(m, name, SliceRule(0, c.per_head))
        add_rule(m.norm, "weight", SliceRule(0, c.inner))
        add_rule(m.out_proj, "weight", SliceRule(1, c.inner, self.gate_value))

    def resize(self, size: int) -> None:
        self.cut_of.kept_heads_n = size // self.mixer.shape.tp
        _resize_mixer(self.mixer, heads=size)

    def observe(self) -> list:
        return [self.mixer.in_proj.register_forward_hook(_x_branch_hook(self, per_head=True))]

    def permute(self, order: torch.Tensor) -> None:
        c = self.cut_of
        order = rank_block(order, self.mixer.shape.tp, parallel_state.get_tensor_model_parallel_rank())
        all_dims = torch.arange(c.head_dim)
        inner = c.channels(order, all_dims)
        d_inner = c.heads * c.head_dim
        rows = torch.cat([inner, d_inner + inner, 2 * d_inner + torch.arange(c.bc), 2 * d_inner + c.bc + order])
        _permute_mixer(self.mixer, rows, torch.cat([inner, d_inner + torch.arange(c.bc)]), inner, order)

    def params(self, sizes: Mapping[str, Size]) -> Size:
        s = self.mixer.shape
        h, n = sizes["hidden"], sizes[self.name]
        p = sizes.get(f"mamba_head_dim/{self.layer}", s.head_dim)
        bc = 2 * s.groups * s.d_state
        d_inner = n * p
        in_proj = h * (2 * d_inner + bc + n)
        conv = (d_inner + bc) * (s.d_conv + 1)
        return in_proj + conv + 3 * n + d_inner + d_inner * h

    def export_fields(self, size: int) -> dict:
        return {"mamba_num_heads": size}


class MambaHeadDimAxis(Axis):
    """The channels of every Mamba head of one layer. Its tensors are counted by the heads axis."""

    kind = "mamba_head_dim"

    def __init__(self, mixer: TorchMambaMixer, layer: int, cut: _MixerCut) -> None:
        self.layer, self.full = layer, mixer.shape.head_dim
        super().__init__()
        self.mixer, self.cut_of = mixer, cut

    def attach(self) -> None:
        pass  # the heads axis's rules read this axis's size through the shared cut

    def resize(self, size: int) -> None:
        self.cut_of.kept_dim_n = size
        _resize_mixer(self.mixer, head_dim=size)

    def observe(self) -> list:
        return [self.mixer.in_proj.register_forward_hook(_x_branch_hook(self, per_head=False))]

    def permute(self, order: torch.Tensor) -> None:
        c = self.cut_of
        inner = c.channels(torch.arange(c.heads), order)
        d_inner = c.heads * c.head_dim
        rows = torch.cat([inner, d_inner + inner, torch.arange(2 * d_inner, 2 * d_inner + c.bc + c.heads)])
        _permute_mixer(self.mixer, rows, torch.cat([inner, d_inner + torch.arange(c.bc)]), inner, None)

    def params(self, sizes: Mapping[str, Size]) -> Size:
        return 0

    def export_fields(self, size: int) -> dict:
        return {"mamba_head_dim": size}


def _resize_mixer(mixer: TorchMambaMixer, **sizes: int) -> None:
    s = mixer.shape = dataclasses.replace(mixer.shape, **sizes)
    mixer.in_proj.output_size_per_partition = 2 * s.local_d_inner + 2 * s.local_bc + s.local_heads
    mixer.out_proj.input_size_per_partition = s.local_d_inner


def _x_branch_hook(axis: Axis, per_head: bool):
    """Importance from the x branch of in_proj (before the conv), at full width: per head the
    L2 norm over its channels (this rank's heads), per channel the L2 norm over the heads (of
    every rank); summed over tokens."""

    def hook(module, inputs, output):
        s = axis.mixer.shape
        out = (output[0] if isinstance(output, tuple) else output).detach()
        x = out[..., s.local_d_inner : 2 * s.local_d_inner].reshape(-1, s.local_heads, s.head_dim).double()
        if per_head:
            offset = parallel_state.get_tensor_model_parallel_rank() * s.local_heads
            axis.score[offset : offset + s.local_heads] += x.norm(dim=2).sum(0).cpu()
        else:
            axis.score += _norm_over_heads(x, s.tp).sum(0).cpu()

    return hook


def _norm_over_heads(x: torch.Tensor, tp: int) -> torch.Tensor:
    """Per token and channel, the L2 norm over the heads of x [tokens, local heads, head_dim],
    whose heads are split over the TP ranks: squares summed over the ranks before the root (a
    norm does not add up). One process keeps torch's norm (its scores, bitwise)."""
    if tp == 1:
        return x.norm(dim=1)
    squares = x.pow(2).sum(1)
    dist.all_reduce(squares, group=parallel_state.get_tensor_model_parallel_group())
    return squares.sqrt()


def _permute_mixer(
    mixer: TorchMambaMixer, in_rows: torch.Tensor, conv_rows: torch.Tensor, inner: torch.Tensor, heads: Optional[torch.Tensor]
) -> None:
    permute_(full_tensor(mixer.in_proj, "weight"), 0, in_rows)
    permute_(full_tensor(mixer.conv1d, "weight"), 0, conv_rows)
    permute_(full_tensor(mixer.conv1d, "bias"), 0, conv_rows)
    permute_(full_tensor(mixer.norm, "weight"), 0, inner)
    permute_(full_tensor(mixer.out_proj, "weight"), 1, inner)
    if heads is not None:
        for name in ("dt_bias", "A_log", "D"):
            permute_(full_tensor(mixer, name), 0, heads)


@register_layer_adapter
def mamba_layer(layer: nn.Module) -> Optional[LayerAxes]:
    if not isinstance(layer, MambaLayer) or not isinstance(layer.mixer, TorchMambaMixer):
        return None
    index = layer.layer_number - 1
    mixer = layer.mixer
    cut = _MixerCut(mixer)
    heads = MambaHeadsAxis(mixer, index, cut)
    head_dim = MambaHeadDimAxis(mixer, index, cut)
    heads.head_dim_axis = head_dim
    return LayerAxes(
        axes=[heads, head_dim],
        hidden=[
            Touch(layer.norm, "weight", 0, resize_norm, owned=True),
            Touch(mixer.in_proj, "weight", 1, set_input_size),
            Touch(mixer.out_proj, "weight", 0, set_output_size),
        ],
        norms=[layer.norm],
    )
