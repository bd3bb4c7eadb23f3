"""FP8 (e4m3) quantisation-aware distillation with per-tensor scales that survive slicing.

Every decoder linear weight (QKV, attention output, FFN fc1 / fc2) is read through a fake
quantiser during distillation: divided by one scale per tensor, rounded to torch's
`float8_e4m3fn` and multiplied back, with the identity as its gradient (straight through).
The scale is the parent's: the absolute maximum of the whole (unsliced) tensor over 448, so a
submodel at any budget reads exactly a slice of the quantised parent. Hence a nested FP8
checkpoint (the FP8 parent and its scalars) slices like a BF16 one: the FP8 tensors of a
budget are slices of the nested ones, and the scales are the nested scales.

Under tensor parallelism a rank holds a block of each linear's weight; its scale is still the
whole logical tensor's (the blocks' amax reduced with MAX over the weight's own TP group), so every
rank quantises on one process's grid, and the nested checkpoint's codes (the joined weights
quantised with it) are the blocks' codes joined as `gather.py` joins the blocks.

The weights change only at the optimizer step, so the plugin runs each call of megatron's
schedule (one step's forward and backward passes over every micro-batch, or one evaluation)
inside `fixed_scales`: a linear's scale is computed (reduced) at its first read there and reused
by its other reads (micro-batches, budget groups, recomputation), then dropped. Outside it every
read recomputes the scale, so nothing can go stale.

On disk (`slicing.save_nested` with scales) every quantised weight is its FP8 codes under its own
key plus its scale under `<key>_fp8_scale`; the other tensors (embeddings, norms) keep their dtype.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Mapping, Optional, Sequence, Union

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from torch import nn

from megatron_ext.elastic.modules import full_tensor, set_transform, sliced
from megatron_ext.elastic.pipeline import chunks_of
from megatron_ext.platform.module_class_swap import is_registered

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
SCALE_SUFFIX = "_fp8_scale"


def quantized_linears(model: nn.Module) -> dict[str, nn.Module]:
    """The decoder's tensor-parallel linears with a weight, by state-dict prefix."""
    return {
        f"decoder.{name}": m
        for name, m in model.decoder.named_modules()
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear))
        and is_registered(m, "weight")
        and full_tensor(m, "weight") is not None
    }


