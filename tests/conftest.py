"""Shared fixtures: a one-rank world in this process for tests that need megatron's parallel
state without starting workers."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

from megatron_ext.platform.launch import join_world


@pytest.fixture
def one_rank_world():
    """torch.distributed with one gloo rank and megatron's parallel state at TP=PP=1."""
    join_world("cpu")
    parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(1234)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
