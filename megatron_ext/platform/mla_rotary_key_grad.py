"""Multi-latent attention's shared rotary key under tensor parallelism: its gradient summed over
the TP ranks.

MLA projects the hidden states down to the compressed keys/values and one rotary key
(`qk_pos_emb_head_dim` channels) that every head shares. On local layers the down-projection
is a ColumnParallelLinear: each TP rank computes a slice of its output columns and megatron-core
0.16 gathers them (`gather_from_tensor_model_parallel_region`, whose backward keeps this rank's
slice of the gradient) before splitting off the rotary key and broadcasting it to this rank's
heads. The compressed part's gradient is complete on every rank (the up-projection's
ColumnParallelLinear all-reduces its input gradient), but the rotary key's holds only this
rank's heads: the rank owning those columns drops the other ranks' heads' part, so the rotary
rows of the down-projection, and the hidden states below, get a wrong gradient. Summing the
rotary columns' gradient over the TP group right after the gather makes it the one-rank
gradient. Not specific to CPU.

The down-projection's output is marked by a forward hook, so that only the gather of that
tensor changes (MLA gathers the compressed query the same way, and its gradient is complete).
"""

from __future__ import annotations

import functools
import importlib

import torch

from megatron_ext.platform.versions import CHECKED

CHECKED_MEGATRON = CHECKED["mla_rotary_key_grad"]
# Set on a sharded down-projection output: how many of its gathered columns are the rotary key.
_ROTARY_CHANNELS = "_megatron_ext_rotary_key_channels"


def fix_mla_rotary_key_grad() -> None:
    import megatron.core  # heavy: megatron, off the launcher (platform/launch.py imports cpu_compat)

    if not CHECKED_MEGATRON.covers(megatron.core.__version__):
        return
    from megatron.core.utils import get_tensor_model_parallel_group_if_none  # as above: megatron, only when fixing

    mla = importlib.import_module("megatron.core.transformer.multi_latent_attention")
    gather = mla.gather_from_tensor_model_parallel_region
    if getattr(gather, "__rotary_key_grad__", False):
        return

    @functools.wraps(gather)
    def gather_from_tensor_model_parallel_region(input_, group=None):
        gathered = gather(input_, group)
        channels = getattr(input_, _ROTARY_CHANNELS, None)
        if channels is None:
            return gathered
        latent, rotary = gathered.split([gathered.size(-1) - channels, channels], dim=-1)
        group = get_tensor_model_parallel_group_if_none(group)
        return torch.cat([latent, SumGradOverGroup.apply(rotary, group)], dim=-1)

    gather_from_tensor_model_parallel_region.__rotary_key_grad__ = True
    mla.gather_from_tensor_model_parallel_region = gather_from_tensor_model_parallel_region
    _mark_down_projection_outputs(mla.MLASelfAttention)


class SumGradOverGroup(torch.autograd.Function):
    """Identity forward; backward: the gradient summed over `group`. (megatron's
    `copy_to_tensor_model_parallel_region` reduces a contiguous copy of a strided gradient and
    returns the gradient unreduced; the rotary key's arrives as a slice of the gathered one.)"""

    @staticmethod
    def forward(ctx, input_: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return input_.view_as(input_)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # A copy: the incoming gradient may view a buffer other branches read.
        summed = grad.clone(memory_format=torch.contiguous_format)
        torch.distributed.all_reduce(summed, group=ctx.group)
        return summed, None


def _mark_down_projection_outputs(cls: type) -> None:
    original_init = cls.__init__

    @functools.wraps(original_init)
    def __init__(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        self.linear_kv_down_proj.register_forward_hook(_mark_sharded_output)

    cls.__init__ = __init__


def _mark_sharded_output(module: torch.nn.Module, inputs: tuple, output: tuple) -> None:
    """Mark the down-projection's output when it is a TP slice (megatron gathers it then)."""
    config = module.config
    latent = output[0]
    if latent.size(-1) != config.kv_lora_rank + config.qk_pos_emb_head_dim:
        setattr(latent, _ROTARY_CHANNELS, config.qk_pos_emb_head_dim)
