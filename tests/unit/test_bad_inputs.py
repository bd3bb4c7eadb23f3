"""Bad input to `python -m megatron_ext.train`: each case ends with exit code 2 and exactly one
stderr line that names the field (and the path), before any worker starts and with nothing
written. The table runs through `main()` in this process (what the CLI runs after parsing argv);
a few cases run as real subprocesses too."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import gguf
import numpy as np
import pytest
from safetensors.numpy import save_file

from megatron_ext.config import Config, ModelConfig
from megatron_ext.train import main
from megatron_ext.training.file_headers import check_gguf, check_safetensors

REPO = Path(__file__).resolve().parents[2]
# A run that passes every rule of config/validate.py in one process.
BASE = ["experiment=none", "launcher.nproc=1", "launcher.device=cpu"]


def write_gguf(path: Path) -> Path:
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.arange(64 * 8, dtype=np.float32).reshape(64, 8))
    writer.add_tensor("output_norm.weight", np.ones(8, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def cut(path: Path, drop: int) -> Path:
    data = path.read_bytes()
    path.write_bytes(data[:-drop])
    return path


def write_checkpoint(root: Path, model: ModelConfig, iteration: int = 3, tensors: bool = False) -> Path:
    """A checkpoint folder as the trainer writes it, holding its plain state (what the
    preflight reads: Megatron-LM's keys and the runtime's config) and with `tensors` two sharded
    tensors (one shard file each), written by megatron's dist_checkpointing."""
    import torch
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    from megatron_ext.checkpointing.megatron_lm import to_saved
    from megatron_ext.checkpointing.torch_dist import TRACKER, iteration_dir
    from megatron_ext.config.mlm_namespace import RunFacts, megatron_lm_args

    folder = iteration_dir(root, iteration)
    folder.mkdir(parents=True)
    cfg = Config(model=model)
    args = megatron_lm_args(cfg, RunFacts(1, 1, 128, 16, iteration, 16 * iteration))
    state = to_saved({"iteration": iteration, "config": dataclasses.asdict(cfg)}, args, samples_per_step=1)
    if tensors:
        state["w"] = ShardedTensor.from_rank_offsets("w", torch.arange(64.0).reshape(8, 8))
        state["b"] = ShardedTensor.from_rank_offsets("b", torch.ones(8))
    dist_checkpointing.save(state, str(folder))
    (root / TRACKER).write_text(f"{iteration}\n")
    return root


def write_gpt2(folder: Path) -> Path:
    """A Hugging Face folder of an architecture megatron's GPT model space does not hold."""
    import transformers  # heavy (seconds): only for the inputs fixture

    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)
    transformers.GPT2LMHeadModel(config).save_pretrained(folder)
    return folder


def write_documents(prefix: Path, count: int) -> Path:
    """An indexed dataset (`prefix`.bin/.idx) of `count` documents of byte-tokenizer ids."""
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder  # megatron: only for the inputs fixture

    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=DType.optimal_dtype(258))
    for d in range(count):
        builder.add_document(np.arange(d, d + 40), [40])
    builder.finalize(f"{prefix}.idx")
    return prefix


