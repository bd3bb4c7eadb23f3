"""What every worker imports (the forkserver preloads the Trainer's module) leaves out the heavy
packages only some runs use: transformers (about 1 s here; megatron's tokenizers.text package
imports it) is loaded by a run that reads or writes a Hugging Face model, not by every worker."""

from __future__ import annotations

import subprocess
import sys


def test_the_trainer_does_not_import_transformers():
    code = "import megatron_ext.training.trainer, sys; print(sorted(m for m in sys.modules if m.split('.')[0] == 'transformers'))"
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "[]"
