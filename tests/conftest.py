"""Shared fixtures: a one-rank world in this process for tests that need megatron's parallel
state without starting workers."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

from megatron_ext.platform import cpu_compat
from megatron_ext.platform.launch import LaunchEnv, free_port, init_distributed


@pytest.fixture
def one_rank_world():
    """torch.distributed with one gloo rank and megatron's parallel state at TP=PP=1."""
    cpu_compat.apply()
    init_distributed(LaunchEnv(0, 1, 0, "127.0.0.1", free_port(), "local"), torch.device("cpu"))
    parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(1234)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
