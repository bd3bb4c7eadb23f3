"""Megatron-LM's functional test cases as `python -m megatron_ext.pretrain_gpt` command lines.

    python scripts/megatron_lm_functional_tests.py --megatron-lm DIR [--tag core_v0.16.1]
    python scripts/megatron_lm_functional_tests.py --run [--root DIR]
    python scripts/megatron_lm_functional_tests.py --page > docs/megatron_lm_functional_tests.md

The first form reads every tests/functional_tests/test_cases/{gpt,moe}/*/model_config.yaml of
the Megatron-LM git repository DIR (a checkout or a bare mirror) at the tag, turns each MODEL_ARGS
mapping into an argv the way Megatron-LM's tests/functional_tests/shell_test_utils/_run_training.sh
does, with its ${VAR} paths replaced by local ones (the data and tokenizer files by --mock-data and a
NullTokenizer), translates it with `megatron_ext.config.mlm_args.translate` (no training) and
writes tests/fixtures/megatron_lm/functional_tests.json: per case its argv, the replacements made,
and whether it translates (with its notices, and whether the composed config passes the launch
checks at the world size Megatron-LM's CI runs it on) or is refused (with the refusal lines).
`--run` trains the end-to-end sample (SAMPLE) shrunk (SHRINK) through `python -m
megatron_ext.pretrain_gpt`, a ckpt-resume case twice as Megatron-LM's runner does (the second run
resumes from the middle iteration), and records the command lines and exit codes in the JSON;
`--page` prints the docs page generated from the JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import yaml

REPO = Path(__file__).resolve().parents[1]
JSON_PATH = REPO / "tests" / "fixtures" / "megatron_lm" / "functional_tests.json"
PAGE_PATH = "docs/megatron_lm_functional_tests.md"
TAG = "core_v0.16.1"
FOLDERS = ("tests/functional_tests/test_cases/gpt", "tests/functional_tests/test_cases/moe")
# The stand-in for the folder the local paths of the recorded command lines are under (one
# folder per case): `--run` puts its own folder there.
ROOT = "$ROOT"
# Megatron-LM's runner reads one MODEL_ARGS mapping per run: MODEL_ARGS, MODEL_ARGS_2, ...
RUN_KEY = re.compile(r"^MODEL_ARGS(_\d+)?$")

# The ${VAR}s of the test cases, as paths under the case's folder (the runner's own settings
# are shared folders on its cluster). DATA_PATH's files are handled by flag (_data_and_tokenizer).
LOCAL_DIRS = {
    "TENSORBOARD_PATH": "tensorboard",
    "CHECKPOINT_SAVE_PATH": "checkpoints",
    # The runner's load folder: an empty one for fresh runs, its stored checkpoints otherwise.
    "CHECKPOINT_LOAD_PATH": "load",
    "DATA_CACHE_PATH": "data_cache",
    "DATA_PATH": "data",
    "OUTPUT_PATH": "output",
    "INFERENCE_OUTPUT_PATH": "inference_output",
    "WANDB_SAVE_PATH": "wandb",
}
# Tokenizer files on Megatron-LM's cluster -> the vocabulary size the NullTokenizer gets.
VOCAB_SIZES = {
    "vocab.json": 50257,  # the_pile's GPT-2 BPE files (--vocab-file / --merge-file)
    "merges.txt": 50257,
    "multiMixV8.gpt4o_nc_sd.500000.128k.vocab.json": 131072,  # a 128k tiktoken vocabulary
    "nemotron_2_256k.model": 256000,  # Nemotron's 256k SentencePiece model
}
DEFAULT_VOCAB = 50257
TOKENIZER_FILES = ("--vocab-file", "--merge-file", "--tokenizer-model")


# ---------------------------------------------------------------------------------------------
# Reading the test cases


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout


class _ScalarsAsText(yaml.SafeLoader):
    """YAML with every plain scalar kept as its text (yq prints values as written: `1.0e-5`
    stays `1.0e-5`, `949,50,1` a string), except true/false and `<<` merges."""


_ScalarsAsText.yaml_implicit_resolvers = {}
_ScalarsAsText.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)
_ScalarsAsText.add_implicit_resolver("tag:yaml.org,2002:merge", re.compile(r"^<<$"), ["<"])


def read_cases(repo: Path, tag: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """(folder/case name, parsed model_config.yaml) for every case under FOLDERS at `tag`."""
    for path in git(repo, "ls-tree", "-r", "--name-only", tag, *FOLDERS).split():
        if path.endswith("/model_config.yaml"):
            name = "/".join(path.split("/")[-3:-1])
            yield name, yaml.load(git(repo, "show", f"{tag}:{path}"), Loader=_ScalarsAsText)


def runs(name: str, config: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(name, key) of each MODEL_ARGS* mapping of a case (one run of Megatron-LM's runner each);
    the later ones of a case with several are named case#MODEL_ARGS_N."""
    keys = sorted((k for k in config if RUN_KEY.match(k)), key=lambda k: int(k[11:] or 1))
    for key in keys:
        yield (name if key == "MODEL_ARGS" else f"{name}#{key}"), key


