"""A sweep launched from a config, stopped after k packed steps (lora.stop_after) and launched
again with lora.resume=true, ends like the sweep that never stopped: every job's losses, eval
losses, token counts and final adapter (its megatron checkpoint) are bitwise the same.

Three jobs pass through two slots: at the stop, job `a` is inside its global batch, `b` has
finished and `c` has taken its slot. A re-launch that would mix two sweeps, or resume changed
jobs, is refused before anything is written.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from test_lora_sweep import TINY

from megatron_ext.config import compose_config
from megatron_ext.lora.sweep import jobs_of, run_sweep
from megatron_ext.checkpointing import torch_dist as ckpt

JOBS = "[{name: a, rank: 4, lr: 0.01}, {name: b, rank: 2, steps: 1, dropout: 0.1}, {name: c, rank: 8, lr: 0.005, seed: 7}]"
# packed steps: a takes 4 (2 optimizer steps of 2 micro-batches); b 2; c 4 in b's slot from step 2


def sweep(out, *overrides: str) -> dict:
    cfg = compose_config([*TINY, f"lora.output_dir={out}", "lora.slots=2", f"lora.jobs={JOBS}",
                          "lora.eval_interval=1", *overrides])
    return run_sweep(cfg, jobs_of(cfg))


def outcome(out, summary: dict) -> dict:
    """Per job: its summary (less the wall time), its metrics and its final adapter (the PEFT
    export, which holds the megatron checkpoint's values: test_lora_sweep)."""
    found = {}
    for name, entry in summary.items():
        metrics = json.loads((out / name / "metrics.json").read_text())
        found[name] = ({k: v for k, v in entry.items() if k != "seconds"},
                       {k: metrics[k] for k in ("status", "steps", "losses", "eval_losses", "tokens")},
                       load_file(out / name / "adapter" / "adapter_model.safetensors"))
    return found


def test_a_stopped_sweep_resumed_ends_like_the_uninterrupted_one(tmp_path):
    whole = outcome(tmp_path / "whole", sweep(tmp_path / "whole"))
    assert all(entry["status"] == "done" for entry, _, _ in whole.values())

    out = tmp_path / "stopped"
    stopped = sweep(out, "lora.save_interval=2", "lora.stop_after=3")
    assert {name: s["status"] for name, s in stopped.items()} == {"a": "running", "b": "done", "c": "running"}
    assert ckpt.latest_iteration(out / "checkpoints" / "pack_0") == 3
    assert sorted(p.name for p in (out / "checkpoints" / "pack_0").glob("iter_*")) == ["iter_0000003"]

    resumed = outcome(out, sweep(out, "lora.save_interval=2", "lora.resume=true"))
    assert resumed.keys() == whole.keys()
    for name in whole:
        (entry, metrics, weights), (w_entry, w_metrics, w_weights) = resumed[name], whole[name]
        assert (entry, metrics) == (w_entry, w_metrics), name  # floats compared exactly
        assert weights.keys() == w_weights.keys()
        assert all(torch.equal(weights[k], w_weights[k]) for k in weights), name
    assert ckpt.latest_iteration(out / "checkpoints" / "pack_0") == 6
    for name in ("a", "c"):  # the second launch went on from the checkpoint, repeating no step
        log = (out / name / "log.txt").read_text()
        assert "resumed in slot" in log and log.count("step 1/2") == log.count("step 2/2") == 1, log


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    out = tmp_path_factory.mktemp("stopped")
    sweep(out, "lora.stop_after=1")
    return out


@pytest.mark.parametrize(
    "overrides,message",
    [
        ([], r"holds the checkpoints of an earlier sweep: continue it with lora.resume=true"),
        (["lora.resume=true", "optim.lr=0.3"], r"jobs changed since .*sweep.json was written: \{'b': \['lr'\]\}"),
        (["lora.stop_after=0"], r"lora.stop_after must be >= 1"),
    ],
    ids=["fresh-over-a-sweep", "changed-job", "stop-after"],
)
def test_a_relaunch_that_cannot_continue_is_refused_before_it_writes(stopped, overrides, message):
    before = {p: p.stat().st_mtime_ns for p in stopped.rglob("*") if p.is_file()}
    with pytest.raises(ValueError, match=message):
        sweep(stopped, *overrides)
    assert {p: p.stat().st_mtime_ns for p in stopped.rglob("*") if p.is_file()} == before


def test_resume_without_a_sweep_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"holds no sweep to resume \(sweep.json is missing\)"):
        sweep(tmp_path, "lora.resume=true")
