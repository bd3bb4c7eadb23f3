"""LoRA sweeps from configs: a Hydra multirun becomes the jobs of ONE packed run, a plain
multi-job config works too, bad input is refused before anything trains, and every job leaves
its log, metrics, PEFT adapter and megatron checkpoint (which hold the same weights)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from megatron_ext.config import compose_config
from megatron_ext.config.sweep import read_sweep
from megatron_ext.lora.sweep import jobs_of, multirun_jobs, run_sweep

TINY = ["experiment=lora_sweep", "model=llama_tiny", "model.seq_length=32", "lora.dataset=synthetic", "train.iters=2",
        "train.micro_batch_size=1", "train.global_batch_size=2", "lora.memory_gb=1", "lora.eval_iters=1"]


def multirun(argv: list[str]):
    """The lora plugin's jobs of a multirun command line, as train.main reads it."""
    sweep = read_sweep(argv)
    return multirun_jobs(sweep, compose_config(sweep.combinations[0]))


def test_multirun_combinations_become_jobs_of_one_sweep():
    cfg, jobs = multirun(["-m", *TINY, "lora.rank=4,8", "optim.lr=1e-3,3e-3"])
    assert "lora" in cfg.plugins
    assert sorted((j.rank, j.lr) for j in jobs) == [(4, 1e-3), (4, 3e-3), (8, 1e-3), (8, 3e-3)]
    assert len({j.name for j in jobs}) == 4 and "rank4-lr0.003" in {j.name for j in jobs}
    assert all(j.steps == 2 and j.global_batch_size == 2 and j.seq_length == 32 for j in jobs)


def test_a_multirun_without_the_lora_plugin_is_left_to_hydra():
    from megatron_ext.train import multirun_of_a_plugin

    assert multirun_of_a_plugin(["-m", "experiment=none", "optim.lr=1e-3,3e-3"]) is None
    assert multirun_of_a_plugin(["-m", *TINY, "lora.rank=4,8"]) is not None


def test_a_multirun_may_not_vary_the_shared_base():
    with pytest.raises(ValueError, match=r"\['model.num_layers'\] cannot vary"):
        multirun(["-m", *TINY, "model.num_layers=2,4"])


def test_plain_multi_job_config(tmp_path):
    jobs_file = tmp_path / "jobs.yaml"
    jobs_file.write_text("jobs:\n  - {name: big, rank: 16, lr: 0.001}\n  - {name: small, rank: 2, global_batch_size: 4}\n")
    cfg = compose_config([*TINY, f"lora.jobs_file={jobs_file}", "lora.rank=8"])
    jobs = {j.name: j for j in jobs_of(cfg)}
    assert (jobs["big"].rank, jobs["big"].lr, jobs["big"].global_batch_size) == (16, 0.001, 2)
    assert (jobs["small"].rank, jobs["small"].global_batch_size) == (2, 4)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["lora.target_modules=[linear_qkv,q_proj]"], r"unknown target module\(s\) \['q_proj'\]"),
        (["lora.jobs=[{name: a, rnak: 4}]"], r"unknown field\(s\) \['rnak'\]"),
        (["lora.jobs=[{name: a, mean_tokens: 4}]"], r"lora.jobs\[0\]: \['mean_tokens'\] are measured from the job's data"),
        (["lora.dataset=wikipedia"], "job 'job': dataset 'wikipedia': wikipedia: no such file or folder"),
        (["lora.memory_gb=0.0001"], "cannot fit in memory: job 'job' needs"),
        (["parallel.pp=2"], "needs parallel.pp=1"),
        (["model.arch=hybrid"], "model.arch=gpt only"),
        (["lora.kernel=fused"], "unknown lora.kernel 'fused'"),
        (["lora.max_pass_tokens=0"], r"lora.max_pass_tokens must be 'auto', null or >= 1 tokens, got 0"),
        (["lora.max_pass_tokens=big"], r"lora.max_pass_tokens must be 'auto', null or >= 1 tokens, got 'big'"),
        (["parallel.tp=2"], r"parallel.tp=2 \(the largest TP a pack may use\) does not divide the world of 1 rank"),
    ],
    ids=["target-module", "job-field", "measured-field", "dataset", "memory", "pipeline", "arch", "kernel", "pass-cap", "pass-cap-word", "max-tp"],
)
def test_bad_input_is_refused_before_training(tmp_path, overrides, message):
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=message):
        cfg = compose_config([*TINY, f"lora.output_dir={out}", *overrides])
        run_sweep(cfg, jobs_of(cfg))
    assert not out.exists()