def argv_of(model_args: dict[str, Any]) -> list[str]:
    """MODEL_ARGS as _run_training.sh passes it: `true` is the bare flag, `(...)` and values with
    spaces one word, `[a b]` its words without the brackets, anything else one word."""
    argv: list[str] = []
    for flag, value in model_args.items():
        text = str(value).strip().lower() if isinstance(value, bool) else str(value).strip()
        if value is True:
            argv.append(flag)
        elif re.fullmatch(r"\[[^]]+\]", text):
            argv += [flag, *text[1:-1].split()]
        else:  # false too: the runner passes `--flag false` (no case gives one)
            argv += [flag, text]
    return argv


# ---------------------------------------------------------------------------------------------
# Local paths for the files of Megatron-LM's cluster


def _replacement(was: Optional[str], now: Optional[str], why: str) -> dict[str, Optional[str]]:
    return {"was": was, "now": now, "why": why}


def _pairs(argv: Sequence[str]) -> list[list[str]]:
    """The argv as [flag, value...] groups (a flag and the words up to the next flag)."""
    groups: list[list[str]] = []
    for word in argv:
        if word.startswith("--") or not groups:
            groups.append([word])
        else:
            groups[-1].append(word)
    return groups


def _data_and_tokenizer(groups: list[list[str]], replacements: list[dict]) -> list[list[str]]:
    """The cluster's dataset becomes --mock-data, its tokenizer files a NullTokenizer of the
    files' vocabulary size: neither exists here, and the model sees ids either way."""
    named = [g for g in groups if g[0] in TOKENIZER_FILES and "${" in " ".join(g[1:])]
    kept: list[list[str]] = []
    for group in groups:
        text = " ".join(group)
        if group[0] == "--data-path" and "${" in text:
            replacements.append(_replacement(text, "--mock-data", "the dataset is not here"))
            kept.append(["--mock-data"])
        elif named and group in named:
            replacements.append(_replacement(text, None, "the tokenizer file is not here"))
        elif named and group[0] == "--tokenizer-type":
            replacements.append(_replacement(text, None, "its tokenizer file is not here"))
        else:
            kept.append(group)
    if named and not any(g[0] == "--vocab-size" for g in groups):
        size = VOCAB_SIZES.get(Path(named[0][-1]).name, DEFAULT_VOCAB)
        now = ["--tokenizer-type", "NullTokenizer", "--vocab-size", str(size)]
        replacements.append(_replacement(None, " ".join(now), "token ids of the replaced tokenizer's vocabulary size"))
        kept.append(now)
    return kept


def _variables(text: str, case_dir: str, name: str) -> str:
    def local(match: re.Match) -> str:
        var = match.group(1)
        if var in LOCAL_DIRS:
            return f"{case_dir}/{LOCAL_DIRS[var]}"
        if var == "REPEAT":  # the runner's repeat counter: the first repeat
            return "1"
        if var == "WANDB_EXPERIMENT":
            return name.replace("/", "_").replace("#", "_")
        raise SystemExit(f"{name}: no local value for ${{{var}}}: add it to LOCAL_DIRS")

    return re.sub(r"\$\{(\w+)\}", local, text)


def localise(argv: Sequence[str], name: str) -> tuple[list[str], list[dict]]:
    """The argv with the cluster's files replaced (each replacement recorded)."""
    case_dir = f"{ROOT}/{name.replace('#', '/')}"
    replacements: list[dict] = []
    groups = _data_and_tokenizer(_pairs(argv), replacements)
    out: list[str] = []
    for group in groups:
        text = " ".join(group)
        local = [_variables(word, case_dir, name) for word in group]
        if local != group:
            replacements.append(_replacement(text, " ".join(local), "a local folder"))
        out += local
    return out, replacements


