"""Runs as Megatron-LM runs them: sized in samples, on megatron's mock data, and ending with an
evaluation on the validation and test sets."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from megatron.core.datasets.gpt_dataset import GPTDataset, MockGPTDataset
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from megatron_ext import pretrain_gpt
from megatron_ext.data import ByteTokenizer
from megatron_ext.train import run_from_overrides

pytestmark = pytest.mark.distributed

COMMON = [
    "experiment=none",
    "logging.progress_bar=false",
    "model.seq_length=32",
    "train.micro_batch_size=2",
    "train.global_batch_size=4",
]


def test_sample_based_run_trains_like_iteration_based_run(tmp_path):
    common = [*COMMON, "train.eval_interval=0", f"data.cache_dir={tmp_path / 'cache'}", "optim.lr_decay_style=linear"]
    by_iters = run_from_overrides([*common, "train.iters=6", "optim.lr_warmup_iters=2", "optim.lr_decay_iters=5"])
    # 27 samples: 6 whole global batches of 4, the partial seventh is not trained.
    by_samples = run_from_overrides(
        [*common, "train.train_samples=27", "optim.lr_warmup_samples=8", "optim.lr_decay_samples=20"]
    )
    assert len(by_samples["losses"]) == 6
    assert by_samples["losses"] == by_iters["losses"]


def test_mock_data_trains_within_the_vocabulary(tmp_path, monkeypatch):
    seen = []
    real_getitem = MockGPTDataset.__getitem__

    def recording(self, idx):
        sample = real_getitem(self, idx)
        seen.append(sample["tokens"])
        return sample

    monkeypatch.setattr(MockGPTDataset, "__getitem__", recording)
    cache = tmp_path / "cache"
    summary = run_from_overrides(
        [*COMMON, "train.iters=30", "optim.lr=1e-2", "train.eval_interval=0", "data.mock=true", f"data.cache_dir={cache}"]
    )
    assert len(seen) == 30 * 4
    vocab = ByteTokenizer().vocab_size
    assert 0 <= min(int(t.min()) for t in seen) and max(int(t.max()) for t in seen) < vocab
    assert len({int(v) for t in seen for v in t}) > vocab // 2  # megatron's mock ids cycle the vocabulary
    losses = summary["losses"]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 1.0  # each id's successor is learnable
    assert not (cache / "corpus").exists(), "mock data reads no corpus"


def test_final_evaluation_reads_eval_iters_batches_of_valid_and_test(tmp_path, monkeypatch):
    read = {"valid": [], "test": []}
    real_getitem = GPTDataset.__getitem__

    def recording(self, idx):
        if self.index_split.name in read:
            read[self.index_split.name].append(idx)
        return real_getitem(self, idx)

    monkeypatch.setattr(GPTDataset, "__getitem__", recording)
    tb, cache = tmp_path / "tb", tmp_path / "cache"
    # Periodic evaluation at 2 and 4; the final one at 5 evaluates again, then the test set.
    summary = run_from_overrides([
        *COMMON, "train.iters=5", "train.eval_interval=2", "train.eval_iters=3", "data.split='90,5,5'",
        f"data.cache_dir={cache}", f"logging.tensorboard_dir={tb}",
    ])
    one_round = list(range(3 * 4))  # eval_iters global batches, the same ones each time
    assert read["valid"] == one_round * 3
    assert read["test"] == one_round
    events = EventAccumulator(str(tb))
    events.Reload()
    assert [e.step for e in events.Scalars("eval/loss")] == [2, 4, 5]
    ((step, test_loss),) = [(e.step, e.value) for e in events.Scalars("test/loss")]
    assert step == 5 and summary["test_loss"] == pytest.approx(test_loss, rel=1e-6)
    assert summary["eval_loss"] == pytest.approx(events.Scalars("eval/loss")[-1].value, rel=1e-6)
    assert list((cache / "index").glob("*GPTDataset-test-*")), "the index cache is data.cache_dir's"


def test_run_stopped_early_has_no_final_evaluation(tmp_path):
    """Megatron-LM exits at --exit-interval without the final evaluation."""
    summary = run_from_overrides([
        *COMMON, "train.iters=4", "train.exit_interval=2", "train.eval_interval=3", "train.eval_iters=1",
        "data.split='90,5,5'", f"data.cache_dir={tmp_path / 'cache'}",
    ])
    assert len(summary["losses"]) == 2
    assert summary["eval_loss"] is None and summary["test_loss"] is None


def test_eval_iters_0_evaluates_nothing(tmp_path, capsys):
    """Megatron-LM's --eval-iters 0: no validation, periodic or final, and no test, so the
    split needs no held-out documents."""
    tb = tmp_path / "tb"
    summary = run_from_overrides([
        *COMMON, "train.iters=6", "train.eval_interval=2", "train.eval_iters=0", "data.split='100,0,0'",
        "logging.log_interval=2", f"data.cache_dir={tmp_path / 'cache'}", f"logging.tensorboard_dir={tb}",
    ])
    assert len(summary["losses"]) == 6
    assert summary["eval_loss"] is None and summary["test_loss"] is None
    printed = capsys.readouterr().out
    assert "iter      6/6" in printed and not re.search(r"^(eval|test) ", printed, re.M)
    events = EventAccumulator(str(tb))
    events.Reload()
    assert not [tag for tag in events.Tags()["scalars"] if tag.startswith(("eval/", "test/"))]


SKIP_TRAIN_RUN = """
    --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32
    --max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 4 --train-iters 4
    --lr 1e-3 --mock-data --tokenizer-type NullTokenizer --vocab-size 512
    --data-cache-path {cache} --eval-interval 4 --eval-iters 2 --log-interval 1
    --save {ckpt} --load {ckpt} --tensorboard-dir {tb} logging.progress_bar=false
"""


def _files(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_mtime_ns for p in folder.rglob("*")}


def test_skip_train_evaluates_the_loaded_checkpoint(tmp_path, capsys):
    """Megatron-LM's --skip-train: the checkpoint of --load is evaluated on --eval-iters
    batches of the validation and test sets, as the final evaluation of the run that saved it
    did; no step, no checkpoint and no TensorBoard scalars are written."""
    ckpt, tb = tmp_path / "ckpt", tmp_path / "tb"
    argv = shlex.split(SKIP_TRAIN_RUN.format(cache=tmp_path / "cache", ckpt=ckpt, tb=tb))
    pretrain_gpt.main(argv)
    trained = capsys.readouterr().out
    written = _files(ckpt), _files(tb)
    pretrain_gpt.main([*argv, "--skip-train"])
    evaluated = capsys.readouterr().out
    assert re.findall(r"^iter ", trained, re.M) and not re.findall(r"^iter ", evaluated, re.M)
    final = re.findall(r"^(?:eval|test)  iter +4 .*$", trained, re.M)
    assert len(final) == 2 and re.findall(r"^(?:eval|test)  iter +4 .*$", evaluated, re.M) == final
    assert (_files(ckpt), _files(tb)) == written
