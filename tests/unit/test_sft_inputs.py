"""SFT input through the command line: broken data files end in one line naming file:line,
exit 2, before any worker starts and with nothing written; Megatron-LM's --sft flags become the
`data=sft` config."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_ext.config.mlm_args import MlmArgsError, translate
from megatron_ext.train import main

REPO = Path(__file__).resolve().parents[2]
GOOD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
# (lines of the file, the line named, what the message says)
BROKEN = {
    "not_json": (["{oops"], 1, "not a JSON object"),
    "no_messages": ([GOOD, {"text": "hi"}], 2, "no 'messages'"),
    "unknown_role": ([{"messages": [{"role": "robot", "content": "x"}]}], 1, "has role 'robot'"),
    "no_assistant_turn": ([GOOD, GOOD, {"messages": [{"role": "user", "content": "hi"}]}], 3, "no assistant turn"),
    "longer_than_a_sample": ([GOOD, {"prompt": "q", "completion": "a" * 300}], 2, "more than a sample's 129"),
}


def _run(tmp_path: Path, lines: list, *extra: str) -> list[str]:
    data = tmp_path / "chat.jsonl"
    data.write_text("\n".join(json.dumps(x) if isinstance(x, dict) else x for x in lines) + "\n")
    return [
        "experiment=none", "launcher.device=cpu", "data=sft", f"data.sft.path=[{data}]", "data.sft.prompt_format=chatml",
        "data.sft.overlong=error", "model.seq_length=128", f"data.cache_dir={tmp_path}/cache",
        f"checkpoint.save={tmp_path}/save", *extra,
    ]


@pytest.mark.parametrize("case", BROKEN)
def test_broken_data_is_one_line_naming_file_and_line(case, tmp_path, monkeypatch, capsys):
    lines, line, says = BROKEN[case]
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        main(_run(tmp_path, lines, "launcher.nproc=1"))
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(err) == 1, err
    assert err[0].startswith(f"error: data.sft.path: {tmp_path / 'chat.jsonl'}:{line}: ") and says in err[0], err[0]
    assert {p.name for p in tmp_path.iterdir()} <= {"chat.jsonl", "cache"}  # no checkpoint, no outputs
    # a file that tokenizes is cached whole (a record too long for the sample length is no parse error)
    cached = [p.name for p in (tmp_path / "cache").rglob("*") if p.is_file()] if (tmp_path / "cache").exists() else []
    assert len(cached) == (case == "longer_than_a_sample") and all(".tmp" not in name for name in cached)


def test_broken_data_stops_a_two_worker_launch_before_the_workers(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "WORLD_SIZE" and not k.startswith("SLURM_")}
    env["PYTHONPATH"] = str(REPO)
    done = subprocess.run(
        [sys.executable, "-m", "megatron_ext.train", *_run(tmp_path, BROKEN["no_messages"][0], "launcher.nproc=2", "parallel.dp=2")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [f"error: data.sft.path: {tmp_path / 'chat.jsonl'}:2: no 'messages' (nor "
                                                "'prompt' and 'completion'); keys: ['text']"]


SFT_FLAGS = ["--sft", "--data-path", "a.jsonl", "b.jsonl", "--tokenizer-model", "tok.json"]
TRANSLATED = {
    "hf_tokenizer_uses_its_chat_template": (
        [*SFT_FLAGS, "--tokenizer-type", "HuggingFaceTokenizer"], {"data": "sft", "data.sft.path": "[a.jsonl,b.jsonl]"},
        ["data.sft.prompt_format", "data.data_path"],
    ),
    "sft_tokenizer_defaults_to_megatron_lms_format": (
        [*SFT_FLAGS, "--tokenizer-type", "SFTTokenizer"], {"data.sft.prompt_format": "nemotron-h-aligned"}, [],
    ),
    "prompt_format_given": (
        [*SFT_FLAGS, "--tokenizer-type", "SFTTokenizer", "--sft-tokenizer-prompt-format", "nemotron-nano-v2"],
        {"data.sft.prompt_format": "nemotron-nano-v2"}, [],
    ),
    "modelopt_packing_flags_accepted": (
        [*SFT_FLAGS, "--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss"], {"data": "sft"}, [],
    ),
}


@pytest.mark.parametrize("case", TRANSLATED)
def test_sft_flags_become_the_sft_config(case):
    argv, expected, absent = TRANSLATED[case]
    overrides = dict(o.split("=", 1) for o in translate(argv).overrides)
    assert {k: overrides.get(k) for k in expected} == expected
    assert not set(absent) & set(overrides)


REFUSED = {
    "packing_flags_without_sft": (["--data-path", "x", "--reset-position-ids"], "--reset-position-ids: document boundaries"),
    "sft_without_data": (["--sft", "--mock-data"], "--sft: needs --data-path"),
    "weighted_sft_data": (["--sft", "--data-path", "0.5", "a.jsonl", "0.5", "b.jsonl"], "--data-path 0.5 a.jsonl 0.5 b.jsonl: weights"),
    "hub_dataset": (["--finetune-hf-dataset", "org/set"], "downloaded at run time"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_sft_flags_refused_with_reason(case):
    argv, says = REFUSED[case]
    with pytest.raises(MlmArgsError, match=says.replace(".", r"\.")):
        translate(argv)


def test_an_sft_run_and_its_resume_through_pretrain_gpt(tmp_path):
    """Megatron-LM's SFT command line, shrunk: trains, saves, resumes, exit 0."""
    from megatron_ext.train import run_from_overrides

    def pretrain_gpt(argv: list[str]) -> dict:  # pretrain_gpt's main without its exit handling
        return run_from_overrides(translate(argv).overrides)

    data = tmp_path / "chat.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"count to {i}", "completion": " ".join(map(str, range(i)))})
                              for i in range(1, 40)) + "\n")
    flags = [
        "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "96",
        "--max-position-embeddings", "96", "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
        "--sft", "--data-path", str(data), "--sft-tokenizer-prompt-format", "chatml",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3", "--split", "90,10,0",
        "--eval-iters", "1", "--eval-interval", "2", "--save", str(tmp_path / "ckpt"), "--save-interval", "2",
        "--data-cache-path", str(tmp_path / "cache"), "launcher.device=cpu", "data.tokenizer=byte",
    ]
    tracker = tmp_path / "ckpt" / "latest_checkpointed_iteration.txt"
    first = pretrain_gpt([*flags, "--train-iters", "2"])
    assert tracker.read_text().strip() == "2" and len(first["losses"]) == 2
    resumed = pretrain_gpt([*flags, "--train-iters", "4", "--load", str(tmp_path / "ckpt")])
    assert tracker.read_text().strip() == "4" and len(resumed["losses"]) == 2  # iterations 3 and 4 only
    assert resumed["eval_loss"] is not None
