"""Checkpoints written by Megatron-LM itself (tests/fixtures/megatron_lm, its own save_checkpoint
at core_v0.16.1) resume here, in their own layout and in others, and the offline converter
rewrites them.

The references are independent of the loader under test:
- the state: every tensor of the fixture read by torch's own checkpoint reader, against the
  same keys of a save this runtime makes right after resuming (no step between); a
  `dp_reshardable` fixture (bucket space, unreadable by key) against its `fully_reshardable`
  twin, which Megatron-LM wrote from the same training (command.json records equal hashes);
- the continuation: the next steps' losses of a run resumed in the fixture's own layout.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from megatron.core import dist_checkpointing
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from megatron_ext.config.mlm_args import translate
from megatron_ext.pretrain_gpt import saved_args
from megatron_ext.train import run_from_overrides
from megatron_ext.checkpointing import torch_dist as ckpt

pytestmark = pytest.mark.distributed

FIXTURES = Path(__file__).parents[1] / "fixtures" / "megatron_lm"
STEPS = 3  # trained after the resume
LAYOUTS = {
    "tp2pp2": ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"],
    "tp1pp4": ["--pipeline-model-parallel-size", "4"],
    "tp2": ["--tensor-model-parallel-size", "2"],
    "tp1": [],
}
# Flags of the fixture's command line that name where it wrote and how long it ran.
_OWN = {"--save", "--train-iters", "--save-interval"}


def fixture(name: str) -> dict:
    return json.loads((FIXTURES / name / "command.json").read_text())


def argv_of(name: str) -> list[str]:
    """The fixture's Megatron-LM command line without its output and length, and without its
    layout."""
    argv, out, skip = fixture(name)["argv"], [], 0
    for arg in argv:
        if skip:
            skip -= 1
            continue
        if arg in _OWN or arg in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size"):
            skip = 1
            continue
        out.append(arg)
    return out


def run(name: str, load: Path, layout: str, iters: int, tmp: Path, save: Path | None = None) -> dict:
    """pretrain_gpt with the fixture's flags in `layout`, resumed from `load`, to `iters`."""
    flags = LAYOUTS[layout]
    mp = 1
    for size in flags[1::2]:
        mp *= int(size)
    argv = [*argv_of(name), *flags, "--load", str(load), "--train-iters", str(iters), "--nproc", str(mp)]
    if save is not None:
        argv += ["--save", str(save)]
    overrides = translate(argv, saved_args).overrides
    return run_from_overrides([*overrides, "logging.progress_bar=false", f"data.cache_dir={tmp / 'cache'}"])


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a torch_dist checkpoint by its key, read by torch alone."""
    reader = dcp.FileSystemReader(str(folder))
    metadata = reader.read_metadata().state_dict_metadata
    state = {
        k: torch.empty(m.size, dtype=m.properties.dtype)
        for k, m in metadata.items()
        if isinstance(m, TensorStorageMetadata)
    }
    dcp.load(state, storage_reader=reader, no_dist=True)
    return state


def convert(load: Path, out: Path, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "megatron_ext.reshard.convert", "--load", str(load), "--save", str(out), *flags],
        capture_output=True, text=True, timeout=600,
    )


def check_state(name: str, folder: Path) -> None:
    """Every tensor of the fixture (its fully_reshardable twin for a dp_reshardable one) equals
    the same key of `folder`, a checkpoint of the same iteration; so do the counters."""
    iteration = fixture(name)["saved"]["iteration"]
    reference = tensors(ckpt.iteration_dir(FIXTURES / reference_of(name), iteration))
    resaved = tensors(ckpt.iteration_dir(folder, iteration))
    missing = sorted(set(reference) - set(resaved))
    assert not missing, missing
    different = [k for k in reference if not torch.equal(reference[k], resaved[k])]
    assert not different, different
    common = dist_checkpointing.load_common_state_dict(str(ckpt.iteration_dir(folder, iteration)))
    saved = fixture(name)["saved"]
    assert common["iteration"] == iteration
    assert common["args"].consumed_train_samples == saved["consumed_train_samples"]
    assert common["opt_param_scheduler"]["num_steps"] == saved["scheduler_num_steps"]
    assert common["num_floating_point_operations_so_far"] == pytest.approx(saved["num_floating_point_operations_so_far"])


def reference_of(name: str) -> str:
    """The fixture whose tensors are readable by key: itself, or its fully_reshardable twin."""
    twin = name.replace("dp_reshardable", "fully_reshardable")
    assert fixture(twin)["saved"]["global_optimizer_sha256"] == fixture(name)["saved"]["global_optimizer_sha256"]
    return twin


# fixture: its own layout, then two others it resumes in (a dp_reshardable one: rewritten first
# by the launcher, training/relayout.py)
CASES = {
    "gpt3_tp2pp2_dp_reshardable": ("tp2pp2", "tp1pp4", "tp2"),
    "gpt3_tp2pp2_fully_reshardable": ("tp2pp2", "tp1pp4", "tp1"),
    "gpt3_tp1_bf16": ("tp1", "tp2", "tp1pp4"),
    "llama_tp2pp2_dp_reshardable": ("tp2pp2", "tp2", "tp1"),
    "llama_tp2pp2_fully_reshardable": ("tp2pp2", "tp2", "tp1pp4"),
    "llama_tp1_bf16": ("tp1", "tp2", "tp2pp2"),
}
# The default suite keeps one fixture (the 8-rank ones take minutes on 2 cores).
DEFAULT = "llama_tp1_bf16"


@pytest.mark.parametrize("name", [n if n == DEFAULT else pytest.param(n, marks=pytest.mark.slow) for n in CASES])
def test_a_megatron_lm_checkpoint_resumes_to_its_own_state_in_other_layouts(name, tmp_path):
    iteration = fixture(name)["saved"]["iteration"]
    load = FIXTURES / name
    for layout in CASES[name]:
        run(name, load, layout, iteration, tmp_path, save=tmp_path / layout)  # resume, save: no step
        check_state(name, tmp_path / layout)
    own, *others = (run(name, load, layout, iteration + STEPS, tmp_path)["losses"] for layout in CASES[name])
    assert len(own) == STEPS
    for layout, losses in zip(CASES[name][1:], others):
        assert losses == pytest.approx(own, rel=1e-5), layout


def sizes(layout: str) -> tuple[int, int]:
    flags = dict(zip(LAYOUTS[layout][::2], map(int, LAYOUTS[layout][1::2])))
    return flags.get("--tensor-model-parallel-size", 1), flags.get("--pipeline-model-parallel-size", 1)


@pytest.mark.parametrize(
    "name, layout",
    [
        pytest.param("gpt3_tp2pp2_dp_reshardable", "tp1pp4", marks=pytest.mark.slow),
        pytest.param("gpt3_tp2pp2_dp_reshardable", "tp1", marks=pytest.mark.slow),
        ("llama_tp1_bf16", "tp2"),  # no distributed optimizer: its state by parameter
    ],
)
def test_the_converter_rewrites_a_megatron_lm_checkpoint_in_another_layout(name, layout, tmp_path):
    out = tmp_path / "out"
    done = convert(FIXTURES / name, out, *LAYOUTS[layout], "--dist-ckpt-optim-fully-reshardable")
    assert done.returncode == 0, done.stderr[-2000:]
    check_state(name, out)
    common = dist_checkpointing.load_common_state_dict(str(ckpt.iteration_dir(out, 3)))
    args = common["args"]
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) == sizes(layout)
    assert args.no_save_rng
    assert common["content_metadata"].get("distrib_optim_sharding_type") == (
        "fully_reshardable" if args.use_distributed_optimizer else None
    )


@pytest.mark.slow
def test_a_converted_dp_reshardable_checkpoint_resumes_in_its_new_layout(tmp_path):
    """Megatron-LM's default output: the next steps equal the source's own continuation."""
    name = "gpt3_tp2pp2_dp_reshardable"
    done = convert(FIXTURES / name, tmp_path / "out", *LAYOUTS["tp1pp4"])
    assert done.returncode == 0, done.stderr[-2000:]
    metadata = dist_checkpointing.load_content_metadata(str(ckpt.iteration_dir(tmp_path / "out", 3)))
    assert metadata["distrib_optim_sharding_type"] == "dp_reshardable"
    own = run(name, FIXTURES / name, "tp2pp2", 3 + STEPS, tmp_path)["losses"]
    assert run(name, tmp_path / "out", "tp1pp4", 3 + STEPS, tmp_path)["losses"] == pytest.approx(own, rel=1e-5)


def test_the_converter_refuses_a_layout_the_model_cannot_take_before_writing(tmp_path):
    out = tmp_path / "out"
    done = convert(FIXTURES / "gpt3_tp2pp2_dp_reshardable", out, "--tensor-model-parallel-size", "3")
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "parallel.tp" in lines[0], done.stderr
    assert not out.exists() and not any(p.name.startswith(".out") for p in tmp_path.iterdir())


def test_a_dp_reshardable_checkpoint_of_another_layout_not_rewritten_stops_at_preflight(tmp_path):
    """Under torchrun or srun no launcher of ours rewrites it: one line naming the saved layout."""
    from megatron_ext.config import compose_config
    from megatron_ext.config.validate import ConfigError
    from megatron_ext.training.preflight import check_load

    name = "gpt3_tp2pp2_dp_reshardable"
    argv = [*argv_of(name), *LAYOUTS["tp1pp4"], "--load", str(FIXTURES / name), "--train-iters", "5", "--nproc", "4"]
    cfg = compose_config([*translate(argv, saved_args).overrides, f"data.cache_dir={tmp_path}"])
    with pytest.raises(ConfigError) as refused:
        check_load(cfg)
    assert "dp_reshardable" in str(refused.value) and "tp=2, pp=2" in str(refused.value)
    assert "\n" not in str(refused.value)
