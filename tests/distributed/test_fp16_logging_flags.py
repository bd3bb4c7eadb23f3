"""fp16 with every Megatron-LM logging flag that maps to a `logging.*` key, through
`python -m megatron_ext.pretrain_gpt`, over the steps the loss scaler skips.

The command line is Megatron-LM's functional tests gpt3_mcore_tp1_pp2_fp16 /
gpt3_mcore_tp2_pp2_uninstall_te, shrunk (layers, hidden, heads, sequence, batches, iterations,
eval interval) and on megatron's mock data. At the initial loss scale 2^32 the first 22 steps of
this model overflow in fp16: megatron's optimizer returns no grad norm and no zero count for
them, and Megatron-LM's training_log leaves both out of the log line, TensorBoard and W&B; so
must we, and train on to the steps that update.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from megatron_ext.config.mlm_flags import FLAGS, MAPPED

pytestmark = pytest.mark.distributed

ITERS = 25  # 22 skipped steps, then three that update
GPT3_FP16 = """
    --num-layers 2 --hidden-size 64 --num-attention-heads 4
    --micro-batch-size 2 --global-batch-size 4 --seq-length 32 --max-position-embeddings 32
    --train-iters {iters} --timing-log-level 0 --lr-decay-iters 320000
    --mock-data --tokenizer-type NullTokenizer --vocab-size 512 --data-cache-path {cache}
    --split 949,50,1 --distributed-backend nccl --lr 0.00015 --lr-decay-style cosine
    --min-lr 1.0e-5 --weight-decay 1e-2 --clip-grad 1.0 --lr-warmup-fraction .01
    --eval-interval 2 --eval-iters 1 --transformer-impl local
    --tensor-model-parallel-size {tp} --pipeline-model-parallel-size {pp}
    --deterministic-mode --no-gradient-accumulation-fusion --use-mcore-models
    --fp16 --apply-query-key-layer-scaling --initial-loss-scale 4294967296
    logging.progress_bar=false
"""
# The value given to each logging flag that takes one; switches are given alone.
VALUES = {"--log-interval": "1", "--tensorboard-dir": "{tb}", "--wandb-project": "fp16-skips"}

# W&B is an optional extra: a stand-in that keeps what is logged and, as a chart has no point
# for it, refuses a value that is not a number (a skipped step's None grad norm).
WANDB_STUB = '''
import json, numbers, os

class _Run:
    def log(self, data, step=None):
        odd = {k: v for k, v in data.items() if not isinstance(v, numbers.Real)}
        if odd:
            raise TypeError(f"wandb stub: not numbers: {odd}")
        with open(os.environ["WANDB_STUB_LOG"], "a") as f:
            f.write(json.dumps({"step": step, **data}) + "\\n")

    def finish(self):
        pass

def init(project=None, **kwargs):
    return _Run()
'''

# name -> (tp, pp, workers)
LAYOUTS = {
    "tp1_pp1": pytest.param((1, 1, 1)),
    "tp1_pp2": pytest.param((1, 2, 2), marks=pytest.mark.slow),
    "tp2_pp2": pytest.param((2, 2, 4), marks=pytest.mark.slow),
}


def _logging_flags() -> list[str]:
    """Every flag of the table that maps to a logging.* key, with its value."""
    rows = [f for f in FLAGS if f.status == MAPPED and f.target.startswith("logging.")]
    missing = [f.name for f in rows if not f.is_switch and f.name not in VALUES]
    assert not missing, f"give these logging flags a value in VALUES: {missing}"
    return [arg for f in rows for arg in ([f.name] if f.is_switch else [f.name, VALUES[f.name]])]


def _run(tmp_path: Path, tp: int, pp: int, workers: int) -> subprocess.CompletedProcess:
    stub = tmp_path / "stub" / "wandb"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text(WANDB_STUB)
    paths = {"iters": ITERS, "cache": tmp_path / "cache", "tb": tmp_path / "tb", "tp": tp, "pp": pp}
    argv = shlex.split(" ".join([GPT3_FP16, *_logging_flags()]).format(**paths))
    env = {
        **os.environ, "OMP_NUM_THREADS": "1", "WANDB_STUB_LOG": str(tmp_path / "wandb.jsonl"),
        "PYTHONPATH": os.pathsep.join([str(stub.parent), os.environ.get("PYTHONPATH", "")]),
    }
    cmd = [sys.executable, "-m", "megatron_ext.pretrain_gpt", *argv, "--nproc", str(workers)]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_every_logging_flag_logs_fp16_steps_the_loss_scaler_skips(tmp_path, layout):
    done = _run(tmp_path, *layout)
    assert done.returncode == 0, done.stderr[-3000:]
    skipped = {int(n) for n in re.findall(r"iteration (\d+) skipped:", done.stdout)}
    updated = set(range(1, ITERS + 1)) - skipped
    assert {1, 2} <= skipped and updated, skipped  # eval at 2, a skipped step
    lines = _log_lines(done.stdout)
    assert sorted(lines) == list(range(1, ITERS + 1))
    for step, line in lines.items():
        assert ("grad norm" in line) == ("num zeros" in line) == (step in updated), line
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    for tag in ("train/grad_norm", "train/num_zeros_in_grad"):
        assert {e.step for e in events.Scalars(tag)} == updated, tag
    assert [e.step for e in events.Scalars("eval/ppl")][:2] == [2, 4]
    logged = [json.loads(row) for row in (tmp_path / "wandb.jsonl").read_text().splitlines()]
    assert {r["step"] for r in logged if "train/grad_norm" in r} == updated


def _log_lines(stdout: str) -> dict[int, str]:
    """The log line of each step, by iteration."""
    return {int(m.group(1)): m.group(0) for m in re.finditer(r"iter\s+(\d+)/\d+ \|[^\n]*", stdout)}
