"""Megatron's model and DDP buffers for one rank of any layout, built in this process for free.

Megatron-Core 0.16 has no pure function for "which box / which flat range does rank r hold":
the answers come out of building `GPTModel` (sharded state dict: boxes) and
`DistributedDataParallel` (param-and-grad buffer: bucket layout, 64-element alignment, bucket
padding), inside that rank's process groups. So that any rank can know every rank's state in
any layout without those processes existing, the real classes are built here with
  - the meta device (platform/fake_build.py `on_meta`): tensors carry shape, stride and
    storage offset but no memory, so a 20-layer stage of a 70B model costs what a 1-parameter
    one does;
  - fake process groups (torch's no-op backend, platform/fake_build.py) that answer rank()/size() for the rank's
    position, taken from megatron's RankGenerator (see layout.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from typing import Iterator

import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.process_groups_config import ProcessGroupCollection

from megatron_ext.config.schema import ModelConfig
from megatron_ext.models.gpt import (
    build_gpt_model,
    layer_spec,
    transformer_config,
    use_transformer_engine,
)
from megatron_ext.platform import cpu_compat
from megatron_ext.platform.device import current_device
from megatron_ext.parallel.ddp import wrap_in_ddp
from megatron_ext.parallel.layout import ParallelLayout
from megatron_ext.platform.fake_build import fake_group, on_meta

# ProcessGroupCollection field -> (megatron group token, from the expert rank generator?).
GROUPS = {
    "tp": ("tp", False),
    "pp": ("pp", False),
    "cp": ("cp", False),
    "mp": ("tp-pp", False),
    "tp_cp": ("tp-cp", False),
    "tp_dp_cp": ("tp-dp-cp", False),
    "dp": ("dp", False),
    "dp_cp": ("dp-cp", False),
    "intra_dp_cp": ("dp-cp", False),
    "ep": ("ep", True),
    "expt_tp": ("tp", True),
    "tp_ep": ("tp-ep", True),
    "tp_ep_pp": ("tp-ep-pp", True),
    "expt_dp": ("dp", True),
    "intra_expt_dp": ("dp", True),
}


@dataclasses.dataclass
class Skeleton:
    """One rank's model chunks (one per virtual stage) and their DDP wrappers, on the meta device."""

    chunks: list
    ddp: list
    groups: ProcessGroupCollection


def process_groups(layout: ParallelLayout, rank: int) -> ProcessGroupCollection:
    """Every group megatron's model and DDP ask for, as fakes positioned like `rank`'s."""
    groups = ProcessGroupCollection()
    for field, (token, expert) in GROUPS.items():
        index, size = layout.group_position(rank, token, expert)
        setattr(groups, field, fake_group(index, size))
    # Megatron asks torch which ranks the embedding group has, and torch only knows registered
    # groups. The group only keeps the tied output copy's values in sync; it places nothing.
    groups.embd = None
    groups.pos_embd = None
    return groups


@contextlib.contextmanager
def standalone_world() -> Iterator[None]:
    """What megatron's model code needs besides explicit groups, in a process that has none.

    Megatron treats an uninitialised torch.distributed as a world of size 1 and then ignores the
    groups it is given (`get_pg_size`), and 0.16's tied-embedding state dict reads the global DP
    rank for a replica id. A one-rank gloo world on an in-memory store and megatron's trivial
    parallel state stand in, and are torn down afterwards. Inside a job both already exist; their
    values do not reach the skeleton's layout.
    """
    own_world, excepthook = not dist.is_initialized(), sys.excepthook
    if own_world:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    own_state = not parallel_state.model_parallel_is_initialized()
    if own_state:
        if dist.get_world_size() > 1:
            raise RuntimeError("reshard: initialise megatron's parallel state before planning")
        parallel_state.initialize_model_parallel()
    try:
        yield
    finally:
        if own_state:
            parallel_state.destroy_model_parallel()
        if own_world:
            dist.destroy_process_group()
            sys.excepthook = excepthook  # init_process_group wraps it with a "[rank0]:" prefix


def build_skeleton(model: ModelConfig, layout: ParallelLayout, rank: int) -> Skeleton:
    """`rank`'s megatron model chunks and DDP wrappers in `layout`, on the meta device.

    `model.vocab_size` is the run's padded vocabulary. Call inside `standalone_world()`.
    """
    if model.vocab_size is None:
        raise ValueError("reshard: model.vocab_size must be the run's padded vocabulary size")
    on_cpu = current_device().type == "cpu"
    cpu_compat.apply(on_cpu)  # DDP allocates its buffers on torch.cuda.current_device()
    groups = process_groups(layout, rank)
    config = transformer_config(model, layout.to_config(), on_cpu)
    config.perform_initialization = False  # values are not needed, only where they live
    spec = layer_spec(model, use_transformer_engine(model, on_cpu))
    pp_rank, pp, vpp = groups.pp.rank(), layout.pp, layout.vpp or 1
    with on_meta():
        chunks = [
            build_gpt_model(
                model,
                config,
                spec,
                model.vocab_size,
                pre_process=pp_rank == 0 and stage == 0,
                post_process=pp_rank == pp - 1 and stage == vpp - 1,
                vp_stage=stage if layout.vpp else None,
                pg_collection=groups,
            )
            for stage in range(vpp)
        ]
        ddp = wrap_in_ddp(config, layout.to_config(), chunks, groups)  # as the Trainer wraps its model
    return Skeleton(chunks, ddp, groups)
