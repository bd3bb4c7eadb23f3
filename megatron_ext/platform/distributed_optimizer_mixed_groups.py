"""Checkpointing megatron's DistributedOptimizer when one param group mixes fp32 and 16-bit
parameters.

The optimizer's param groups list, per group, the shards of the fp32 parameters first and then
the fp32 main copies of the 16-bit ones. megatron-core 0.16 records each parameter's place in
its group (`model_param_group_index_map`) in the model's order instead, and reads the main copy
and Adam moments of a parameter at that place when it saves or loads a checkpoint. Where a group
holds both kinds — a bf16/fp16 model whose norms torch builds in fp32 and whose biases, learned
softmax offsets or position table are 16-bit, all exempt from weight decay — a parameter gets
another one's state: `The size of tensor a (512) must match the size of tensor b (128)`, or, for
equal sizes, silently the wrong tensor. Megatron-LM itself casts every parameter to 16 bits
(Float16Module), so its groups never mix. Training is unaffected (its copies go through the
per-kind lists); only the map is rebuilt, in the optimizer's own order. Not specific to CPU.
"""

from __future__ import annotations

import functools
import importlib

from megatron_ext.platform.versions import CHECKED

# Checked against megatron-core 0.16; upstream's order is unchanged in later sources.
CHECKED_MEGATRON = CHECKED["distributed_optimizer_mixed_groups"]


def fix_distributed_optimizer_mixed_groups() -> None:
    import megatron.core  # heavy: megatron, off the launcher (platform/launch.py imports cpu_compat)

    if not CHECKED_MEGATRON.covers(megatron.core.__version__):
        return
    cls = importlib.import_module("megatron.core.optimizer.distrib_optimizer").DistributedOptimizer
    if getattr(cls.__init__, "__mixed_groups_fix__", False):
        return
    original_init = cls.__init__

    @functools.wraps(original_init)
    def __init__(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        self.model_param_group_index_map = param_places(self.model_fp32_groups, self.model_float16_groups)

    __init__.__mixed_groups_fix__ = True
    cls.__init__ = __init__


def param_places(fp32_groups: list[list], float16_groups: list[list]) -> dict:
    """Each model parameter's (group, position) in the optimizer's param groups: a group's fp32
    parameters first, then its 16-bit ones, each kind in the model's order."""
    places = {}
    for group, (fp32, float16) in enumerate(zip(fp32_groups, float16_groups)):
        for order, param in enumerate([*fp32, *float16]):
            places[param] = (group, order)
    return places
