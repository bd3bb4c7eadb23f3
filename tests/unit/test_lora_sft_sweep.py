"""A LoRA sweep over the user's own instruction data: 6 jobs (2 datasets x 3 ranks) from one YAML
jobs file, each naming its JSONL file. The sweep's table gives each job's validation loss, equal
to the same job trained alone; for one job the reference is `peft` on `transformers`, trained
from the same initial adapter on the same micro-batches; every exported PEFT adapter loads into
`transformers` and gives the job's validation loss there.

The JSONL files are made here from text on the machine: the standard library's docstrings as
question / answer pairs (lora/tasks.py), one file of {"prompt", "completion"} records about
functions, one of {"messages": [...]} records about modules. The model is the lora tests' tiny
LLaMA with the byte tokenizer and the chatml prompt format.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest
import torch

from megatron_ext.config import compose_config
from megatron_ext.data import ByteTokenizer
from megatron_ext.lora import tasks
from megatron_ext.lora.datasets import SweepData
from megatron_ext.lora.export import save_peft
from megatron_ext.lora.runtime.base import build_base
from megatron_ext.lora.runtime.layers import install_job, logical_weights
from megatron_ext.lora.runtime.packed import PackedTrainer
from megatron_ext.lora.sweep import jobs_of, run_sweep
from megatron_ext.models.convert.hf import write_hf
from megatron_ext.models.convert.hf_config import hf_config_from_model
from megatron_ext.models.convert.llama import logical_to_hf
from megatron_ext.models.convert.load import gather_logical
from megatron_ext.models.convert.world import model_parallel_world
from megatron_ext.models.gpt import padded_vocab_size

VOCAB = ByteTokenizer().vocab_size
CONVERSATIONS = 24  # per file; data.split 75/25 holds out 6 of each
RANKS = (2, 4, 8)
# The job trained again with peft: adapters on the linears PEFT adapts one to one (fused q/k/v
# and gate/up adapters share one A in the packed runtime, which PEFT's separate ones would not).
PEFT_JOB = "functions-r2"


def write_data(folder: Path) -> dict[str, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    functions, modules = folder / "functions.jsonl", folder / "modules.jsonl"
    functions.write_text("".join(json.dumps({"prompt": q, "completion": a}) + "\n"
                                 for q, a in tasks.examples("docstring")[:CONVERSATIONS]))
    modules.write_text("".join(json.dumps({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}) + "\n"
                               for q, a in tasks.examples("module")[:CONVERSATIONS]))
    return {"functions": functions, "modules": modules}


def jobs_yaml(folder: Path, data: dict[str, Path], ranks=RANKS) -> Path:
    lines = ["jobs:"]
    for name, path in data.items():
        for rank in ranks:
            job = f"{name}-r{rank}"
            targets = ", target_modules: [linear_proj, linear_fc2]" if job == PEFT_JOB else ""
            dropout = ", dropout: 0.1" if name == "modules" else ""  # shorter: padded to its partners in a pass
            lines.append(f"  - {{name: {job}, rank: {rank}, alpha: {2 * rank}, dataset: {path}{targets}{dropout}}}")
    path = folder / "jobs.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


def sweep_config(tmp_path: Path, jobs_file: Path, *overrides: str):
    cfg = compose_config([
        "experiment=lora_sweep", "model=llama_tiny", "model.seq_length=256", "train.iters=2", "train.micro_batch_size=2",
        "train.global_batch_size=4", "optim.lr=3e-3", "lora.memory_gb=1", "lora.eval_iters=2", "lora.save_interval=null",
        "data.split='75,25,0'", "data=sft", "data.sft.path=[]", "data.sft.prompt_format=chatml", f"data.cache_dir={tmp_path / 'cache'}",
        f"lora.jobs_file={jobs_file}", *overrides,
    ])
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=VOCAB))


def token_losses(model, mb) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' per-token cross entropy of a micro-batch and its loss mask."""
    logits = model(input_ids=mb.tokens).logits.float()
    return torch.nn.functional.cross_entropy(logits.transpose(1, 2), mb.labels, reduction="none"), mb.loss_mask


def validation_loss(model, batches) -> float:
    """The token-weighted mean loss of the validation micro-batches (the sweep's measure)."""
    total = count = 0.0
    with torch.no_grad():
        for mb in batches:
            losses, mask = token_losses(model, mb)
            total, count = total + float((losses * mask).sum()), count + float(mask.sum())
    return total / count


def train_with_peft(base, adapter: Path, job, data) -> float:
    """The job trained by peft on transformers from the adapter in `adapter`: AdamW per step of
    the job's global batch, the loss each micro-batch's mean over its loss tokens, clipping at
    the job's norm. Returns its validation loss."""
    from peft import PeftModel  # optional: the test extra's reference

    model = PeftModel.from_pretrained(base, adapter, is_trainable=True)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=job.lr, betas=(job.adam_beta1, job.adam_beta2), eps=job.adam_eps,
                                  weight_decay=job.weight_decay, foreach=False)
    batches = data.train()
    for _ in range(job.steps):
        for _ in range(job.accumulation_steps):
            losses, mask = token_losses(model, next(batches))
            ((losses * mask).sum() / mask.sum() / job.accumulation_steps).backward()
        torch.nn.utils.clip_grad_norm_(params, job.clip_grad)
        optimizer.step()
        optimizer.zero_grad()
    return validation_loss(model, data.eval())


