"""bf16 and fp16 without the distributed optimizer (megatron's Float16OptimizerWithFloat16Params),
a GPT-3-style bf16 model with it, and GPT-3's dropout:
a run saved at step N and resumed goes on exactly as the run that was never interrupted, losses
and final checkpoint (weights, fp32 main copies, Adam moments) bitwise.

The model's norms stay fp32 in a 16-bit model, so the optimizer mixes fp32 main copies and fp32
parameters: platform/float16_optimizer_checkpoint.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tests.distributed._checkpoint_tensors import checkpoint_tensors

from megatron_ext.train import run_from_overrides

pytestmark = pytest.mark.distributed

COMMON = [
    "experiment=none",
    "train.eval_interval=0",
    "logging.progress_bar=false",
    "model.seq_length=64",
    "train.micro_batch_size=2",
    "train.global_batch_size=4",
    "parallel.use_distributed_optimizer=false",
]

# name -> (overrides, workers, iterations); saved halfway
CASES = {
    "bf16_dp1": (["model.precision=bf16"], 1, 6),
    "bf16_tp2": (["model.precision=bf16", "parallel.tp=2"], 2, 6),
    "bf16_pp2": (["model.precision=bf16", "parallel.pp=2"], 2, 6),
    # Two Float16 optimizers chained: the dense parameters' and the experts'.
    "bf16_moe_ep2": (["model.precision=bf16", "model=llama_moe_tiny", "parallel.ep=2", "parallel.dp=2"], 2, 4),
    # Saved while the loss scaler is still backing off from 2^32 (its first update is step 25
    # here), before any update: the resumed run reaches the same updates only with the
    # scaler's state restored.
    "fp16_dp1": (["model.precision=fp16"], 1, 40),
    # GPT-3 style: 16-bit biases beside the fp32 norms in the param group without weight decay,
    # with megatron's Float16 optimizer and with its distributed optimizer
    # (platform/distributed_optimizer_mixed_groups.py).
    "bf16_gpt3": (["model=gpt3_tiny", "model.precision=bf16", "model.hidden_dropout=0", "model.attention_dropout=0"], 1, 6),
    # Dropout (GPT-3's 0.1) draws from the restored generators: building the data iterator on
    # resume, and each evaluation's iterator, must not draw from them.
    "fp32_gpt3_dropout": (["model=gpt3_tiny", "train.eval_interval=2", "train.eval_iters=1"], 1, 6),
    "bf16_gpt3_distributed_optimizer": (
        ["model=gpt3_tiny", "model.precision=bf16", "model.hidden_dropout=0", "model.attention_dropout=0",
         "parallel.use_distributed_optimizer=true"],
        2,
        6,
    ),
}


def train(cache: Path, nproc: int, *overrides: str) -> list[float]:
    return run_from_overrides([*COMMON, f"data.cache_dir={cache}", f"launcher.nproc={nproc}", *overrides])["losses"]


# Beside the default suite (python -m pytest -m slow): the TP and PP layouts, the second
# distributed-optimizer case, and GPT-3's bf16 biases (fp32_gpt3_dropout resumes GPT-3 here).
# bf16_moe_ep2 is the default suite's two-rank resume and its one of megatron's ChainedOptimizer.
SLOW = {"bf16_pp2", "bf16_tp2", "bf16_gpt3_distributed_optimizer", "bf16_gpt3"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.slow] if n in SLOW else []) for n in CASES])
def test_save_and_resume_is_bitwise(name, tmp_path):
    overrides, nproc, iters = CASES[name]
    saved_at = iters // 2
    overrides = [*overrides, f"train.iters={iters}"]
    cache, whole, resumed = tmp_path / "cache", tmp_path / "whole", tmp_path / "resumed"
    losses = train(cache, nproc, *overrides, f"checkpoint.save={whole}", f"checkpoint.interval={saved_at}")
    continued = train(
        cache, nproc, *overrides, f"checkpoint.load={whole}", f"checkpoint.step={saved_at}", f"checkpoint.save={resumed}"
    )
    assert continued == losses[saved_at:]  # exact float equality
    expected = checkpoint_tensors(whole, iters, tmp_path / "whole.pt")
    got = checkpoint_tensors(resumed, iters, tmp_path / "resumed.pt")
    if any(o in overrides for o in ("model.precision=bf16", "model.precision=fp16")):
        # The fp32 main copies are compared too (the Float16 optimizer's and the distributed one's keys).
        assert any(".fp32_param." in k or k.startswith("optimizer.state.param.") for k in expected)
    assert expected.keys() == got.keys()
    for key, tensor in expected.items():
        assert torch.equal(tensor, got[key]), key
