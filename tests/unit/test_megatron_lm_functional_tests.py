"""Megatron-LM's functional test cases as `python -m megatron_ext.pretrain_gpt` command lines
(tests/fixtures/megatron_lm/functional_tests.json, made from a Megatron-LM checkout by
scripts/megatron_lm_functional_tests.py): its docs page is current, and every recorded command
line still translates, or is refused with exactly the recorded lines. No Megatron-LM source is
needed: the JSON holds the command lines."""

from __future__ import annotations

import json

from megatron_ext.config.mlm_args import MlmArgsError, translate
from tests.unit._functional_tests_script import functional_tests_script

SCRIPT = functional_tests_script()
REGENERATE = (
    "python scripts/megatron_lm_functional_tests.py --megatron-lm <Megatron-LM> && "
    "python scripts/megatron_lm_functional_tests.py --run (tests/fixtures/megatron_lm/README.md)"
)


def recorded() -> dict:
    return json.loads(SCRIPT.JSON_PATH.read_text())


def outcome(argv: list[str]) -> tuple[str, list[str]]:
    """(status, refusal lines) of a command line, as the JSON records them."""
    try:
        translate(argv)
    except MlmArgsError as error:
        return "refused", error.problems
    return "translates", []


def test_page_is_current():
    page = SCRIPT.REPO / SCRIPT.PAGE_PATH
    assert page.read_text() == SCRIPT.page_markdown(recorded()), (
        f"{SCRIPT.PAGE_PATH} is stale: python scripts/megatron_lm_functional_tests.py --page > {SCRIPT.PAGE_PATH}"
    )


def test_each_command_line_translates_or_is_refused_as_recorded():
    changed = {}
    for case in recorded()["cases"]:
        if case["status"] == "empty":  # no MODEL_ARGS: nothing to translate
            continue
        now = outcome(case["argv"])
        if now != (case["status"], case["refusals"]):
            changed[case["name"]] = now
    # A change here is news: a flag now maps (or no longer does); regenerate the JSON and page.
    assert changed == {}, f"translate() disagrees with the JSON; {REGENERATE}"


def test_the_end_to_end_sample_ran_dense_moe_and_pipelines():
    cases = {case["name"]: case for case in recorded()["cases"]}
    sample = [cases[name] for name in SCRIPT.SAMPLE]
    assert all(case["end_to_end"] is not None for case in sample), f"not run: {REGENERATE}"
    assert [step["exit_code"] for case in sample for step in case["end_to_end"]["runs"]] == [0] * 6
    layouts = [SCRIPT.layout(case["argv"]) for case in sample]
    assert any("--num-experts" in case["argv"] for case in sample)
    assert any("--num-experts" not in case["argv"] for case in sample)
    assert any(size["pp"] > 1 for size in layouts) and any(size["ep"] > 1 for size in layouts)


def test_model_args_become_the_runners_argv():
    """_run_training.sh: true is the bare flag, [a b] its words, (...) and spaced values one word."""
    model_args = {"--bf16": True, "--split": "949,50,1", "--recompute-modules": "[mlp moe_act]",
                  "--moe-layer-freq": "([0]*1+[1]*3)", "--sizes": "2 2"}
    assert SCRIPT.argv_of(model_args) == [
        "--bf16", "--split", "949,50,1", "--recompute-modules", "mlp", "moe_act",
        "--moe-layer-freq", "([0]*1+[1]*3)", "--sizes", "2 2",
    ]


def test_yaml_values_keep_their_text():
    text = "MODEL_ARGS:\n  --min-lr: 1.0e-5\n  --lr-warmup-fraction: .01\n  --bf16: true\n  --x: off\n"
    loaded = SCRIPT.yaml.load(text, Loader=SCRIPT._ScalarsAsText)["MODEL_ARGS"]
    assert loaded == {"--min-lr": "1.0e-5", "--lr-warmup-fraction": ".01", "--bf16": True, "--x": "off"}


def test_the_clusters_files_are_replaced_and_recorded():
    argv = ["--data-path", "${DATA_PATH}/text/doc", "--vocab-file", "${DATA_PATH}/bpe/vocab.json",
            "--merge-file", "${DATA_PATH}/bpe/merges.txt", "--save", "${CHECKPOINT_SAVE_PATH}"]
    local, replacements = SCRIPT.localise(argv, "gpt/case")
    assert local == ["--mock-data", "--save", f"{SCRIPT.ROOT}/gpt/case/checkpoints",
                     "--tokenizer-type", "NullTokenizer", "--vocab-size", "50257"]
    assert [r["was"] for r in replacements] == [
        "--data-path ${DATA_PATH}/text/doc", "--vocab-file ${DATA_PATH}/bpe/vocab.json",
        "--merge-file ${DATA_PATH}/bpe/merges.txt", None, "--save ${CHECKPOINT_SAVE_PATH}",
    ]


def test_shrunk_layouts_take_the_fewest_ranks():
    moe = ["--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "2", "--num-experts", "8"]
    argv, nproc, _ = SCRIPT.shrink(moe)
    assert nproc == 4 and SCRIPT.flag_value(argv, "--global-batch-size") == "4"  # dp 2
    vpp = ["--pipeline-model-parallel-size", "4", "--num-layers-per-virtual-pipeline-stage", "3"]
    argv, nproc, _ = SCRIPT.shrink(vpp)
    assert nproc == 4 and SCRIPT.flag_value(argv, "--num-layers") == "8"
    assert SCRIPT.flag_value(argv, "--num-layers-per-virtual-pipeline-stage") == "1"
