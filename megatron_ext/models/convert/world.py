"""The process world a conversion runs in, and the model stage it builds there.

Conversions use megatron's own model (and its sharded-state-dict metadata), so they need what
training needs: a torch.distributed world, megatron's parallel state and the CPU compatibility
layer. Import runs in tp*pp local workers; export in a world of one in this process.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

from megatron_ext.config.schema import ModelConfig, ParallelConfig
from megatron_ext.models.arch import architecture
from megatron_ext.platform.device import current_device
from megatron_ext.platform.launch import join_world


@contextmanager
def model_parallel_world(tp: int = 1, pp: int = 1) -> Iterator[None]:
    """Join the world an outside launcher made (or a world of one), with megatron's parallel
    state at tp x pp; left again on exit. An already initialised torch.distributed world is used
    as it is, but megatron's parallel state must be free (this sets it and tears it down)."""
    if parallel_state.model_parallel_is_initialized():
        raise RuntimeError("megatron's parallel state is already initialised in this process")
    owns_world = not dist.is_initialized()
    if owns_world:
        join_world()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    # Megatron's attention and dropout fork this tracker even when nothing is random.
    model_parallel_cuda_manual_seed(0)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        if owns_world:
            dist.destroy_process_group()


def build_model(cfg: ModelConfig, padded_vocab: int) -> list:
    """This rank's pipeline stage of the model for `cfg` (GPT or hybrid, `cfg.arch`), as a one-chunk list, with weights
    left uninitialised: every one of them is loaded next (`load_logical` checks that)."""
    on_cpu = current_device().type == "cpu"
    parallel = ParallelConfig(
        tp=parallel_state.get_tensor_model_parallel_world_size(),
        pp=parallel_state.get_pipeline_model_parallel_world_size(),
    )
    arch = architecture(cfg)
    config = arch.transformer_config(cfg, parallel, on_cpu)
    config.perform_initialization = False  # drawing random weights to overwrite them is waste
    model = arch.build(
        cfg,
        config,
        arch.spec(cfg, on_cpu),
        padded_vocab,
        pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=True),
        post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=True),
    )
    return [model.to(current_device())]
