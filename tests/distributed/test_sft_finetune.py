"""Fine-tune SmolLM2-135M-Instruct on conversations made from text on this machine, as a user
would: `model=smollm2_135m data=sft data.sft.path=<JSONL>`, at TP=1 and at PP=2 over two
workers. The held-out loss on the assistant's tokens falls; the two layouts take the same steps;
the model exported to Hugging Face answers three held-out prompts, greedily in transformers,
exactly as the runtime's own generation does from the checkpoint."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_ext.train import run_from_overrides

# ~6 minutes of CPU: the real 135M model, trained, exported and asked three questions.
pytestmark = [pytest.mark.distributed, pytest.mark.model, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
ITERS = 8
NEW_TOKENS = 16


def _data(folder: Path) -> Path:
    out = folder / "docstrings.jsonl"
    subprocess.run([sys.executable, str(REPO / "scripts" / "sft_example_data.py"), str(out)], check=True, cwd=REPO)
    return out


def _overrides(data: Path, cache: Path, *extra: str) -> list[str]:
    return [
        "experiment=none", "model=smollm2_135m", "data=sft", f"data.sft.path=[{data}]", "data.split='90,10,0'",
        f"data.cache_dir={cache}", "model.seq_length=96", "train.micro_batch_size=2", "train.global_batch_size=4",
        f"train.iters={ITERS}", f"train.eval_interval={ITERS}", "train.eval_iters=4", "optim.lr=1e-4",
        "optim.min_lr=1e-5", "optim.lr_warmup_iters=0", "optim.weight_decay=0", "logging.progress_bar=false",
        *extra,
    ]


def _held_out_prompts(data: Path) -> list[str]:
    """Three user turns of conversations in the validation split (data/sft/dataset.py's split)."""
    from megatron_ext.data.sft.dataset import split_conversations
    from megatron_ext.data.sft.records import read_conversations

    conversations = read_conversations(data)
    valid = split_conversations(range(len(conversations)), "90,10,0", seed=1234)[1]
    return [conversations[i].messages[0]["content"] for i in valid[:3]]


def test_finetune_smollm2_on_conversations(tmp_path):
    from megatron_ext.config.store import compose_config
    from megatron_ext.generation import SamplingConfig
    from megatron_ext.generation.cli import Request, run
    from megatron_ext.models.convert.checkpoint import export_checkpoint

    data, cache = _data(tmp_path), tmp_path / "cache"
    assert compose_config(_overrides(data, cache)).train.seed == 1234  # the split _held_out_prompts reads
    before = run_from_overrides(_overrides(data, cache, "train.skip_train=true"))["eval_loss"]
    single = run_from_overrides(_overrides(data, cache, f"checkpoint.save={tmp_path / 'tp1'}"))
    piped = run_from_overrides(_overrides(data, cache, "parallel.pp=2", "launcher.nproc=2"))
    assert single["eval_loss"] < before - 0.05, (before, single["eval_loss"])
    assert piped["eval_loss"] == pytest.approx(single["eval_loss"], abs=2e-3)
    assert piped["losses"] == pytest.approx(single["losses"], abs=2e-3)

    export_checkpoint(str(tmp_path / "tp1"), str(tmp_path / "hf"))
    prompts = _held_out_prompts(data)
    sampling = SamplingConfig(max_new_tokens=NEW_TOKENS)
    ours = run(Request(str(tmp_path / "tp1"), tuple(prompts), chat=True, sampling=sampling, tp=1))
    assert ours == _transformers_answers(tmp_path / "hf", prompts)
    (tmp_path / "answers.json").write_text(json.dumps(dict(zip(prompts, ours)), indent=1))


def _transformers_answers(folder: Path, prompts: list[str]) -> list[str]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    answers = []
    for prompt in prompts:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]
        out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
        answers.append(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    return answers
