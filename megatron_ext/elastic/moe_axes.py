"""Axes of an MoE layer (megatron's TransformerLayer with a MoELayer of SequentialMLP experts):
the expert count, ranked by REAP (router-weighted expert output norm), and the FFN width shared
by the layer's experts. Top-k stays fixed.

Why the cut is exact: the router's logits are a matmul with its weight rows, so keeping the first
k rows routes (top-k and softmax) over exactly the kept experts, as the sliced layer's router
does; megatron's allgather dispatcher takes the routing map's columns by slice and SequentialMLP
zips experts with the token groups, so the experts past k are simply never run. The router reads
its expert count from its config (`logits.view(-1, num_moe_experts)`), so each elastic router
gets a private copy of the config whose count follows the axis.
"""

from __future__ import annotations

import copy
from typing import Mapping, Optional

import torch
from megatron.core import parallel_state
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
from megatron_ext.elastic.modules import ElasticMixin, SliceRule, add_rule, full_tensor


def _router_getattr(self, name: str):
    value = nn.Module.__getattr__(self, name)
    rules = self.__dict__.get("_elastic_rules", {}).get(name)
    return modules.sliced(value, rules) if rules and value is not None else value


# megatron's TopKRouter derives from abc.ABC before nn.Module, and Python refuses to swap its
# class to one with ElasticMixin as first base ("object layout differs"). With the mixin last
# the layout matches; the read-through-rules lookup is then given to the class directly.
modules._ELASTIC_CLASSES.setdefault(
    TopKRouter, type("ElasticTopKRouter", (TopKRouter, ElasticMixin), {"__getattr__": _router_getattr})
)


def _check_layout(kind: str) -> None:
    # Under TP (which megatron-core 0.16 runs for MoE only with sequence parallelism) or EP each
    # rank holds a shard of the experts; ranking and cutting them per shard is not written yet.
    tp = parallel_state.get_tensor_model_parallel_world_size()
    ep = parallel_state.get_expert_model_parallel_world_size()
    if tp > 1 or ep > 1:
        raise ValueError(
            f"elastic: the {kind} axis needs parallel.tp=1 and parallel.ep=1 (got tp={tp}, ep={ep}: megatron-core "
            "the MoE axes do not yet rank and cut TP- or EP-sharded experts)"
        )


class ExpertsAxis(Axis):
    """Routed experts of one MoE layer (at least top-k). Owns the router and every expert."""

    kind = "moe_experts"

    def __init__(self, moe: MoELayer, layer: int) -> None:
        _check_layout(self.kind)
        self.layer, self.full = layer, moe.config.num_moe_experts
        super().__init__()
        self.moe, self.topk = moe, moe.config.moe_router_topk
        self.routed = torch.zeros(self.full, dtype=torch.float64)  # tokens per expert in calibration
        self.ffn = moe.experts.local_experts[0].linear_fc2.weight.shape[1]

    def check(self, size: int) -> None:
        super().check(size)
        if size < self.topk:
            raise ValueError(f"elastic axis {self.name}: {size} experts are fewer than the router's top-k ({self.topk})")

    def attach(self) -> None:
        router = self.moe.router
        # A private config: megatron's layers share one, and only this router's count changes.
        router.config = copy.copy(router.config)
        add_rule(router, "weight", SliceRule(0, self.cut, self.gate_value))

    def resize(self, size: int) -> None:
        self.moe.router.config.num_moe_experts = size
        self.moe.router.num_experts = size

    def observe(self) -> list:
        """REAP: per expert, the mean over the tokens routed to it of gate * ||expert(x)||
        (megatron's experts scale their activation by the gate before fc2)."""
        self.routed.zero_()

        def hook_for(j: int):
            def hook(module, inputs, output):
                out = (output[0] if isinstance(output, tuple) else output).detach()
                self.score[j] += out.double().norm(dim=-1).sum().cpu()
                self.routed[j] += out.shape[0]

            return hook

        return [e.register_forward_hook(hook_for(j)) for j, e in enumerate(self.moe.experts.local_experts)]

    def order(self) -> torch.Tensor:
        mean = self.score / self.routed.clamp(min=1)
        return torch.sort(-mean, stable=True).indices

    def permute(self, order: torch.Tensor) -> None:
        router = self.moe.router
        permute_(full_tensor(router, "weight"), 0, order)
        if getattr(router, "expert_bias", None) is not None:
            permute_(router.expert_bias, 0, order)
        experts = self.moe.experts.local_experts
        reordered = [experts[i] for i in order.tolist()]
        # Move values, not modules: parameters keep their identity (grad buffers, optimizer).
        with torch.no_grad():
            snapshots = [{k: v.detach().clone() for k, v in e.state_dict().items() if isinstance(v, torch.Tensor)} for e in reordered]
            for target, values in zip(experts, snapshots):
                for key, value in values.items():
                    _tensor_at(target, key).copy_(value)

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


class ExpertFfnAxis(Axis):
    """The FFN width of every expert of one MoE layer (both SwiGLU halves alike). Its tensors are
    counted by the experts axis."""

    kind = "moe_ffn"

    def __init__(self, moe: MoELayer, layer: int) -> None:
        _check_layout(self.kind)
        if not moe.config.gated_linear_unit:
            raise ValueError("elastic: the MoE FFN axis supports gated (SwiGLU) experts")
        self.layer = layer
        self.full = moe.experts.local_experts[0].linear_fc2.weight.shape[1]
        super().__init__()
        self.experts = list(moe.experts.local_experts)

    def _fc1_rows(self) -> Optional[torch.Tensor]:
        if self.active == self.full:
            return None
        kept = torch.arange(self.active)
        return torch.cat([kept, kept + self.full])

    def attach(self) -> None:
        for e in self.experts:
            add_rule(e.linear_fc1, "weight", SliceRule(0, self._fc1_rows))
            add_rule(e.linear_fc2, "weight", SliceRule(1, self.cut, self.gate_value))

    def resize(self, size: int) -> None:
        for e in self.experts:
            e.linear_fc1.output_size_per_partition = 2 * size
            e.linear_fc2.input_size_per_partition = size

    def observe(self) -> list:
        """Post-activation magnitude per neuron, summed over every expert of the layer (one
        width for all of them, so one ranking)."""

        def hook(module, args):
            x = args[0].detach()
            self.score += x.abs().double().reshape(-1, x.shape[-1]).sum(0).cpu()

        return [e.linear_fc2.register_forward_pre_hook(hook) for e in self.experts]

    def permute(self, order: torch.Tensor) -> None:
        for e in self.experts:
            permute_(full_tensor(e.linear_fc1, "weight"), 0, torch.cat([order, order + self.full]))
            permute_(full_tensor(e.linear_fc2, "weight"), 1, order)

    def params(self, sizes: Mapping[str, Size]) -> Size:
        return 0

    def export_fields(self, size: int) -> dict:
        return {"moe_ffn_hidden_size": size}


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