def runner_additions(argv: list[str], config: dict[str, Any], replacements: list[dict]) -> list[str]:
    """What Megatron-LM's run_ci_test.sh adds to a pretraining run's MODEL_ARGS outside its
    lightweight mode: --exit-interval = --train-iters."""
    if config.get("MODE", "pretraining") != "pretraining" or str(config.get("TEST_TYPE")).strip() == "release":
        return argv
    if "--train-iters" not in argv or "--exit-interval" in argv:
        return argv
    iters = argv[argv.index("--train-iters") + 1]
    replacements.append(_replacement(None, f"--exit-interval {iters}", "run_ci_test.sh sets --exit-interval to --train-iters"))
    return [*argv, "--exit-interval", iters]


# ---------------------------------------------------------------------------------------------
# Translation and the launch checks


def translated(argv: Sequence[str]) -> dict[str, Any]:
    """status translates (its notices) or refused (its refusal lines), by translate()."""
    from megatron_ext.config.mlm_args import MlmArgsError, translate

    try:
        notices = translate(argv).notices
    except MlmArgsError as error:
        return {"status": "refused", "notices": [], "refusals": error.problems}
    return {"status": "translates", "notices": notices, "refusals": []}


def launch_checks(argv: Sequence[str], world: int) -> str:
    """"passed", or the first broken rule, of the composed config at `world` ranks: what
    `python -m megatron_ext.pretrain_gpt` checks before it starts anything (files aside)."""
    from megatron_ext.config.mlm_args import translate
    from megatron_ext.config.store import compose_config
    from megatron_ext.config.validate import ConfigError, validate_run

    try:
        validate_run(compose_config(translate(argv).overrides), world)
    except (ConfigError, ValueError) as error:
        return str(error)
    return "passed"


def ci_world(config: dict[str, Any], key: str) -> int:
    """The GPUs Megatron-LM's CI runs the run on: its recipes' 8, or MODEL_ENV_VARS' count."""
    return int((config.get("MODEL_ENV_VARS") or {}).get(key, {}).get("GPUS_PER_NODE", 8))


def case_record(name: str, config: dict[str, Any], key: str) -> dict[str, Any]:
    model_args = config[key] or {}
    argv, replacements = localise(argv_of(model_args), name)
    argv = runner_additions(argv, config, replacements)
    record = {
        "name": name,
        "mode": str(config.get("MODE", "pretraining")).strip(),
        "test_type": str(config.get("TEST_TYPE", "regular")).strip(),
        "world": ci_world(config, key),
        "argv": argv,
        "replacements": replacements,
    }
    if not model_args:  # the case runs a script of its own (cuda_graphs.sh), not MODEL_ARGS
        return {**record, "status": "empty", "notices": [], "refusals": [], "launch_checks": None,
                "end_to_end": None}
    result = translated(argv)
    checks = launch_checks(argv, record["world"]) if result["status"] == "translates" else None
    return {**record, **result, "launch_checks": checks, "end_to_end": None}


def build(repo: Path, tag: str) -> dict[str, Any]:
    cases = [case_record(name, config, key)
             for case, config in read_cases(repo, tag) for name, key in runs(case, config)]
    commit = git(repo, "rev-parse", f"{tag}^{{commit}}").strip()
    return {"megatron_lm": {"tag": tag, "commit": commit, "folders": list(FOLDERS)}, "cases": cases}


# ---------------------------------------------------------------------------------------------
# The end-to-end sample, shrunk

# Dense with TP x PP, PP with interleaving (VPP), MoE with TP x EP, MoE with CP x PP x EP, and a
# ckpt-resume case (trained, then resumed from its middle checkpoint): 4 ranks at most.
SAMPLE = (
    "gpt/gpt3_mcore_te_tp2_pp2",
    "gpt/gpt3_mcore_te_tp1_pp4_vp1_dist_optimizer_overlap_grad_reduce_param_gather",
    "moe/gpt3_mcore_te_tp2_pp1_te_8experts2parallel_dist_optimizer",
    "moe/gpt3_mcore_cp2_pp2_ep2_te_4experts2parallel_nondeterministic",
    "gpt/gpt3_mcore_te_tp1_pp2_resume_torch_dist_rope_embeddings",
)
ITERS = 4
# Set where the case gives the flag: sizes a CPU trains in seconds (heads divide TP <= 4).
SHRINK = {
    "--hidden-size": 64, "--num-attention-heads": 4, "--ffn-hidden-size": 128, "--kv-channels": 16,
    "--seq-length": 64, "--max-position-embeddings": 64, "--micro-batch-size": 1,
    "--num-experts": 4, "--moe-ffn-hidden-size": 32, "--moe-shared-expert-intermediate-size": 32,
    "--lr-decay-iters": ITERS, "--lr-warmup-iters": 1, "--save-interval": ITERS // 2,
    "--eval-interval": ITERS // 2, "--eval-iters": 1, "--vocab-size": 512,
    "--num-layers-per-virtual-pipeline-stage": 1,
}