def shard(root: Path, number: int) -> Path:
    """Shard file `number` of iteration 3's checkpoint under `root`."""
    return root / "iter_0000003" / f"__0_{number}.distcp"


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """Files the cases point at, made once (the checkpoints need a one-rank world)."""
    from megatron_ext.platform.launch import join_world
    import torch.distributed as dist

    d = tmp_path_factory.mktemp("inputs")
    (d / "folder").mkdir()
    (d / "folder" / "text.idx").write_bytes(b"x")
    (d / "empty.bin").write_bytes(b"")
    (d / "empty.idx").write_bytes(b"x")
    (d / "noidx.bin").write_bytes(b"x")
    (d / "noidx.idx").write_bytes(b"")
    (d / "not.gguf").write_text("hello\n")
    cut(write_gguf(d / "truncated.gguf"), 16)
    (d / "hf").mkdir()
    (d / "hf" / "config.json").write_text('{"model_type": "llama", "architectures": ["LlamaForCausalLM"]}')
    save_file({"w": np.zeros((16, 16), np.float32)}, str(d / "hf" / "model.safetensors"))
    cut(d / "hf" / "model.safetensors", 8)
    (d / "garbage").mkdir()
    (d / "garbage" / "latest_checkpointed_iteration.txt").write_text("not a number\n")
    (d / "not_ckpt").mkdir()
    (d / "not_ckpt" / "notes.txt").write_text("x")
    write_gpt2(d / "gpt2")
    write_documents(d / "docs", 3)
    join_world("cpu")
    try:
        write_checkpoint(d / "small_ckpt", ModelConfig(num_layers=2, hidden_size=64))
        for name in ("whole_shards", "cut_shard", "lost_shard"):
            write_checkpoint(d / name, ModelConfig(num_layers=2, hidden_size=64), tensors=True)
    finally:
        dist.destroy_process_group()
    cut(shard(d / "cut_shard", 1), 3)
    shard(d / "lost_shard", 0).unlink()
    return d


SMALL = ["model.num_layers=2", "model.hidden_size=64"]

