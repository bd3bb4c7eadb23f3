"""A LoRA job's own data (lora/datasets.py): SFT files, folders and weighted mixes; the loss on
the assistant's tokens; a validation split by conversation; the lengths the planner sees; bad
specs and broken records refused, naming the job, before anything trains.

The references are the records' own text: with the byte tokenizer and the chatml format a
conversation's tokens are the UTF-8 bytes of its ChatML text, written out here by hand, so
the tokens the loss falls on must spell each answer and its end-of-turn marker.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import pytest

from megatron_ext.config import compose_config
from megatron_ext.config.sweep import read_sweep
from megatron_ext.config.validate import ConfigError
from megatron_ext.data import ByteTokenizer
from megatron_ext.lora.datasets import SweepData, parse
from megatron_ext.lora.planning.costmodel import LinearCostModel
from megatron_ext.lora.planning.memory import FP32, MemoryModel
from megatron_ext.lora.planning.workload import shapes_of
from megatron_ext.lora.sweep import CPU_COEFFICIENTS, jobs_of, multirun_jobs, plan_sweep, run_sweep

VOCAB = ByteTokenizer().vocab_size
PAD = ByteTokenizer().pad
END = "<|im_end|>"


def chatml(question: str, answer: str) -> str:
    return f"<|im_start|>user\n{question}{END}\n<|im_start|>assistant\n{answer}{END}\n"


def qa(prefix: str, n: int, words: int) -> list[tuple[str, str]]:
    """`n` question / answer pairs; answers of `words` words (plus the pair's number)."""
    return [(f"{prefix} question {i}?", " ".join([f"{prefix}{i}"] + ["word"] * words)) for i in range(n)]


def write_jsonl(path: Path, pairs: list[tuple[str, str]], messages: bool = False) -> Path:
    records = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]} if messages
               else {"prompt": q, "completion": a} for q, a in pairs]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def config(tmp_path: Path, dataset: str, *overrides: str):
    return compose_config([
        "experiment=lora_sweep", "model=llama_tiny", "model.seq_length=128", f"model.vocab_size={VOCAB}",
        f"lora.dataset={dataset}", "train.iters=4", "train.micro_batch_size=2", "train.global_batch_size=4",
        "lora.memory_gb=1", "lora.eval_iters=2", "data.split='75,25,0'", "data=sft", "data.sft.path=[]", "data.sft.prompt_format=chatml",
        f"data.cache_dir={tmp_path / 'cache'}", f"lora.output_dir={tmp_path / 'out'}", *overrides,
    ])


def sweep_data(cfg) -> SweepData:
    return SweepData(cfg, ByteTokenizer(), VOCAB, jobs_of(cfg))


def samples(batches) -> list[tuple[str, str]]:
    """(the sample's text: inputs and the last label, the padding left out; the text of the
    labels the loss counts) of every sample of `batches`."""
    found = []
    for mb in batches:
        assert mb.tokens.shape == mb.labels.shape == mb.loss_mask.shape
        assert (mb.tokens[:, 1:] == mb.labels[:, :-1]).all()
        for tokens, labels, mask in zip(mb.tokens, mb.labels, mb.loss_mask):
            text = bytes(t for t in tokens.tolist() + labels[-1:].tolist() if t < 256).decode()
            found.append((text, bytes(labels[mask.bool()].tolist()).decode()))
    return found