def flag_value(argv: Sequence[str], flag: str, default: Optional[str] = None) -> Optional[str]:
    """The (last) value of `flag` in argv, as argparse keeps the last."""
    values = [argv[i + 1] for i, word in enumerate(argv[:-1]) if word == flag]
    return values[-1] if values else default


def set_flag(argv: list[str], flag: str, value: Any) -> list[str]:
    """argv with `flag`'s value replaced (every occurrence), or the flag appended."""
    if flag not in argv:
        return [*argv, flag, str(value)]
    return [str(value) if i and argv[i - 1] == flag else word for i, word in enumerate(argv)]


def layout(argv: Sequence[str]) -> dict[str, int]:
    sizes = {"tp": "--tensor-model-parallel-size", "pp": "--pipeline-model-parallel-size",
             "cp": "--context-parallel-size", "ep": "--expert-model-parallel-size"}
    out = {k: int(flag_value(argv, flag, "1")) for k, flag in sizes.items()}
    out["etp"] = int(flag_value(argv, "--expert-tensor-parallel-size", str(out["tp"])))
    return out


def ranks(argv: Sequence[str]) -> int:
    """The fewest ranks of the case's layout: PP times a multiple of both TP x CP (the dense
    grid) and expert TP x EP (the expert grid), as megatron-core's groups need."""
    size = layout(argv)
    return size["pp"] * math.lcm(size["tp"] * size["cp"], size["etp"] * size["ep"])


def num_layers(argv: Sequence[str]) -> int:
    """Layers for every pipeline stage (and virtual stage) to hold one, two at least."""
    pp = layout(argv)["pp"]
    if "--num-layers-per-virtual-pipeline-stage" in argv:
        return 2 * pp  # one layer per virtual stage: two chunks per rank
    chunks = int(flag_value(argv, "--num-virtual-stages-per-pipeline-rank", "1"))
    return max(2, pp * chunks)


def shrink(argv: Sequence[str]) -> tuple[list[str], int, list[str]]:
    """The case shrunk to train ITERS iterations on this machine: (argv, ranks, changes)."""
    nproc, size = ranks(argv), layout(argv)
    dp = nproc // (size["tp"] * size["pp"] * size["cp"])
    wanted = {flag: value for flag, value in SHRINK.items() if flag in argv}
    # Every micro-batch count the pipeline schedules take: a multiple of PP, 2 at least.
    wanted.update({"--num-layers": num_layers(argv), "--train-iters": ITERS, "--exit-interval": ITERS,
                   "--global-batch-size": dp * max(2, size["pp"])})
    out, changes = list(argv), []
    for flag, value in wanted.items():
        was = flag_value(out, flag)
        if was != str(value):
            changes.append(f"{flag} {was} -> {value}" if was is not None else f"{flag} {value} (added)")
            out = set_flag(out, flag, value)
    return out, nproc, changes


def resumed(argv: Sequence[str]) -> list[str]:
    """The second run of a ckpt-resume case: Megatron-LM's runner loads what the first saved."""
    return set_flag(list(argv), "--load", flag_value(argv, "--save"))


