"""Axes of an MoE layer (megatron's TransformerLayer with a MoELayer of SequentialMLP experts):
the expert count, ranked by REAP (router-weighted expert output norm), and the FFN width shared
by the layer's experts. Top-k stays fixed.

Why the cut is exact: the router's logits are a matmul with its weight rows, so keeping the first
k rows routes (top-k and softmax) over exactly the kept experts, as the sliced layer's router
does. The router reads its expert count from its config (`logits.view(-1, num_moe_experts)`), so
each elastic router gets a private copy of the config whose count follows the axis. Its
probabilities and routing map are then padded back to the parent's expert count with zeros
(`_pad_routing`): megatron's dispatchers size their buffers and each EP rank's slice of the
routing map by the parent's count (the layer's config, `local_expert_indices`), and with the
padding every dispatcher sees the parent's layout, in which the experts past k get no tokens.
The kept experts see the same tokens in the same order as the sliced layer's (the permutation
sorts tokens expert by expert), so the output is the same to the bit.

Parallel layouts (megatron-core 0.16 runs MoE under TP only with sequence parallelism; the
allgather dispatcher gathers every token of the TP x EP group to each rank, whose experts run on
all of them):
  * TP: every expert's FFN neurons are sharded over the TP ranks like a dense MLP's (the expert
    FFN axis is `dense_axes.FfnAxis` over all of the layer's experts: one global order, each
    rank keeps its block's part of the prefix). An expert's output on one rank is a partial sum,
    so REAP all-reduces it over the expert TP group before taking its norm.
  * EP: rank r holds the experts [r * E / ep, (r + 1) * E / ep) by global index. The order is
    global (each rank scores its own experts under their global indices, and the scores are
    summed over the data-parallel group, which holds the EP group), and the one-time reorder
    moves expert weights between the EP ranks, so rank r holds the reordered parent's experts
    [r * E / ep, (r + 1) * E / ep) as before: the nesting stays a plain prefix, and a cut to k
    experts leaves the ranks past k empty-handed (the same price of balance as the TP cut of
    an FFN; keeping each rank's best experts first instead would make the kept set depend on ep).
"""

from __future__ import annotations

import copy
from typing import Mapping, Optional

import torch
import torch.distributed as dist
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.transformer_layer import TransformerLayer
from torch import nn

from megatron_ext.elastic.axes import (
    Axis,
    LayerAxes,
    Size,
    Touch,
    permute_,
    register_layer_adapter,
    resize_norm,
    set_input_size,
    set_output_size,
)
from megatron_ext.elastic import modules
from megatron_ext.elastic.dense_axes import FfnAxis
from megatron_ext.elastic.modules import ElasticMixin, SliceRule, add_rule, full_tensor
from megatron_ext.platform.module_class_swap import set_mixed_class


def _router_getattr(self, name: str):
    value = nn.Module.__getattr__(self, name)
    rules = self.__dict__.get("_elastic_rules", {}).get(name)
    return modules.sliced(value, rules) if rules and value is not None else value


# megatron's TopKRouter derives from abc.ABC before nn.Module, and Python refuses to swap its
# class to one with ElasticMixin as first base ("object layout differs"). With the mixin last
# the layout matches; the read-through-rules lookup is then given to the class directly.
set_mixed_class(
    TopKRouter, ElasticMixin, type("ElasticTopKRouter", (TopKRouter, ElasticMixin), {"__getattr__": _router_getattr})
)