# id -> (overrides, with {d} the inputs folder; the field the line names; what else it says)
CASES = {
    "negative_lr": (["optim.lr=-0.1"], "optim.lr", "must be >= 0, got -0.1"),
    "beta_of_one": (["optim.adam_beta2=1.0"], "optim.adam_beta2", "in [0, 1)"),
    "min_lr_above_lr": (["optim.lr=1e-4", "optim.min_lr=1e-3"], "optim.min_lr", "<= optim.lr"),
    "zero_eps": (["optim.adam_eps=0"], "optim.adam_eps", "> 0"),
    "dropout_of_one": (["model.hidden_dropout=1.0"], "model.hidden_dropout", "in [0, 1)"),
    "zero_log_interval": (["logging.log_interval=0"], "logging.log_interval", "> 0"),
    "data_path_missing": (["data.data_path=[{d}/missing]"], "data.data_path", "{d}/missing.bin does not exist"),
    "data_path_folder": (["data.data_path=[{d}/folder]"], "data.data_path", "{d}/folder is a folder"),
    "empty_bin": (["data.data_path=[{d}/empty]"], "data.data_path", "{d}/empty.bin is empty"),
    "empty_idx": (["data.data_path=[{d}/noidx]"], "data.data_path", "{d}/noidx.idx is empty"),
    "empty_in_blend": (["data.data_path=[0.3,{d}/noidx,0.7,{d}/missing]"], "data.data_path", "{d}/noidx.idx"),
    "null_tokenizer_on_text": (["data.tokenizer=null:128"], "data.tokenizer", "null:128 (NullTokenizer) reads token ids, not text"),
    "corpus_missing": (["data.corpus={d}/no_such_text"], "data.corpus", "{d}/no_such_text does not exist"),
    "pretrained_missing": (["model.pretrained={d}/missing.gguf"], "model.pretrained", "{d}/missing.gguf does not exist"),
    "pretrained_not_gguf": (["model.pretrained={d}/not.gguf"], "model.pretrained", "{d}/not.gguf is not a GGUF file"),
    "pretrained_truncated_gguf": (["model.pretrained={d}/truncated.gguf"], "model.pretrained", "{d}/truncated.gguf is truncated"),
    "pretrained_truncated_safetensors": (["model.pretrained={d}/hf"], "model.pretrained", "{d}/hf/model.safetensors is truncated"),
    "pretrained_unsupported_architecture": (["model.pretrained={d}/gpt2"], "model.pretrained", "{d}/gpt2: config.json: model_type='gpt2' is not supported (architectures: GPT2LMHeadModel); the supported: LlamaForCausalLM (llama), MistralForCausalLM (mistral), "),
    "split_leaves_validation_empty": (["data.data_path=[{d}/docs]", "data.split='100,0,0'"], "data.split", "'100,0,0' leaves the valid split no documents of {d}/docs (3 documents), but evaluation reads it (train.eval_iters=4; 0 turns evaluation off)"),
    "split_leaves_training_empty": (["data.data_path=[0.5,{d}/docs,0.5,{d}/docs]", "data.split='0,90,10'"], "data.split", "'0,90,10' leaves the train split no documents of {d}/docs (3 documents), but training reads it"),
    "pretrained_package_missing": (["model.pretrained=pkg:no_such_package/x.gguf"], "model.pretrained", "not installed"),
    "garbage_tracker_in_save": (["checkpoint.save={d}/garbage"], "checkpoint.save", "{d}/garbage/latest_checkpointed_iteration.txt does not hold"),
    "garbage_tracker_in_load": (["checkpoint.load={d}/garbage"], "checkpoint.load", "{d}/garbage/latest_checkpointed_iteration.txt does not hold"),
    "load_typo": (["checkpoint.load={d}/small_ckpy"], "checkpoint.load", "{d}/small_ckpy does not exist"),
    "load_not_a_checkpoint": (["checkpoint.load={d}/not_ckpt"], "checkpoint.load", "{d}/not_ckpt holds no"),
    "load_step_missing": (["checkpoint.load={d}/small_ckpt", "checkpoint.step=7", "model.num_layers=2", "model.hidden_size=64"], "checkpoint.step", "{d}/small_ckpt/iter_0000007 is missing"),
    "load_other_shape": (["checkpoint.load={d}/small_ckpt"], "checkpoint.load", "model.num_layers=4 but the checkpoint has 2; model.hidden_size=128 but the checkpoint has 64"),
    "load_without_optimizer_state": (["checkpoint.load={d}/small_ckpt", "model.num_layers=2", "model.hidden_size=64"], "checkpoint.load", "{d}/small_ckpt/iter_0000003 holds no optimizer state (saved with --no-save-optim, checkpoint.save_optim=false): resume it with --no-load-optim"),
    "load_cut_shard": (["checkpoint.load={d}/cut_shard", *SMALL], "checkpoint.load", "shard {d}/cut_shard/iter_0000003/__0_1.distcp is cut short: "),
    "load_lost_shard": (["checkpoint.load={d}/lost_shard", *SMALL], "checkpoint.load", "shard {d}/lost_shard/iter_0000003/__0_0.distcp is missing"),
    "pretrained_cut_shard": (["model.pretrained={d}/cut_shard", *SMALL], "model.pretrained", "shard {d}/cut_shard/iter_0000003/__0_1.distcp is cut short"),
    "pretrained_other_shape": (["model.pretrained={d}/small_ckpt"], "model.pretrained", "{d}/small_ckpt/iter_0000003 holds another model shape"),
    "save_not_creatable": (["checkpoint.save=/proc/self/ckpt"], "checkpoint.save", "/proc/self/ckpt is not writable"),
    "iters_not_int": (["train.iters=abc"], "train.iters", "expected int, got 'abc'"),
    "bool_not_bool": (["parallel.sequence_parallel=maybe"], "parallel.sequence_parallel", "expected bool"),
    "key_typo": (["train.itres=5"], "train.itres", "did you mean train.iters (int)?"),
    "added_key_typo": (["+train.itres=5"], "train.itres", "did you mean train.iters (int)?"),
    "force_added_key": (["++optim.lrr=1"], "optim.lrr", "did you mean optim.lr (float)?"),
    "section_typo": (["trian.iters=5"], "trian.iters", "did you mean train.iters (int)?"),
    "preset_typo": (["model=llama_tinyy"], "model", "no preset 'llama_tinyy'; did you mean llama_tiny?"),
    "key_typo_with_hydra_flag": (["--cfg", "job", "train.itres=5"], "train.itres", "did you mean train.iters (int)?"),
    "key_typo_in_multirun": (["-m", "train.itres=5,6"], "train.itres", "did you mean train.iters (int)?"),
    "elastic_router_start": (["plugin=elastic", "elastic.router_start=size"], "elastic.router_start", "'size' is not one of quality, cost"),
    "elastic_distill_tokens": (["plugin=elastic", "elastic.distill_tokens=answers"], "elastic.distill_tokens", "'answers' is not one of loss_mask, all"),
}


