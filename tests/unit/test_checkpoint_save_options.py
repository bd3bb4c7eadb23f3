"""What a save leaves out, as Megatron-LM's --no-save-optim and --no-save-rng choose it
(checkpoint.save_optim / save_rng), and what resuming such a checkpoint does: the optimizer-less
one needs --no-load-optim (or --finetune), as in Megatron-LM, and the RNG-less one resumes with
this run's seeding. The references are a checkpoint of the same run saved with everything and a
run that loads nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader

from megatron_ext.config import compose_config
from megatron_ext.config.mlm_args import mlm_args_to_overrides
from megatron_ext.config.validate import ConfigError
from megatron_ext.platform.launch import join_world
from megatron_ext.train import run_from_overrides
from megatron_ext.checkpointing import torch_dist as ckpt
from megatron_ext.training.trainer import Trainer

ITERS = 3
COMMON = [
    "experiment=none",
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.ffn_hidden_size=128",
    "model.num_attention_heads=4",
    "model.seq_length=32",
    # Dropout draws from torch's generator while training: the saved RNG state is not a fresh seeding's.
    "model.hidden_dropout=0.1",
    "train.micro_batch_size=2",
    "train.global_batch_size=2",
    "train.eval_interval=0",
    "logging.progress_bar=false",
    "launcher.nproc=1",
]
# name -> what the save leaves out
SAVES = {"full": [], "no_optim": ["checkpoint.save_optim=false"], "no_rng": ["checkpoint.save_rng=false"]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[str]]:
    """name -> the overrides resuming that save of the same ITERS-step run."""
    tmp = tmp_path_factory.mktemp("saves")
    base = [*COMMON, f"data.cache_dir={tmp / 'cache'}"]
    resumes = {}
    for name, options in SAVES.items():
        run_from_overrides([*base, *options, f"train.iters={ITERS}", f"checkpoint.save={tmp / name}"])
        resumes[name] = [*base, f"train.iters={2 * ITERS}", f"checkpoint.load={tmp / name}"]
    return resumes


def folder(resume: list[str]) -> Path:
    load = next(o.split("=", 1)[1] for o in resume if o.startswith("checkpoint.load="))
    return ckpt.iteration_dir(load, ITERS)


def saved_keys(resume: list[str]) -> set[str]:
    """The keys of the checkpoint's own metadata file, read with torch alone."""
    return set(FileSystemReader(str(folder(resume))).read_metadata().state_dict_metadata)


def size(resume: list[str]) -> int:
    return sum(f.stat().st_size for f in folder(resume).iterdir())


def resumed(overrides: list[str]) -> dict:
    """Weights, Adam moments, counters, lr-schedule steps and torch's RNG state of a trainer set
    up from `overrides` (before any step)."""
    join_world("cpu")
    trainer = Trainer(compose_config(overrides))
    try:
        trainer.setup()
        state = trainer.optimizer.optimizer.state.values()
        return {
            "weights": [p.detach().clone() for m in trainer.model for p in m.parameters()],
            "moments": [s[k].clone() for s in state for k in ("exp_avg", "exp_avg_sq") if k in s],
            "iteration": trainer.state.iteration,
            "scheduler_steps": trainer.scheduler.num_steps,
            "rng": torch.get_rng_state(),
        }
    finally:
        trainer.close()
        dist.destroy_process_group()


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize(
    "flag, key", [("--no-save-optim", "checkpoint.save_optim=false"), ("--no-save-rng", "checkpoint.save_rng=false")]
)
def test_megatron_flags_map_onto_the_save_options(flag, key):
    assert key in mlm_args_to_overrides([flag])


def test_no_save_optim_leaves_out_the_optimizer_and_its_schedule(runs):
    full, no_optim = saved_keys(runs["full"]), saved_keys(runs["no_optim"])
    assert any(k.startswith("optimizer.") for k in full)
    assert not any(k.startswith("optimizer") for k in no_optim)
    assert no_optim == {k for k in full if not k.startswith("optimizer.")}
    assert size(runs["no_optim"]) < size(runs["full"]) / 2  # Adam's two moments and the main params
    assert "scheduler" not in ckpt.load_common(folder(runs["no_optim"]).parent, ITERS)