def scale_of(weight: torch.Tensor, group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """The per-tensor scale amax / 448 of the whole logical tensor `weight` is a shard of: the amax
    reduced with MAX over `group`, the ranks it is sharded over (None: `weight` is whole). Collective
    over `group`."""
    amax = weight.detach().abs().amax().float()
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    return (amax / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)


def shard_group(module: nn.Module) -> dist.ProcessGroup:
    """The ranks a TP linear's weight is sharded over: its own TP group (an expert's is the expert
    tensor-parallel group, which need not be the dense layers')."""
    return module.tp_group


def quantize(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (weight.detach().float() / scale).to(FP8)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale).to(dtype)


def fake_quantize(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The FP8 value of `weight` in its own dtype, with the identity gradient (w - w is exactly
    zero, so the value is the dequantised one to the bit)."""
    return dequantize(quantize(weight, scale), scale, weight.dtype) + (weight - weight.detach())


class ReadScale:
    """The scale a linear's fake quantiser reads: its whole weight's, recomputed at every read, or
    inside `fixed_scales` computed at the first read and reused until the window closes."""

    def __init__(self, whole: torch.Tensor, group: dist.ProcessGroup) -> None:
        self.whole, self.group = whole, group
        self.fixed = False
        self.value: Optional[torch.Tensor] = None

    def __call__(self) -> torch.Tensor:
        if not self.fixed:
            return scale_of(self.whole, self.group)
        if self.value is None:
            self.value = scale_of(self.whole, self.group)
        return self.value


def enable(model: nn.Module) -> list[str]:
    """Read every decoder linear weight of `model` through the fake quantiser with the scale of
    the parent's whole tensor (the weights train: recomputed at each read, or once per
    `fixed_scales` window). Returns the keys."""
    keys = []
    for prefix, module in quantized_linears(model).items():
        scale = module.__dict__["_elastic_fp8_scale"] = ReadScale(full_tensor(module, "weight"), shard_group(module))
        set_transform(module, "weight", lambda w, scale=scale: fake_quantize(w, scale()))
        keys.append(f"{prefix}.weight")
    return keys


def disable(model: nn.Module) -> None:
    for module in quantized_linears(model).values():
        set_transform(module, "weight", None)
        module.__dict__.pop("_elastic_fp8_scale", None)


@contextmanager
def fixed_scales(model: Union[nn.Module, Sequence[nn.Module]]) -> Iterator[None]:
    """Within: every quantised linear of `model` (a module, or a rank's model chunks under virtual
    pipeline stages) computes its scale at its first read and reuses it (the caller guarantees the
    weights do not change inside: no optimizer step). The scales are collective under TP; the TP
    ranks read the same linears in the same order, so their first reads, the only ones that
    reduce, stay in step."""
    linears = [m for chunk in chunks_of(model) for m in quantized_linears(chunk).values()]
    readers = [m.__dict__["_elastic_fp8_scale"] for m in linears if "_elastic_fp8_scale" in m.__dict__]
    for r in readers:
        r.fixed, r.value = True, None
    try:
        yield
    finally:
        for r in readers:
            r.fixed, r.value = False, None


def scales(model: nn.Module) -> dict[str, torch.Tensor]:
    """The parent's per-tensor scales (of the whole logical tensors), by weight key: the same on
    every rank of a weight's TP group."""
    return {f"{p}.weight": scale_of(full_tensor(m, "weight"), shard_group(m)) for p, m in quantized_linears(model).items()}


def fp8_state(state: Mapping[str, torch.Tensor], scales: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state dict with the weights of `scales` stored as FP8 beside their scale
    (`<key>_fp8_scale`); the parent's scales for a submodel's (sliced) state."""
    unknown = [k for k in scales if k not in state]
    if unknown:
        raise ValueError(f"elastic fp8: no tensor {unknown[:3]} in the state to quantise")
    out = dict(state)
    for key, scale in scales.items():
        out[key] = quantize(state[key], scale)
        out[key + SCALE_SUFFIX] = scale.detach().clone()
    return out


def scales_in(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The per-tensor scales of an FP8 state dict, by the key of the weight they scale."""
    return {k[: -len(SCALE_SUFFIX)]: v for k, v in state.items() if k.endswith(SCALE_SUFFIX)}


def dequantized_state(state: Mapping[str, torch.Tensor], like: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An FP8 state dict with every FP8 tensor read back (codes times scale) in the dtype of
    `like`'s tensor of the same key (the model it loads into), and no scale entries: the weights
    the quantisation-aware student read."""
    found = scales_in(state)
    out = {k: v for k, v in state.items() if not k.endswith(SCALE_SUFFIX)}
    for key, scale in found.items():
        if key not in out or out[key].dtype != FP8:
            raise ValueError(f"elastic fp8: scale {key}{SCALE_SUFFIX} has no FP8 tensor {key}")
        out[key] = dequantize(out[key], scale, like[key].dtype)
    return out


@torch.no_grad()
def sliced_codes(model: nn.Module, codes: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """FP8 codes shaped like `model`'s quantised weights, cut as the model cuts those weights
    at its active sizes: the bytes themselves, not a requantisation (FP8 values are exact in
    fp32, so the cut goes through fp32 and back)."""
    linears = quantized_linears(model)
    out = {}
    for key, q in codes.items():
        module = linears.get(key.removesuffix(".weight"))
        if module is None or not key.endswith(".weight"):
            raise ValueError(f"elastic fp8: {key} is not a quantised decoder weight of the model")
        out[key] = sliced(q.float(), module.__dict__.get("_elastic_rules", {}).get("weight", [])).to(FP8)
    return out
