"""Megatron's parallel state as a value: a layout's groups held beside the running layout's.

megatron-core keeps its parallel state (every process group, rank list and cached size) in the
private globals of `megatron.core.parallel_state` (`_TENSOR_MODEL_PARALLEL_GROUP`, ...), and its
list of created groups in `_global_process_group_list`. This module is the one place that reads
or writes them (checked with the megatron-core of `versions.CHECKED["megatron_parallel_state"]`):

- `private_parallel_state()`: a fresh copy of the module, whose `initialize_model_parallel`
  fills its own globals and leaves megatron's alone;
- `process_groups(state)`: megatron's ProcessGroupCollection of such a copy;
- `install(state)`: the copy's state becomes megatron's;
- `created_groups(state)`: the groups a parallel state created (megatron only forgets most of
  them at `destroy_model_parallel`).
"""

from __future__ import annotations

import importlib.util
import re
import types

from megatron.core import parallel_state
from megatron.core.process_groups_config import ProcessGroupCollection

# parallel_state's state: every module global named like _TENSOR_MODEL_PARALLEL_GROUP, and the
# list of groups it created.
_STATE_NAME = re.compile(r"^_[A-Z][A-Z0-9_]*$")
_GROUP_LIST = "_global_process_group_list"


def private_parallel_state() -> types.ModuleType:
    """A fresh copy of megatron's parallel_state module, with globals of its own."""
    spec = importlib.util.find_spec(parallel_state.__name__)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def process_groups(state: types.ModuleType) -> ProcessGroupCollection:
    """Megatron's ProcessGroupCollection of the layout in `state`. Megatron's own
    `use_mpu_process_groups` maps each field to its parallel_state getter; it is run here
    against `state` instead of the global module."""
    method = ProcessGroupCollection.use_mpu_process_groups.__func__
    rebound = types.FunctionType(
        method.__code__, {**method.__globals__, "parallel_state": state}, method.__name__, method.__defaults__
    )
    return rebound(ProcessGroupCollection)


def install(state: types.ModuleType) -> list:
    """Make `state` megatron's parallel state (megatron's own must be empty: its layout left).
    Returns what megatron's globals held before, some of which megatron leaves set: the caller
    drops them."""
    if parallel_state.model_parallel_is_initialized():
        raise RuntimeError("megatron parallel state: leave the running layout before installing another")
    replaced = []
    for name, value in vars(state).items():
        if _STATE_NAME.match(name) or name == _GROUP_LIST:
            replaced.append(getattr(parallel_state, name, None))
            setattr(parallel_state, name, value)
    return replaced


def created_groups(state: types.ModuleType = parallel_state) -> list:
    """The process groups `state` (megatron's own by default) has created."""
    return list(getattr(state, _GROUP_LIST) or ())