def files_under(root: Path) -> set[Path]:
    return {p for p in root.rglob("*")}


@pytest.mark.parametrize("overrides, field, says", CASES.values(), ids=CASES.keys())
def test_bad_input_is_one_line_exit_2(overrides, field, says, inputs, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # Hydra's outputs/ would appear here
    args = [o.format(d=inputs) for o in overrides]
    if not any(a.startswith("checkpoint.save") for a in args):
        args.append(f"checkpoint.save={tmp_path}/save")
    before = files_under(inputs)
    with pytest.raises(SystemExit) as exit_:
        main([*args, *BASE])  # Hydra's flags first: its parser takes one run of overrides after them
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2
    assert len(err) == 1, err
    assert err[0].startswith(f"error: {field}: ") and f"{field}: {field}:" not in err[0], err[0]
    assert says.format(d=inputs) in err[0]
    assert "+train" not in err[0] and "+optim" not in err[0]  # Hydra's advice to add the key
    assert files_under(inputs) == before
    assert files_under(tmp_path) == set()


def test_a_vocabulary_below_the_tokenizers_is_one_line(tmp_path, monkeypatch, capsys):
    # The ids past the embedding would fail the first step with an IndexError.
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        main(["model.vocab_size=128", f"checkpoint.save={tmp_path}/save", *BASE])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: model.vocab_size: 128 is below the tokenizer's 258 ids: give at least 258, or leave it unset"
    ]
    assert files_under(tmp_path) == set()  # refused before launch: no save folder


@pytest.fixture
def read_only_dir(tmp_path):
    """A directory this process cannot write: made read-only, or for root (who writes through
    permissions) a read-only bind mount of it."""
    path = tmp_path / "read_only"
    path.mkdir()
    if os.geteuid() != 0:
        path.chmod(0o555)
        yield path
        path.chmod(0o755)
        return
    mount = ["mount", "--bind", str(path), str(path)]
    if subprocess.run(mount, capture_output=True).returncode != 0:
        pytest.skip("root, and no bind mount can be made read-only here")
    try:
        if subprocess.run(["mount", "-o", "remount,ro,bind", str(path)], capture_output=True).returncode != 0:
            pytest.skip("root, and no bind mount can be made read-only here")
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


