"""Checkpointing megatron's Float16OptimizerWithFloat16Params (bf16/fp16 without the distributed
optimizer) when the model also has fp32 parameters.

torch numbers an optimizer's per-parameter state by the position of each parameter in its
param groups. Float16OptimizerWithFloat16Params' groups hold, in the model's order, the fp32
main copy of every 16-bit parameter and, unchanged, every parameter that was fp32 already (here:
the norms, which torch builds in fp32; in megatron also e.g. a router's expert bias).
megatron-core 0.16's `sharded_state_dict` numbers the 16-bit parameters only, so the first fp32
one (or any state after it) matches no model tensor: `Param id N does not match any model
sharded param`, or the main copies are paired with the wrong tensors. Fixed upstream in
megatron-core 0.20 (Megatron-LM commit 86e928a); the fix applies to earlier versions only.

A save before the optimizer's first update (fp16 skips its first steps) first gives torch's
Adam its initial state (step 0, zero moments), as `torch_adam_checkpointing` does for the
distributed optimizer: the resume template asks for the moments.

A param group of fp32 parameters only (the norms, exempt from weight decay) has no main copies,
and dist_checkpointing cannot load a list of lists one of which is empty: it saves the empty one
as the first element of the list's non-tensor part, to be merged with the first group's tensors
(`Cannot merge two lists with different lengths`). So the main copies are saved by group index,
for the groups that have some, and handed to megatron's `load_state_dict` as its list again.
Not specific to CPU.
"""

from __future__ import annotations

import functools
import importlib
from typing import Optional

import torch
from packaging.version import Version

from megatron_ext.platform.adam_initial_state import materialise_initial_adam_state

FIXED_IN = Version("0.20.0")
MAIN_PARAMS = "fp32_from_fp16_params"  # megatron's key of the fp32 main copies


def fix_float16_optimizer_checkpoint() -> None:
    import megatron.core  # heavy: megatron, off the launcher (platform/launch.py imports cpu_compat)

    if Version(megatron.core.__version__) >= FIXED_IN:
        return
    optimizer = importlib.import_module("megatron.core.optimizer.optimizer")
    cls = optimizer.Float16OptimizerWithFloat16Params
    if getattr(cls.sharded_state_dict, "__fp32_params_fix__", False):
        return

    original_load_state_dict = cls.load_state_dict

    @functools.wraps(cls.sharded_state_dict)
    def sharded_state_dict(self, model_sharded_state_dict, is_loading: bool = False, metadata: Optional[dict] = None):
        if is_loading:
            self.init_state_fn(self.optimizer, self.config)
        elif isinstance(self.optimizer, (torch.optim.Adam, torch.optim.AdamW)):
            # Before the first update (fp16's first steps are skipped) torch's Adam has no state,
            # and a resume template (`init_state_fn`) asks for moments the checkpoint lacks.
            materialise_initial_adam_state(self.optimizer)
        return _sharded_state(self, self.state_dict(), model_sharded_state_dict)

    @functools.wraps(original_load_state_dict)
    def load_state_dict(self, state_dict):
        by_group = state_dict.get(MAIN_PARAMS)
        if isinstance(by_group, dict):
            groups = range(len(self.fp32_from_float16_groups))
            state_dict = {**state_dict, MAIN_PARAMS: [by_group.get(i, []) for i in groups]}
        return original_load_state_dict(self, state_dict)

    sharded_state_dict.__fp32_params_fix__ = True
    cls.sharded_state_dict = sharded_state_dict
    cls.load_state_dict = load_state_dict


def _sharded_state(opt, state_dict: dict, model_sharded_state_dict) -> dict:
    """`state_dict` (the optimizer's plain one) with its tensors as sharded tensors of the
    model's parameters, numbered as torch numbers them."""
    # heavy: megatron, off the launcher (platform/launch.py imports cpu_compat)
    from megatron.core.dist_checkpointing.optimizer import (
        get_param_id_to_sharded_param_map,
        make_sharded_optimizer_tensor,
        optim_state_to_sharding_state,
    )

    model_param_of_main = {
        id(main): model
        for models, mains in zip(opt.float16_groups, opt.fp32_from_float16_groups)
        for model, main in zip(models, mains)
    }
    groups = opt.optimizer.param_groups
    in_state_order = [model_param_of_main.get(id(p), p) for group in groups for p in group["params"]]
    sharded_param_of_id = get_param_id_to_sharded_param_map(model_sharded_state_dict, in_state_order)
    # Each group's main copies, in the order of `fp32_from_float16_groups`.
    main_params = {
        i: [
            make_sharded_optimizer_tensor(sharded_param_of_id[param_id], param, prefix="optimizer.state.fp32_param")
            for param_id, param in zip(saved_group["params"], group["params"])
            if id(param) in model_param_of_main
        ]
        for i, (saved_group, group) in enumerate(zip(state_dict["optimizer"]["param_groups"], groups))
    }
    state_dict[MAIN_PARAMS] = {i: params for i, params in main_params.items() if params}
    step = opt._extract_common_per_param_step(state_dict["optimizer"])
    # Every state tensor has its parameter's shape except `step`, saved once for all of them.
    optim_state_to_sharding_state(state_dict["optimizer"], sharded_param_of_id, exclude_keys="step")
    if step is not None:  # also step 0 (megatron's `if step:` drops it, and Adam then has none)
        state_dict["optimizer"]["state"]["common_step"] = step
    return state_dict