def test_the_loss_falls_on_the_answers_and_validation_keeps_its_own_conversations(tmp_path):
    pairs = qa("a", 12, 3) + qa("b", 12, 9)  # two lengths: a micro-batch pads to its longest
    cfg = config(tmp_path, str(write_jsonl(tmp_path / "data.jsonl", pairs)))
    data = sweep_data(cfg).data_for(jobs_of(cfg)[0])
    answers = {chatml(q, a): a + END for q, a in pairs}
    train, valid = samples(data.train()), samples(data.eval())
    assert len(train) == 4 * 4 and len(valid) == 2 * 2  # steps x global batch; eval_iters x micro-batch
    for text, labelled in train + valid:
        assert labelled == answers[text]
    for mb in [*data.train(), *data.eval()]:  # padded to its longest sample, no loss on the padding
        assert int((mb.tokens != PAD).sum(dim=1).max()) == mb.tokens.shape[1]
        assert (mb.loss_mask[mb.labels == PAD] == 0).all()
        assert mb.tokens.shape[1] == max(len(text.encode()) for text, _ in samples([mb])) - 1
    assert len({mb.tokens.shape[1] for mb in data.train()}) > 1
    # data.split 75/25 holds out 6 of the 24, never trained on; eval_iters=2 micro-batches of 2 validate on 4
    assert "18 to train on, 6 to validate on" in sweep_data(cfg).notes[0]
    assert len({text for text, _ in valid}) == 4 and not {text for text, _ in valid} & {text for text, _ in train}