def test_read_only_save_is_refused(read_only_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        main([*BASE, f"checkpoint.save={read_only_dir}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2
    assert len(err) == 1 and err[0].startswith(f"error: checkpoint.save: {read_only_dir} is not writable ("), err
    assert list(read_only_dir.iterdir()) == [] and sorted(p.name for p in tmp_path.iterdir()) == ["read_only"]


def _cli(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "WORLD_SIZE" and not k.startswith("SLURM_")}
    env["PYTHONPATH"] = str(REPO)
    return subprocess.run(
        [sys.executable, "-m", "megatron_ext.train", *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=120,
    )


# Through the real command line, in parallel: (id in CASES, ...)
CLI_CASES = ("added_key_typo", "negative_lr", "pretrained_truncated_gguf", "pretrained_unsupported_architecture")


def test_cli_cases(inputs, tmp_path):
    def one(name: str) -> tuple[str, subprocess.CompletedProcess]:
        overrides, _, _ = CASES[name]
        work = tmp_path / name
        work.mkdir()
        args = [*BASE, *(o.format(d=inputs) for o in overrides), f"checkpoint.save={work}/save"]
        return name, _cli(args, cwd=work)

    with ThreadPoolExecutor(len(CLI_CASES)) as pool:
        results = dict(pool.map(one, CLI_CASES))
    for name, done in results.items():
        _, field, says = CASES[name]
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2, (name, done.stderr)
        assert len(lines) == 1 and lines[0].startswith(f"error: {field}: "), (name, lines)
        assert says.format(d=inputs) in lines[0], (name, lines)
        assert list((tmp_path / name).iterdir()) == [], name


# Inputs the preflight must let through: (id, overrides).
GOOD = {
    "resume_if_present_first_run": ["checkpoint.save={t}/run", "checkpoint.load={t}/run"],
    "load_optional_missing": ["checkpoint.load={t}/missing", "checkpoint.load_optional=true"],
    # The checkpoint is model-only: resumed without its optimizer, as Megatron-LM's --no-load-optim.
    "same_shape_checkpoint": ["checkpoint.load={d}/small_ckpt", "model.num_layers=2", "model.hidden_size=64", "checkpoint.load_optim=false"],
    # MLA is off on both sides, so its ranks shape nothing (Megatron-LM's --kv-lora-rank default is 32).
    "unused_mla_rank_differs": ["checkpoint.load={d}/small_ckpt", "model.num_layers=2", "model.hidden_size=64", "checkpoint.load_optim=false", "model.kv_lora_rank=32"],
    "whole_shards": ["checkpoint.load={d}/whole_shards", *SMALL, "checkpoint.load_optim=false"],
    # Nothing reads the validation split when evaluation is off.
    "split_without_evaluation": ["data.data_path=[{d}/docs]", "data.split='100,0,0'", "train.eval_iters=0"],
}


@pytest.mark.parametrize("overrides", GOOD.values(), ids=GOOD.keys())
def test_good_inputs_pass(overrides, inputs, tmp_path):
    from megatron_ext.config import compose_config
    from megatron_ext.train import preflight

    preflight(compose_config([*BASE, *(o.format(d=inputs, t=tmp_path) for o in overrides)]))


def test_cut_shard_names_both_sizes(inputs, capsys):
    """The sizes in the line: the whole file's (what its metadata needs) and what is left."""
    whole = shard(inputs / "whole_shards", 1).stat().st_size
    with pytest.raises(SystemExit):
        main([*BASE, f"checkpoint.load={inputs}/cut_shard", *SMALL])
    assert capsys.readouterr().err.strip().endswith(f"cut short: {whole - 3} bytes, the checkpoint's metadata needs {whole}")


def test_checkpoint_files_refuses_an_unchecked_torch(inputs):
    from megatron_ext.platform.checkpoint_storage import UncheckedTorch, checkpoint_files

    folder = inputs / "whole_shards" / "iter_0000003"
    assert checkpoint_files(folder, "2.13.0") == {p.name: p.stat().st_size for p in folder.glob("*.distcp")}
    with pytest.raises(UncheckedTorch, match=r"^torch 2\.99\.0 is outside the versions .* \(2\.6 to 2\.14\)$"):
        checkpoint_files(folder, "2.99.0")


def test_whole_files_pass_the_header_checks(tmp_path):
    check_gguf(str(write_gguf(tmp_path / "whole.gguf")))
    save_file({"w": np.zeros((16, 16), np.float32)}, str(tmp_path / "whole.safetensors"))
    check_safetensors(str(tmp_path / "whole.safetensors"))


def test_smollm_gguf_passes_and_its_truncation_is_named(smollm_gguf, tmp_path):
    check_gguf(str(smollm_gguf))
    with open(smollm_gguf, "rb") as src, open(tmp_path / "cut.gguf", "wb") as dst:
        dst.write(src.read(os.path.getsize(smollm_gguf) - 1))
    with pytest.raises(ValueError, match="cut.gguf is truncated"):
        check_gguf(str(tmp_path / "cut.gguf"))