def test_no_save_rng_leaves_out_the_rng_states(runs):
    full, no_rng = saved_keys(runs["full"]), saved_keys(runs["no_rng"])
    assert any(k.startswith("rng_state/") for k in full)
    assert no_rng == {k for k in full if not k.startswith("rng_state/")}


def test_no_save_optim_resumes_with_no_load_optim(runs):
    reference = resumed([*runs["full"], "checkpoint.load_optim=false"])
    weights_only = resumed([*runs["no_optim"], "checkpoint.load_optim=false"])
    assert same(weights_only["weights"], reference["weights"])
    assert any(m.abs().sum() > 0 for m in resumed(runs["full"])["moments"])  # what a full resume restores
    assert not any(m.abs().sum() > 0 for m in weights_only["moments"])
    assert (weights_only["iteration"], weights_only["scheduler_steps"]) == (ITERS, 0)
    summary = run_from_overrides([*runs["no_optim"], "checkpoint.load_optim=false"])
    assert len(summary["losses"]) == ITERS and all(torch.isfinite(torch.tensor(summary["losses"])))


@pytest.mark.parametrize("how", ["preflight", "trainer"])
def test_no_save_optim_without_no_load_optim_stops_naming_the_flag(runs, how):
    with pytest.raises(ConfigError) as info:
        if how == "preflight":
            run_from_overrides(runs["no_optim"])
        else:  # a Trainer set up directly (no preflight) stops at the load itself
            resumed(runs["no_optim"])
    assert info.value.field == "checkpoint.load"
    assert "holds no optimizer state" in info.value.rule and "--no-load-optim" in info.value.rule
    assert len(str(info.value).splitlines()) == 1


def test_finetune_reads_a_checkpoint_without_optimizer_state(runs):
    finetune = resumed([*runs["no_optim"], "checkpoint.finetune=true"])
    assert same(finetune["weights"], resumed([*runs["full"], "checkpoint.finetune=true"])["weights"])
    assert finetune["iteration"] == 0


def test_no_save_rng_resumes_with_this_runs_seeding_without_no_load_rng(runs):
    fresh = resumed([o for o in runs["no_rng"] if not o.startswith("checkpoint.load=")])
    full, no_rng = resumed(runs["full"]), resumed(runs["no_rng"])
    assert not torch.equal(full["rng"], fresh["rng"])  # the full checkpoint's streams differ from a fresh seeding
    assert torch.equal(no_rng["rng"], fresh["rng"])
    assert same(no_rng["weights"], full["weights"]) and same(no_rng["moments"], full["moments"])
    assert no_rng["scheduler_steps"] == full["scheduler_steps"] == ITERS


def test_a_megatron_command_line_saves_without_the_optimizer_and_resumes_as_megatron_does(tmp_path, capsys):
    """Megatron-LM's flags end to end: --no-save-optim, then a resume that stops with one line
    naming the flag to add, then the resume with it."""
    from megatron_ext.pretrain_gpt import main

    command = [
        "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128", "--num-attention-heads", "4",
        "--seq-length", "32", "--max-position-embeddings", "32", "--swiglu", "--normalization", "RMSNorm",
        "--position-embedding-type", "rope", "--disable-bias-linear", "--micro-batch-size", "2", "--global-batch-size", "2",
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "256", "--lr", "1e-3", "--eval-iters", "0",
        "--nproc", "1", f"data.cache_dir={tmp_path / 'cache'}", "logging.progress_bar=false",
    ]
    main([*command, "--train-iters", "2", "--save", str(tmp_path / "ckpt"), "--no-save-optim"])
    assert not any(k.startswith("optimizer") for k in ckpt.held_states(tmp_path / "ckpt", 2))
    capsys.readouterr()
    with pytest.raises(SystemExit) as stopped:
        main([*command, "--train-iters", "4", "--load", str(tmp_path / "ckpt")])
    assert stopped.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: --load {tmp_path / 'ckpt'} (checkpoint.load): {tmp_path / 'ckpt' / 'iter_0000002'} holds no optimizer "
        "state (saved with --no-save-optim, checkpoint.save_optim=false): resume it with --no-load-optim "
        "(checkpoint.load_optim=false) or --finetune"
    )
    main([*command, "--train-iters", "4", "--load", str(tmp_path / "ckpt"), "--no-load-optim"])
    assert "summary |" in capsys.readouterr().out
