"""`plugin=elastic data=sft` in one process: a run distils on packed conversations (the KD loss
on every token of each conversation, the next-token loss on the answers, micro-batches of two
budgets, the router started by quality) and writes its nested checkpoint."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from megatron_ext.config import compose_config
from megatron_ext.train import run


def write_sums(path: Path, count: int = 40) -> Path:
    """`count` conversations asking for a sum of two numbers, as JSONL (~95 byte tokens each in
    ChatML, 26 of them the answer's)."""
    rng = random.Random(0)
    with open(path, "w") as f:
        for _ in range(count):
            a, b = rng.randrange(100), rng.randrange(100)
            question, answer = f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."
            f.write(json.dumps({"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}))
            f.write("\n")
    return path


def test_elastic_run_distils_packed_sft_conversations(tmp_path):
    write_sums(tmp_path / "sums.jsonl")
    summary = run(compose_config([
        "experiment=none", "plugin=elastic", "launcher.device=cpu", "logging.progress_bar=false", "model.num_layers=2",
        "model.hidden_size=64", "model.ffn_hidden_size=128", "model.num_attention_heads=4", "model.num_query_groups=2",
        "model.seq_length=256", "train.micro_batch_size=2", "train.global_batch_size=4", "train.iters=3",
        "train.eval_interval=0", "elastic.calibration_batches=2", "elastic.grid={hidden: [32,48,64], heads: [2,4], ffn: [64,96,128]}",
        "elastic.router_warmup_steps=20", "elastic.budget_draw=sample", "elastic.distill_tokens=all", "elastic.ce_weight=0.5",
        "data=sft", f"data.sft.path=[{tmp_path / 'sums.jsonl'}]", "data.tokenizer=byte", "data.sft.prompt_format=chatml",
        f"data.cache_dir={tmp_path / 'cache'}", f"elastic.export_dir={tmp_path / 'out'}",
    ]))
    history = json.loads((tmp_path / "out" / "report.json").read_text())["history"]
    assert [h["step"] for h in history] == [1, 2, 3] and all(math.isfinite(h["loss"]) for h in history)
    assert summary["final_loss"] == pytest.approx(history[-1]["loss"])
    # micro-batches of two budgets: the student ran per group, each with its rows of the mask
    assert any(len({*h["budgets"][i : i + 2]}) > 1 for h in history for i in (0, 2)), history
    assert (tmp_path / "out" / "nested" / "model.safetensors").is_file()