def test_a_weighted_mix_trains_on_each_file_by_its_weight(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", qa("a", 8, 2))
    b = write_jsonl(tmp_path / "b.jsonl", qa("b", 8, 2), messages=True)
    cfg = config(tmp_path, f"'3 {a} 1 {b}'", "train.iters=8")
    trained = Counter(text[text.index("user\n") + 5] for text, _ in samples(sweep_data(cfg).data_for(jobs_of(cfg)[0]).train()))
    assert trained == {"a": 24, "b": 8}
    validated = Counter(text[text.index("user\n") + 5] for text, _ in samples(sweep_data(cfg).data_for(jobs_of(cfg)[0]).eval()))
    assert set(validated) <= {"a", "b"} and sum(validated.values()) == 4


def test_a_folder_and_several_files_are_one_dataset(tmp_path):
    (tmp_path / "folder").mkdir()
    a = write_jsonl(tmp_path / "folder" / "a.jsonl", qa("a", 8, 2))
    b = write_jsonl(tmp_path / "folder" / "b.jsonl", qa("b", 8, 2))
    by_folder = sweep_data(config(tmp_path, str(tmp_path / "folder")))
    by_files = sweep_data(config(tmp_path, f"'{a} {b}'"))
    job = by_folder.jobs[0]
    assert samples(by_folder.data_for(job).train()) == samples(by_files.data_for(job).train())
    assert parse(f"{a} {b}").weights is None and parse(f"0.5 {a} 2 {b}").weights == (0.5, 2.0)


def test_a_multirun_over_files_makes_a_job_of_each(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", qa("a", 8, 2))
    b = write_jsonl(tmp_path / "b.jsonl", qa("b", 8, 2))
    sweep = read_sweep(["-m", "experiment=lora_sweep", "model=llama_tiny", f"lora.dataset={a},{b}", "lora.rank=4,8"])
    _, jobs = multirun_jobs(sweep, compose_config(sweep.combinations[0]))
    assert sorted((j.dataset, j.rank) for j in jobs) == [(str(a), 4), (str(a), 8), (str(b), 4), (str(b), 8)]
    for job in jobs:  # each job's outputs are one folder of lora.output_dir
        assert "/" not in job.name and job.name.endswith(f"{Path(job.dataset).name}-rank{job.rank}")


def test_the_planner_sees_the_tokens_each_job_really_holds(tmp_path):
    """The lengths measured from the data, not seq_length: the mean sample of the job's micro-
    batches (one a micro-batch here, one epoch) and its longest; a pass then costs and holds
    what a job of that seq_length would."""
    pairs = qa("a", 8, 1) + qa("b", 8, 7)  # two lengths whose mean is a whole number
    path = write_jsonl(tmp_path / "short.jsonl", pairs)
    cfg = config(tmp_path, str(path), "model.seq_length=256", "data.split='100,0,0'", "lora.eval_iters=0",
                 "train.micro_batch_size=1", "train.global_batch_size=4", "train.iters=8", "lora.max_pass_tokens=null",
                 "lora.jobs=[{name: a}, {name: b}, {name: c}, {name: d}]", "lora.memory_gb=0.03")
    nominal = jobs_of(cfg)
    measured = sweep_data(cfg).jobs
    lengths = [len(chatml(*p).encode()) - 1 for p in pairs]
    assert all(j.mean_tokens == sum(lengths) / len(lengths) and j.longest_tokens == max(lengths) for j in measured)
    assert all(j.tokens_per_sample == j.longest_sample == 256 for j in nominal)

    shapes = shapes_of(cfg.model)
    job, at_mean, at_longest = measured[0], nominal[0].replace(seq_length=sum(lengths) // len(lengths)), nominal[0].replace(seq_length=max(lengths))
    cost, memory = LinearCostModel(shapes, CPU_COEFFICIENTS), MemoryModel(shapes, FP32, fused_attention=False)
    assert cost.pass_time([job], 1, 1) == cost.pass_time([at_mean], 1, 1) < cost.pass_time([nominal[0]], 1, 1)
    assert memory.per_device([job] * 2, 1, 1) == memory.per_device([at_longest] * 2, 1, 1)
    # 0.03 GiB holds one of the nominal jobs at a time, all four of the measured ones
    planned, as_nominal = plan_sweep(cfg, measured), plan_sweep(cfg, nominal)
    assert [p.slots for p in as_nominal.plan.packs] == [1] and [p.slots for p in planned.plan.packs] == [4]
    assert planned.makespan < as_nominal.makespan / 2


@pytest.mark.parametrize(
    "dataset,message",
    [
        ("task:poems", "unknown task 'poems'"),
        ("'0.7 {a} {b}'", r"a weighted mix alternates weights and paths"),
        ("'-1 {a} 2 {b}'", r"the weights of a mix must be positive numbers, got \[-1.0, 2.0\]"),
        ("{missing}", r"{missing}: no such file or folder"),
        ("{empty}", r"{empty}: no .jsonl/.json/.parquet files in this folder"),
        ("{text}", r"{text}: not SFT data"),
    ],
    ids=["task", "weightless-part", "negative-weight", "missing", "empty-folder", "not-sft"],
)
def test_a_bad_dataset_is_refused_naming_the_job_before_anything_starts(tmp_path, dataset, message):
    files = {"a": write_jsonl(tmp_path / "a.jsonl", qa("a", 8, 2)), "b": write_jsonl(tmp_path / "b.jsonl", qa("b", 8, 2)),
             "missing": tmp_path / "missing.jsonl", "empty": tmp_path / "empty", "text": tmp_path / "notes.txt"}
    files["empty"].mkdir()
    files["text"].write_text("hello\n")
    cfg = config(tmp_path, "synthetic", f"lora.jobs=[{{name: good}}, {{name: bad, dataset: {dataset.format(**files)}}}]")
    escaped = {name: re.escape(str(path)) for name, path in files.items()}
    with pytest.raises(ConfigError, match=f"^lora: job 'bad': dataset .*: {message.format(**escaped)}") as refused:
        run_sweep(cfg, jobs_of(cfg))
    assert "\n" not in str(refused.value) and "'good'" not in str(refused.value)
    assert not (tmp_path / "out").exists() and not (tmp_path / "cache").exists()


def test_a_broken_record_is_refused_as_file_and_line_before_anything_trains(tmp_path):
    good = write_jsonl(tmp_path / "good.jsonl", qa("a", 8, 2))
    broken = write_jsonl(tmp_path / "broken.jsonl", qa("b", 8, 2))
    lines = broken.read_text().splitlines()
    broken.write_text("\n".join(lines[:2] + ['{"prompt": "cut short'] + lines[3:]) + "\n")
    cfg = config(tmp_path, str(good), f"lora.jobs=[{{name: good}}, {{name: bad, dataset: {broken}}}]")
    where = re.escape(str(broken))
    with pytest.raises(ConfigError, match=rf"^lora: job 'bad', dataset '{where}': {where}:3: not a JSON object"):
        run_sweep(cfg, jobs_of(cfg))
    assert not (tmp_path / "out").exists()