def hf_base_and_initial_adapter(cfg, job, folder: Path) -> tuple[Path, Path]:
    """The sweep's base (built from the same seed) as a transformers folder, every padded
    vocabulary row kept (megatron's loss runs over them), and `job`'s initial adapter as PEFT."""
    vocab = padded_vocab_size(VOCAB, cfg.model, 1)
    with model_parallel_world():
        model, wrappers, _ = build_base(cfg.model, vocab, cfg.train.seed)
        install_job(wrappers, 0, job)
        hf = write_hf(folder / "hf", logical_to_hf(gather_logical([model]), cfg.model, vocab), hf_config_from_model(cfg.model, vocab))
        adapter = save_peft(folder / "initial", job, logical_weights(wrappers, 0), cfg.model)
    return hf, adapter


@pytest.mark.slow  # two sweeps of six jobs, 12 exports and transformers: 10-40 s on two busy cores
def test_six_jobs_of_their_own_jsonl_equal_each_alone_and_peft(tmp_path, capsys):
    pytest.importorskip("peft")
    # optional: peft and transformers, the test extra's references
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    data = write_data(tmp_path / "data")
    jobs_file = jobs_yaml(tmp_path, data)
    packed_cfg = sweep_config(tmp_path, jobs_file, f"lora.output_dir={tmp_path / 'packed'}", "lora.slots=6")
    packed = run_sweep(packed_cfg, jobs_of(packed_cfg))
    table = capsys.readouterr().out
    alone_cfg = sweep_config(tmp_path, jobs_file, f"lora.output_dir={tmp_path / 'alone'}", "lora.slots=1")
    alone = run_sweep(alone_cfg, jobs_of(alone_cfg))

    names = [f"{d}-r{r}" for d in data for r in RANKS]
    assert list(packed) == names and all(s["status"] == "done" and s["steps"] == 2 for s in packed.values())
    header = next(line for line in table.splitlines() if line.startswith("job "))
    assert header.split() == ["job", "dataset", "status", "steps", "train", "loss", "valid", "loss", "before", "valid", "loss", "after"]
    for name in names:
        row = next(line.split() for line in table.splitlines() if line.startswith(name + " "))
        assert row[1] == str(data[name.split("-")[0]]) and float(row[-1]) == pytest.approx(packed[name]["eval_loss"], abs=5e-5)
        assert packed[name]["eval_loss"] < packed[name]["first_eval_loss"] - 1e-2, f"{name} did not learn"
        assert packed[name]["eval_loss"] == pytest.approx(alone[name]["eval_loss"], abs=1e-6), name

    sweep_data = SweepData(packed_cfg, ByteTokenizer(), VOCAB, jobs_of(packed_cfg))
    jobs = {j.name: j for j in sweep_data.jobs}
    hf_dir, initial = hf_base_and_initial_adapter(packed_cfg, jobs[PEFT_JOB], tmp_path / "reference")
    base = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    reference = train_with_peft(copy.deepcopy(base), initial, jobs[PEFT_JOB], sweep_data.data_for(jobs[PEFT_JOB]))
    # fp32 both; megatron's and transformers' bases alone differ by about 2e-7 in a loss
    assert packed[PEFT_JOB]["eval_loss"] == pytest.approx(reference, abs=1e-5)
    for name in names:  # each exported adapter, loaded by peft, validates as the sweep measured
        loaded = PeftModel.from_pretrained(copy.deepcopy(base), tmp_path / "packed" / name / "adapter").eval()
        assert validation_loss(loaded, sweep_data.data_for(jobs[name]).eval()) == pytest.approx(packed[name]["eval_loss"], abs=1e-5), name


def train_pack(cfg, jobs, data, capacity: int) -> dict:
    model, wrappers, routing = build_base(cfg.model, padded_vocab_size(VOCAB, cfg.model, 1), cfg.train.seed)
    trainer = PackedTrainer(model, wrappers, routing, data.data_for, capacity)
    trainer.submit(jobs)
    return trainer.run()


def test_two_jobs_of_their_own_jsonl_packed_equal_each_alone(one_rank_world, tmp_path):
    """The default suite's variant: one job per file from a YAML jobs file, packed together and
    each alone, in the packed runtime (no exports)."""
    data = write_data(tmp_path / "data")
    cfg = sweep_config(tmp_path, jobs_yaml(tmp_path, data, ranks=(2,)), "train.iters=1")
    sweep_data = SweepData(cfg, ByteTokenizer(), VOCAB, jobs_of(cfg))
    packed = train_pack(cfg, sweep_data.jobs, sweep_data, capacity=2)
    for job in sweep_data.jobs:
        alone = train_pack(cfg, [job], sweep_data, capacity=1)[job.name]
        assert packed[job.name].status == "done" and packed[job.name].eval_losses.keys() == {0, 1}
        assert packed[job.name].eval_losses[1] != packed[job.name].eval_losses[0], f"{job.name} did not train"
        assert packed[job.name].eval_losses[1] == pytest.approx(alone.eval_losses[1], abs=1e-6), job.name