class ExpertsAxis(Axis):
    """Routed experts of one MoE layer (at least top-k). Owns the router and every expert."""

    kind = "moe_experts"

    def __init__(self, moe: MoELayer, layer: int) -> None:
        self.layer, self.full = layer, moe.config.num_moe_experts
        super().__init__()
        self.moe, self.topk = moe, moe.config.moe_router_topk
        self.routed = torch.zeros(self.full, dtype=torch.float64)  # tokens per expert in calibration
        self.ffn = moe.config.moe_ffn_hidden_size
        # This EP rank's experts: the global ones [offset, offset + len(local_experts)).
        self.offset = moe.local_expert_indices[0]

    def check(self, size: int) -> None:
        super().check(size)
        if size < self.topk:
            raise ValueError(f"elastic axis {self.name}: {size} experts are fewer than the router's top-k ({self.topk})")

    def attach(self) -> None:
        router = self.moe.router
        # A private config: megatron's layers share one, and only this router's count changes.
        router.config = copy.copy(router.config)
        add_rule(router, "weight", SliceRule(0, self.cut, self.gate_value))
        router.register_forward_hook(self._pad_routing)

    def _pad_routing(self, module: nn.Module, args, output: tuple) -> Optional[tuple]:
        """The router's (probs, routing map) over the kept experts, padded with zeros to the
        parent's count: what the dispatcher expects (see the module's docstring)."""
        probs, routing_map = output
        missing = self.full - probs.shape[-1]
        if missing == 0:
            return None
        return (
            torch.cat([probs, probs.new_zeros(probs.shape[0], missing)], -1),
            torch.cat([routing_map, routing_map.new_zeros(routing_map.shape[0], missing)], -1),
        )

    def resize(self, size: int) -> None:
        self.moe.router.config.num_moe_experts = size
        self.moe.router.num_experts = size

    def statistics(self) -> list[torch.Tensor]:
        return [self.score, self.routed]

    def observe(self) -> list:
        """REAP: per expert, the mean over the tokens routed to it of gate * ||expert(x)||
        (megatron's experts scale their activation by the gate before fc2). Under TP an expert's
        output here is this rank's partial sum: summed over the expert TP group first (every
        rank of it runs the same tokens through the same experts, so the calls pair up)."""
        self.routed.zero_()
        tp_group = self.moe.experts.tp_group

        def hook_for(j: int):
            def hook(module, inputs, output):
                out = (output[0] if isinstance(output, tuple) else output).detach()
                if dist.get_world_size(tp_group) > 1:
                    out = out.clone()
                    dist.all_reduce(out, group=tp_group)
                self.score[j] += out.double().norm(dim=-1).sum().cpu()
                self.routed[j] += out.shape[0]

            return hook

        experts = self.moe.experts.local_experts
        return [e.register_forward_hook(hook_for(self.offset + j)) for j, e in enumerate(experts)]

    def order(self) -> torch.Tensor:
        mean = self.score / self.routed.clamp(min=1)
        return torch.sort(-mean, stable=True).indices

    def permute(self, order: torch.Tensor) -> None:
        router = self.moe.router
        permute_(full_tensor(router, "weight"), 0, order)
        if getattr(router, "expert_bias", None) is not None:
            permute_(router.expert_bias, 0, order)
        experts = self.moe.experts.local_experts
        mine = order[self.offset : self.offset + len(experts)].tolist()
        # Move values, not modules: parameters keep their identity (grad buffers, optimizer).
        with torch.no_grad():
            for key in _tensor_keys(experts[0]):
                every = _every_expert(torch.stack([_tensor_at(e, key) for e in experts]), self.moe.ep_group)
                for e, g in zip(experts, mine):
                    _tensor_at(e, key).copy_(every[g])

    def params(self, sizes: Mapping[str, Size]) -> Size:
        h, k = sizes["hidden"], sizes[self.name]
        f = sizes.get(f"moe_ffn/{self.layer}", self.ffn)
        return k * h + k * 3 * h * f

    def active_params(self, sizes: Mapping[str, Size]) -> Size:
        h, k = sizes["hidden"], sizes[self.name]
        f = sizes.get(f"moe_ffn/{self.layer}", self.ffn)
        return k * h + self.topk * 3 * h * f

    def export_fields(self, size: int) -> dict:
        return {"num_experts": size}

    def dropped_experts(self) -> range:
        """Experts the submodel at the active size does not have (their state-dict keys go)."""
        return range(self.active, self.full)


class ExpertFfnAxis(FfnAxis):
    """The FFN width of every expert of one MoE layer (both SwiGLU halves alike): the dense FFN
    axis over all of the layer's experts. Its tensors are counted by the experts axis."""

    kind = "moe_ffn"

    def __init__(self, moe: MoELayer, layer: int) -> None:
        if not moe.config.gated_linear_unit:
            raise ValueError("elastic: the MoE FFN axis supports gated (SwiGLU) experts")
        self._init_neurons(list(moe.experts.local_experts), layer, moe.config.moe_ffn_hidden_size)

    def params(self, sizes: Mapping[str, Size]) -> Size:
        return 0

    def export_fields(self, size: int) -> dict:
        return {"moe_ffn_hidden_size": size}


def _tensor_keys(module: nn.Module) -> list[str]:
    return [k for k, v in module.state_dict().items() if isinstance(v, torch.Tensor)]


def _every_expert(local: torch.Tensor, ep_group) -> torch.Tensor:
    """[local experts, ...] of each EP rank joined in rank order: every expert by global index."""
    ep = dist.get_world_size(ep_group)
    if ep == 1:
        return local
    blocks = [torch.empty_like(local) for _ in range(ep)]
    dist.all_gather(blocks, local.contiguous(), group=ep_group)
    return torch.cat(blocks)


def _tensor_at(module: nn.Module, key: str) -> torch.Tensor:
    *path, name = key.split(".")
    for part in path:
        module = getattr(module, part)
    return full_tensor(module, name)


@register_layer_adapter
def moe_layer(layer: nn.Module) -> Optional[LayerAxes]:
    if not isinstance(layer, TransformerLayer) or not isinstance(layer.mlp, MoELayer):
        return None
    if not isinstance(layer.self_attention, IdentityOp):
        return None  # attention + MoE in one layer (GPT-style MoE): not this adapter's
    moe = layer.mlp
    if not isinstance(moe.experts, SequentialMLP) or moe.use_shared_expert:
        raise ValueError("elastic: MoE layers need SequentialMLP experts without a shared expert")
    index = layer.layer_number - 1
    hidden = [Touch(layer.pre_mlp_layernorm, "weight", 0, resize_norm, owned=True), Touch(moe.router, "weight", 1)]
    for e in moe.experts.local_experts:
        hidden += [Touch(e.linear_fc1, "weight", 1, set_input_size), Touch(e.linear_fc2, "weight", 0, set_output_size)]
    return LayerAxes(
        axes=[ExpertsAxis(moe, index), ExpertFfnAxis(moe, index)],
        hidden=hidden,
        norms=[layer.pre_mlp_layernorm],
    )

