"""`python -m megatron_ext.evaluation`: perplexity of a text file, the same in any layout."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from megatron_ext.evaluation.cli import text_perplexity
from megatron_ext.train import run_from_overrides

pytestmark = pytest.mark.distributed

TEXT = "import os\nimport sys\n\ndef main():\n    print(os.getcwd(), sys.argv)\n" * 4


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("evaluate")
    run_from_overrides(
        [
            "experiment=none",
            "logging.progress_bar=false",
            "model.seq_length=32",
            "train.iters=6",
            "train.eval_interval=0",
            "train.micro_batch_size=2",
            "train.global_batch_size=4",
            f"data.cache_dir={root / 'cache'}",
            f"checkpoint.save={root / 'ckpt'}",
        ]
    )
    return str(root / "ckpt")


def test_pipelined_perplexity_equals_single_rank(trained):
    single = text_perplexity(trained, TEXT, 32)
    assert 1.0 < single < 258  # better than uniform over the byte vocabulary after training
    assert text_perplexity(trained, TEXT, 32, pp=2) == pytest.approx(single, rel=1e-5)


def test_cli(trained, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    cmd = [sys.executable, "-m", "megatron_ext.evaluation", "--model", trained, "--text", str(text), "--seq-length", "32"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    ppl = float(out.stdout.split("perplexity ")[1].split()[0])
    assert math.isfinite(ppl) and ppl > 1.0
    missing = subprocess.run([*cmd[:-4], "--text", str(tmp_path / "none.txt")], capture_output=True, text=True)
    assert missing.returncode == 2 and "error:" in missing.stderr