def test_megatron_realtime_test_is_refused_before_launch():
    """train.test_mode is set on the Trainer's models; a sweep runs its own loop."""
    from megatron_ext.config.validate import ConfigError
    from megatron_ext.plugin import build_plugins

    cfg = compose_config([*TINY, "train.test_mode=true"])
    with pytest.raises(ConfigError, match="real-time test would not run") as refused:
        for plugin in build_plugins(cfg.plugins, cfg):
            plugin.check(cfg, 1)
    assert refused.value.field == "train.test_mode"


def test_the_pass_cap_reaches_the_planners_memory():
    """Four equal jobs of 32 tokens a micro-batch in four slots hold four jobs' activations in a
    step, two under a cap of 64 tokens, one under a cap of one token."""
    from megatron_ext.lora.sweep import plan_sweep

    def peak(cap: str) -> int:
        cfg = compose_config([*TINY, "model.vocab_size=256", "lora.slots=4", f"lora.max_pass_tokens={cap}",
                              "lora.jobs=[{name: a}, {name: b}, {name: c}, {name: d}]"])
        return max(plan_sweep(cfg, jobs_of(cfg)).peak_bytes)

    four, two, one = peak("null"), peak("64"), peak("1")
    assert four - two == 2 * (two - one) > 0
    # auto on a CPU is pass_size.CPU_PASS_TOKENS (1024): all four 32-token micro-batches in one pass
    assert peak("auto") == four


@pytest.mark.slow  # 3 jobs trained and exported, 15 s: the default suite keeps the pieces' tests
def test_sweep_trains_every_job_and_writes_its_outputs(tmp_path):
    from megatron_ext.lora.export import load_megatron, load_peft

    from megatron_ext.models.convert.world import model_parallel_world

    out = tmp_path / "out"
    jobs_entries = "[{name: a, rank: 4}, {name: b, rank: 2, lr: 0.01, seq_length: 24}, {name: c, rank: 8, dropout: 0.1}]"
    cfg = compose_config([*TINY, f"lora.output_dir={out}", "lora.slots=2", f"lora.jobs={jobs_entries}"])
    summary = run_sweep(cfg, jobs_of(cfg))
    assert set(summary) == {"a", "b", "c"} and all(s["status"] == "done" and s["steps"] == 2 for s in summary.values())
    for name in summary:
        metrics = json.loads((out / name / "metrics.json").read_text())
        assert len(metrics["losses"]) == 2 and "step 2/2" in (out / name / "log.txt").read_text()
        job, weights = load_peft(out / name / "adapter", dataclasses.replace(cfg.model, vocab_size=257), jobs_of(cfg)[0])
        with model_parallel_world():
            saved_job, saved = load_megatron(out / name / "checkpoint")
        assert saved_job.name == name and job.rank == saved_job.rank
        assert saved.keys() == weights.keys()
        assert all(torch.equal(saved[k][i], weights[k][i]) for k in saved for i in (0, 1))
        assert any(b.abs().max() > 0 for _, b in saved.values()), "the adapter never trained"


@pytest.mark.parametrize("multirun", [True, False], ids=["hydra-multirun", "single-config"])
def test_other_plugins_beside_lora_are_refused_before_launch(tmp_path, capsys, multirun):
    from megatron_ext.train import main

    out = tmp_path / "out"
    with pytest.raises(SystemExit) as stopped:
        main([*(["-m"] if multirun else []), *TINY, "plugins=[lora,reshard]", f"lora.output_dir={out}",
              "lora.rank=4,8" if multirun else "lora.rank=4"])
    assert stopped.value.code == 2
    assert "lora trains in a loop of its own, not the Trainer's: reshard's hooks would be ignored" in capsys.readouterr().err
    assert not out.exists()


def test_skip_train_is_refused_before_launch(tmp_path, capsys):
    """Megatron-LM's --skip-train evaluates instead of training; the packed loop cannot."""
    from megatron_ext.train import main

    out = tmp_path / "out"
    with pytest.raises(SystemExit) as stopped:
        main([*TINY, "train.skip_train=true", f"lora.output_dir={out}"])
    assert stopped.value.code == 2
    assert "error: train.skip_train: lora runs its own packed loop" in capsys.readouterr().err
    assert not out.exists()