def end_to_end_plan(case: dict[str, Any]) -> dict[str, Any]:
    argv, nproc, changes = shrink(case["argv"])
    plan = [{"argv": argv, "resumes_iteration": None}]
    if case["test_type"] == "ckpt-resume":
        plan.append({"argv": resumed(argv), "resumes_iteration": ITERS // 2})
    return {"nproc": nproc, "shrunk": changes, "runs": plan}


def rewind(save: Path, iteration: int) -> None:
    """What run_ci_test.sh does between a ckpt-resume case's runs: the checkpoints after
    `iteration` removed, the tracker pointing at it."""
    for folder in save.glob("iter_*"):
        if int(folder.name[5:]) > iteration:
            shutil.rmtree(folder)
    (save / "latest_checkpointed_iteration.txt").write_text(f"{iteration}\n")


def with_root(argv: Sequence[str], root: str) -> list[str]:
    return [word.replace(ROOT, root) for word in argv]


def run_case(plan: dict[str, Any], root: str, timeout: int = 900) -> list[subprocess.CompletedProcess]:
    """The plan's runs in order under `root` (ROOT's stand-in), stopping at a failed one."""
    results = []
    for step in plan["runs"]:
        argv = with_root(step["argv"], root)
        if step["resumes_iteration"] is not None:
            rewind(Path(flag_value(argv, "--save")), step["resumes_iteration"])
        command = [sys.executable, "-m", "megatron_ext.pretrain_gpt", *argv, "--nproc", str(plan["nproc"])]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
        results.append(subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout))
        if results[-1].returncode != 0:
            break
    return results


def run_sample(data: dict[str, Any], root: str) -> None:
    by_name = {case["name"]: case for case in data["cases"]}
    for name in SAMPLE:
        case = by_name[name]
        plan = end_to_end_plan(case)
        shutil.rmtree(Path(root) / name, ignore_errors=True)
        results = run_case(plan, root)
        for step, result in zip(plan["runs"], results):
            step["exit_code"] = result.returncode
            print(f"{name}: exit {result.returncode}", file=sys.stderr)
            if result.returncode:
                print(result.stderr[-3000:], file=sys.stderr)
        case["end_to_end"] = plan


# ---------------------------------------------------------------------------------------------
# Refusals by reason, and the page


def refused_flag(line: str) -> str:
    """The flag a refusal line names (`--flag value: reason` -> `--flag`), or the whole line
    where it names none (argparse's own messages)."""
    head = line.split(":", 1)[0]
    return head.split()[0] if head.startswith("--") else line


def reason_of(line: str) -> str:
    return line.split(": ", 1)[1] if line.startswith("--") and ": " in line else ""


def refusals_by_flag(cases: Sequence[dict[str, Any]]) -> list[tuple[str, str, int]]:
    """(flag, reason, how many of the command lines it refuses), most first."""
    counts: Counter = Counter()
    for case in cases:
        counts.update({(refused_flag(line), reason_of(line)) for line in case["refusals"]})
    return sorted(((flag, reason, n) for (flag, reason), n in counts.items()), key=lambda row: (-row[2], row[0]))


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _summary(data: dict[str, Any]) -> list[str]:
    cases, source = data["cases"], data["megatron_lm"]
    status = Counter((c["mode"] == "pretraining", c["status"]) for c in cases)
    passed = sum(c["launch_checks"] == "passed" for c in cases)
    folders = " and ".join(f"`{f}`" for f in source["folders"])
    return [
        f"Megatron-LM's functional test cases under {folders} at tag `{source['tag']}` (commit "
        f"`{source['commit']}`): {len({c['name'].split('#')[0] for c in cases})} cases, "
        f"{len(cases)} command lines (a case with several MODEL_ARGS mappings runs each). Each "
        "MODEL_ARGS mapping is made a command line as Megatron-LM's runner "
        "(`tests/functional_tests/shell_test_utils/_run_training.sh`) makes it, with local paths: "
        "the dataset becomes `--mock-data`, the tokenizer files a NullTokenizer of their vocabulary "
        "size, the other `${VAR}` folders local ones; then translated (flags only, no training).",
        "",
        f"- pretraining (`pretrain_gpt.py`): {status[True, 'translates']} translate, "
        f"{status[True, 'refused']} refused, {status[True, 'empty']} without MODEL_ARGS;",
        f"- inference and RL (`MODE: inference` / `rl`, which Megatron-LM runs with "
        f"`examples/inference/gpt/` and `train_rl.py`, not `pretrain_gpt.py`): "
        f"{status[False, 'translates']} translate, {status[False, 'refused']} refused;",
        f"- of the command lines that translate, {passed} pass the launch checks (the config rules "
        "at the number of GPUs Megatron-LM's CI gives the case).",
    ]


def _refusal_table(cases: Sequence[dict[str, Any]]) -> list[str]:
    lines = ["| flag | reason | command lines |", "| --- | --- | --- |"]
    for flag, reason, count in refusals_by_flag(cases):
        lines.append(f"| `{_cell(flag)}` | {_cell(reason)} | {count} |")
    return lines


def _end_to_end_table(cases: Sequence[dict[str, Any]]) -> list[str]:
    lines = ["| test case | ranks | runs | exit codes | shrunk |", "| --- | --- | --- | --- | --- |"]
    for case in cases:
        plan = case["end_to_end"]
        if plan is None:
            continue
        codes = ", ".join(str(step.get("exit_code", "not run")) for step in plan["runs"])
        runs = "trained, then resumed" if len(plan["runs"]) > 1 else "trained"
        lines.append(f"| `{case['name']}` | {plan['nproc']} | {runs} | {codes} | {_cell('; '.join(plan['shrunk']))} |")
    return lines


def _case_table(cases: Sequence[dict[str, Any]]) -> list[str]:
    lines = ["| test case | mode | status | refused flags and reasons |", "| --- | --- | --- | --- |"]
    for case in cases:
        status = case["status"]
        if status == "translates" and case["launch_checks"] != "passed":
            status += f" (launch checks: {case['launch_checks']})"
        why = "<br>".join(_cell(line) for line in case["refusals"])
        lines.append(f"| `{case['name']}` | {case['mode']} | {_cell(status)} | {why} |")
    return lines


def page_markdown(data: dict[str, Any]) -> str:
    """docs/megatron_lm_functional_tests.md, from the JSON."""
    cases = data["cases"]
    lines = [
        "# Megatron-LM's functional tests as command lines",
        "",
        f"Generated from `{JSON_PATH.relative_to(REPO)}` by `python "
        "scripts/megatron_lm_functional_tests.py --page`; do not edit by hand. The JSON holds each "
        "command line, the replacements made in it and its notices; "
        "`tests/fixtures/megatron_lm/README.md` says how it is made.",
        "",
        *_summary(data),
        "",
        "## Refused flags",
        "",
        "The flags that stop a pretraining command line, with the number of command lines each "
        "stops (a line stopped by several flags counts for each). The [flag table](megatron_flags.md) "
        "has every flag. The inference and RL command lines are stopped by their scripts' own flags "
        "(sampling, serving, GRPO), unknown to `pretrain_gpt.py` or refused as RL; the last table "
        "lists them.",
        "",
        *_refusal_table([case for case in cases if case["mode"] == "pretraining"]),
        "",
        "## Run end to end",
        "",
        f"A sample, shrunk to a few layers, hidden size 64, sequence 64 and {ITERS} iterations on "
        "the fewest ranks of its layout, trained by `python -m megatron_ext.pretrain_gpt` "
        "(`tests/distributed/test_megatron_lm_functional_runs.py`, marked `slow`); a ckpt-resume "
        "case is resumed from its middle checkpoint, as Megatron-LM's runner does.",
        "",
        *_end_to_end_table(cases),
        "",
        "## Every command line",
        "",
        *_case_table(cases),
    ]
    return "\n".join(lines) + "\n"


def to_json(data: dict[str, Any]) -> str:
    """The JSON with one case a line: a regenerated file's diff shows the cases that changed."""
    cases = ",\n".join(json.dumps(case) for case in data["cases"])
    return f'{{"megatron_lm": {json.dumps(data["megatron_lm"])},\n"cases": [\n{cases}\n]}}\n'


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megatron-lm", type=Path, help="Megatron-LM git repository (checkout or bare)")
    parser.add_argument("--tag", default=TAG)
    parser.add_argument("--json", type=Path, default=JSON_PATH)
    parser.add_argument("--run", action="store_true", help="run the end-to-end sample, record it in the JSON")
    parser.add_argument("--root", default=os.path.join(tempfile.gettempdir(), "megatron_lm_functional_tests"),
                        help="where --run writes (what ROOT stands for)")
    parser.add_argument("--page", action="store_true", help="print the docs page made from the JSON")
    args = parser.parse_args(argv)
    if args.page:
        print(page_markdown(json.loads(args.json.read_text())), end="")
        return
    if args.megatron_lm is not None:
        data = build(args.megatron_lm, args.tag)
    elif args.run:
        data = json.loads(args.json.read_text())
    else:
        parser.error("give --megatron-lm, --run or --page")
    if args.run:
        run_sample(data, args.root)
    args.json.write_text(to_json(data))
    print(f"{len(data['cases'])} command lines: {dict(Counter(c['status'] for c in data['cases']))}", file=sys.stderr)


if __name__ == "__main__":
    main()
