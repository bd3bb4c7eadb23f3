"""Megatron-LM command lines -> Hydra overrides -> our Config; the flag table and its doc."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from megatron_ext.config import Config, compose_config
from megatron_ext.config.explain import schema_keys
from megatron_ext.config.mlm_args import (
    ALL_FLAGS,
    MlmArgsError,
    build_parser,
    flag_table_markdown,
    mlm_args_to_overrides,
    translate,
)
from megatron_ext.config.mlm_flags import MAPPED, NOTICE, REFUSED
from megatron_ext.platform import optional
from megatron_ext.pretrain_gpt import main

REPO = Path(__file__).resolve().parents[2]


def as_dict(overrides: list[str]) -> dict[str, str]:
    return dict(o.split("=", 1) for o in overrides)


def field(cfg, path: str):
    for part in path.split("."):
        cfg = getattr(cfg, part)
    return cfg


# (id, command line, overrides it must contain, Config fields after composing)
CASES = [
    (
        "parallel",
        "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --context-parallel-size 2 "
        "--expert-model-parallel-size 2 --sequence-parallel --use-distributed-optimizer --nproc 8 "
        "--overlap-grad-reduce",
        {"parallel.tp": "2", "parallel.pp": "2", "parallel.cp": "2", "parallel.ep": "2",
         "parallel.sequence_parallel": "true", "parallel.use_distributed_optimizer": "true",
         "launcher.nproc": "8", "parallel.overlap_grad_reduce": "true"},
        {"parallel.tp": 2, "parallel.sequence_parallel": True, "launcher.nproc": 8,
         "parallel.use_distributed_optimizer": True, "parallel.overlap_grad_reduce": True},
    ),
    (
        "vpp_from_layers_per_stage",
        "--num-layers 8 --pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 2 "
        "--global-batch-size 16",
        {"model.num_layers": "8", "parallel.pp": "2", "parallel.vpp": "2"},
        {"parallel.vpp": 2},
    ),
    (
        "vpp_stages_per_rank",
        "--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2 "
        "--global-batch-size 16",
        {"parallel.vpp": "2"},
        {"parallel.vpp": 2},
    ),
    (
        "uneven_stages",
        "--num-layers 6 --pipeline-model-parallel-size 3 --decoder-first-pipeline-num-layers 1 "
        "--decoder-last-pipeline-num-layers 1",
        {"parallel.first_stage_layers": "1", "parallel.last_stage_layers": "1"},
        {"parallel.first_stage_layers": 1, "parallel.last_stage_layers": 1},
    ),
    (
        "llama_model",
        "--num-layers 4 --hidden-size 256 --num-attention-heads 8 --group-query-attention "
        "--num-query-groups 2 --kv-channels 64 --seq-length 512 --max-position-embeddings 1024 "
        "--position-embedding-type rope --rotary-base 500000 --norm-epsilon 1e-6 --swiglu "
        "--normalization RMSNorm --disable-bias-linear --hidden-dropout 0 --attention-dropout 0 "
        "--untie-embeddings-and-output-weights --use-rope-scaling --rope-scaling-factor 32",
        {"model.ffn_hidden_size": "640", "model.num_query_groups": "2", "model.head_dim": "64",
         "model.activation": "swiglu", "model.normalization": "RMSNorm",
         "model.add_bias_linear": "false", "model.tie_embeddings": "false",
         "model.rope_scaling": "llama3", "model.rope_scaling_factor": "32.0"},
        {"model.hidden_size": 256, "model.ffn_hidden_size": 640, "model.head_dim": 64,
         "model.max_position_embeddings": 1024, "model.position_embedding_type": "rope",
         "model.rotary_base": 500000.0, "model.hidden_dropout": 0.0, "model.rope_scaling": "llama3"},
    ),
    (
        "qwen_model",
        "--add-qkv-bias --qk-layernorm --squared-relu --hidden-size 64",
        {"model.add_qkv_bias": "true", "model.qk_layernorm": "true",
         "model.activation": "squared_relu", "model.ffn_hidden_size": "256"},
        {"model.add_qkv_bias": True, "model.qk_layernorm": True, "model.activation": "squared_relu"},
    ),
    (
        "mla",
        "--multi-latent-attention --q-lora-rank 64 --kv-lora-rank 32 --qk-head-dim 16 "
        "--qk-pos-emb-head-dim 8 --v-head-dim 16",
        {"model.multi_latent_attention": "true", "model.q_lora_rank": "64"},
        {"model.multi_latent_attention": True, "model.q_lora_rank": 64, "model.kv_lora_rank": 32,
         "model.qk_head_dim": 16, "model.qk_pos_emb_head_dim": 8, "model.v_head_dim": 16},
    ),
    (
        "moe",
        "--num-experts 8 --moe-router-topk 1 --moe-ffn-hidden-size 64 "
        "--moe-token-dispatcher-type alltoall --moe-aux-loss-coeff 0.01 --moe-grouped-gemm "
        "--moe-router-load-balancing-type seq_aux_loss --moe-router-pre-softmax "
        "--moe-router-score-function sigmoid --moe-router-enable-expert-bias "
        "--moe-router-num-groups 4 --moe-router-group-topk 2 --moe-router-topk-scaling-factor 2.5 "
        "--moe-shared-expert-intermediate-size 32 --moe-layer-freq ([0]*1+[1]*3)",
        {"model.moe_aux_loss_coeff": "0.01", "model.moe_router_load_balancing_type": "seq_aux_loss"},
        {"model.num_experts": 8, "model.moe_token_dispatcher": "alltoall",
         "model.moe_grouped_gemm": True, "model.moe_router_pre_softmax": True,
         "model.moe_router_score_function": "sigmoid", "model.moe_router_enable_expert_bias": True,
         "model.moe_router_num_groups": 4, "model.moe_router_group_topk": 2,
         "model.moe_router_topk_scaling_factor": 2.5, "model.moe_shared_expert_intermediate_size": 32,
         "model.moe_layer_freq": "([0]*1+[1]*3)", "model.moe_aux_loss_coeff": 0.01},
    ),
    (
        "optimizer",
        "--lr 6e-5 --min-lr 6e-6 --lr-warmup-iters 10 --lr-decay-iters 100 --lr-decay-style cosine "
        "--weight-decay 0.1 --adam-beta1 0.8 --adam-beta2 0.95 --adam-eps 1e-6 --clip-grad 0.5",
        {"optim.lr_warmup_iters": "10", "optim.lr_decay_style": "cosine"},
        {"optim.lr": 6e-5, "optim.min_lr": 6e-6, "optim.lr_decay_iters": 100,
         "optim.adam_beta2": 0.95, "optim.clip_grad": 0.5},
    ),
    (
        "warmup_fraction",
        "--train-iters 1000 --lr-warmup-fraction .01",
        {"train.iters": "1000", "optim.lr_warmup_iters": "10"},
        {"optim.lr_warmup_iters": 10},
    ),
    (
        "sample_schedule",
        "--train-samples 4000 --lr-decay-samples 3000 --lr-warmup-fraction 0.1",
        {"train.train_samples": "4000", "optim.lr_decay_samples": "3000",
         "optim.lr_warmup_samples": "300"},
        {"train.train_samples": 4000, "optim.lr_decay_samples": 3000,
         "optim.lr_warmup_samples": 300},
    ),
    (
        "training",
        "--micro-batch-size 2 --global-batch-size 32 --train-iters 50 --eval-interval 25 "
        "--eval-iters 3 --exit-interval 7 --seed 7 --log-interval 5 --manual-gc "
        "--manual-gc-interval 100 --disable-manual-gc-eval",
        {"train.global_batch_size": "32", "train.manual_gc_eval": "false"},
        {"train.micro_batch_size": 2, "train.exit_interval": 7, "train.seed": 7,
         "logging.log_interval": 5, "train.manual_gc": True, "train.manual_gc_eval": False},
    ),
    (
        "data_hf_tokenizer",
        "--data-path 0.7 /d/a_text_document 0.3 /d/b --split 949,50,1 --num-workers 2 "
        "--tokenizer-type HuggingFaceTokenizer --tokenizer-model /tok/tokenizer.json "
        "--data-cache-path /cache",
        {"data.data_path": "['0.7',/d/a_text_document,'0.3',/d/b]", "data.split": "'949,50,1'"},
        {"data.data_path": ["0.7", "/d/a_text_document", "0.3", "/d/b"], "data.split": "949,50,1",
         "data.tokenizer": "/tok/tokenizer.json", "data.cache_dir": "/cache"},
    ),
    (
        "llama2_tokenizer_json",
        "--tokenizer-type Llama2Tokenizer --tokenizer-model /tok",
        {"data.tokenizer": "/tok"},
        {"data.tokenizer": "/tok"},
    ),
    *[
        (  # Megatron-LM's three SentencePiece types read a .model alike (its default tokenizers)
            f"{kind}_model_file",
            f"--tokenizer-type {kind} --tokenizer-model /tok/tokenizer.model",
            {"data.tokenizer": "/tok/tokenizer.model"},
            {"data.tokenizer": "/tok/tokenizer.model"},
        )
        for kind in ("Llama2Tokenizer", "SentencePieceTokenizer", "GPTSentencePieceTokenizer")
    ],
    (
        "null_tokenizer_mock_data",
        "--tokenizer-type NullTokenizer --vocab-size 512 --mock-data",
        {"data.tokenizer": "null:512", "data.mock": "true"},
        {"data.tokenizer": "null:512", "model.vocab_size": None, "data.mock": True},
    ),
    (
        "checkpoint_logging",
        "--save /ck --load /ck --persistent-save-interval 50 --ckpt-step 20 --async-save "
        "--exit-on-missing-checkpoint --tensorboard-dir /tb --wandb-project proj "
        "--log-params-norm --log-num-zeros-in-grad --log-throughput --log-timers-to-tensorboard "
        "--log-memory-to-tensorboard --log-validation-ppl-to-tensorboard",
        {"checkpoint.interval": "50", "checkpoint.load_optional": "false"},
        {"checkpoint.save": "/ck", "checkpoint.step": 20, "checkpoint.async_save": True,
         "checkpoint.load_optional": False, "logging.wandb_project": "proj",
         "logging.log_params_norm": True, "logging.log_num_zeros_in_grad": True,
         "logging.log_throughput": True, "logging.log_timers_to_tensorboard": True,
         "logging.log_memory_to_tensorboard": True,
         "logging.log_validation_ppl_to_tensorboard": True},
    ),
    (
        # Megatron-LM's arguments.py: --skip-train implies --no-load-optim.
        "skip_train",
        "--skip-train --load /ck",
        {"train.skip_train": "true", "checkpoint.load_optim": "false"},
        {"train.skip_train": True, "checkpoint.load_optim": False},
    ),
    (
        "test_mode",
        "--test-mode --qk-layernorm",
        {"train.test_mode": "true", "model.qk_layernorm": "true"},
        {"train.test_mode": True, "model.qk_layernorm": True, "model.normalization": "LayerNorm"},
    ),
    ("bf16", "--bf16", {"model.precision": "bf16"}, {"model.precision": "bf16"}),
    ("fp16", "--fp16", {"model.precision": "fp16"}, {"model.precision": "fp16"}),
    ("impl_local", "--transformer-impl local", {"model.spec": "local"}, {"model.spec": "local"}),
    ("impl_te", "--transformer-impl transformer_engine", {"model.spec": "auto"},
     {"model.spec": "auto"}),
    (
        "awkward_strings",
        "--save 'out/a b$c,d' --wandb-project 'it'\"'\"'s ~${x}'",
        {"checkpoint.save": "'out/a b$c,d'", "logging.wandb_project": "'it\\'s ~\\${x}'"},
        {"checkpoint.save": "out/a b$c,d", "logging.wandb_project": "it's ~${x}"},
    ),
]


@pytest.mark.parametrize(
    "command, overrides", [(c[1], c[2]) for c in CASES], ids=[c[0] for c in CASES]
)
def test_flags_map_to_overrides(command, overrides):
    out = as_dict(mlm_args_to_overrides(shlex.split(command)))
    assert out["experiment"] == "none"
    assert {key: out.get(key) for key in overrides} == overrides


@pytest.mark.parametrize(
    "command, fields", [(c[1], c[3]) for c in CASES], ids=[c[0] for c in CASES]
)
def test_overrides_compose(command, fields):
    cfg = compose_config(mlm_args_to_overrides(shlex.split(command)))
    assert {path: field(cfg, path) for path in fields} == fields


# What Megatron-LM builds when the model flags are left out (arguments.py's defaults), against
# megatron_ext's own LLaMA-style defaults: every one of these differs from Config().
GPT3_DEFAULTS = {
    "model.normalization": "LayerNorm",
    "model.activation": "gelu",
    "model.position_embedding_type": "learned_absolute",
    "model.add_bias_linear": True,
    "model.hidden_dropout": 0.1,
    "model.attention_dropout": 0.1,
    "model.kv_lora_rank": 32,
    "optim.min_lr": 0.0,
    "optim.lr_decay_style": "linear",
    "optim.adam_beta2": 0.999,
    "optim.lr_warmup_iters": 0,
    "train.global_batch_size": None,
    "parallel.use_distributed_optimizer": False,
    "checkpoint.load_optional": True,
}


def test_gpt3_command_line_gets_megatron_defaults():
    cfg = compose_config(mlm_args_to_overrides(shlex.split("--hidden-size 64")))
    assert {path: field(cfg, path) for path in GPT3_DEFAULTS} == GPT3_DEFAULTS
    assert cfg.model.ffn_hidden_size == 4 * 64  # GeLU: 4h, not SwiGLU's 8h/3
    assert cfg.model.tie_embeddings and cfg.model.rotary_percent == 1.0
    ours = Config()
    assert all(field(ours, path) != v for path, v in GPT3_DEFAULTS.items())


def test_swiglu_ffn_default():
    cfg = compose_config(mlm_args_to_overrides(["--hidden-size", "128", "--swiglu"]))
    assert cfg.model.ffn_hidden_size == 320  # int(8 * 128 / 3 / 64) * 64


def test_model_preset_keeps_its_architecture():
    out = mlm_args_to_overrides(["--num-layers", "4", "model=llama_tiny_gqa", "train.iters=3"])
    assert out[-2:] == ["model=llama_tiny_gqa", "train.iters=3"]
    cfg = compose_config(out)
    assert (cfg.model.num_layers, cfg.model.num_query_groups, cfg.train.iters) == (4, 2, 3)
    assert (cfg.model.normalization, cfg.model.activation) == ("RMSNorm", "swiglu")


def test_passed_through_experiment_replaces_none():
    cfg = compose_config(mlm_args_to_overrides(["experiment=default"]))
    assert cfg.launcher.nproc == 4


def _config_keys() -> set[str]:
    return set(schema_keys(Config))


def test_table_rows_are_whole():
    names = [n for flag in ALL_FLAGS for n in flag.names]
    assert len(names) == len(set(names)), "a flag name appears in two rows"
    keys = _config_keys()
    for flag in ALL_FLAGS:
        assert flag.status in (MAPPED, NOTICE, REFUSED)
        assert flag.target, f"{flag.name} has no key, notice or reason"
        if flag.status == MAPPED:
            # a derived row may set a whole section's keys (--use-checkpoint-args: the model's)
            section = flag.derived and flag.target in {key.split(".")[0] for key in keys}
            assert flag.target in keys or section, f"{flag.name} maps onto {flag.target}, not a config key"
        if flag.only is not None:
            assert flag.refuse, f"{flag.name} refuses values without a reason"
    build_parser()  # argparse refuses conflicting option strings


def _sample(flag) -> list[str]:
    """One command line giving `flag` a value its syntax accepts (an accepted one if limited)."""
    if flag.is_switch:
        return [flag.names[-1] if flag.syntax == "bool" else flag.name]
    pick = (flag.only or flag.choices or {"int": (2,), "float": (0.5,), "str": ("x",)}[
        flag.syntax.rstrip("+*0123456789")])[0]
    count = int(flag.syntax[-1]) if flag.syntax[-1].isdigit() else 1
    return [flag.name, *[str(pick)] * count]


# Flags that Megatron-LM reads only together with another one.
NEEDS = {
    "--lr-decay-samples": ["--train-samples", "8"],
    "--lr-warmup-samples": ["--train-samples", "8"],
    "--num-virtual-stages-per-pipeline-rank": ["--global-batch-size", "8"],
    "--virtual-pipeline-model-parallel-size": ["--global-batch-size", "8"],
}


def _outcome(flag) -> list[str]:
    """What a command line of `flag` alone gives: its problems, its notices, or its sources."""
    argv = _sample(flag)
    try:
        out = translate([*argv, *NEEDS.get(flag.name, [])])
    except MlmArgsError as error:
        return error.problems
    return out.notices if out.notices else [out.sources.get(flag.target, "")]


def test_each_flag_does_what_its_row_says():
    """Every row of Megatron-LM's parser, alone on a command line: a refused flag is reported
    with its reason, a notice printed, a mapped flag sets its key."""
    wrong = {}
    for flag in (f for f in ALL_FLAGS if not f.derived):
        shown = " ".join(_sample(flag))
        expected = {
            REFUSED: [f"{shown}: {flag.target}"],
            NOTICE: [f"{shown}: {flag.target}"],
            MAPPED: [shown],
        }[flag.status]
        if _outcome(flag) != expected:
            wrong[flag.name] = _outcome(flag)
    assert wrong == {}


def test_prefix_flags_are_not_abbreviations():
    with pytest.raises(MlmArgsError, match="--num-lay: unknown Megatron-LM flag"):
        translate(["--num-lay", "2"])


# Notices: accepted, no effect here, one line each.
NOTICES = [
    ("sequence_parallel_tp1", "--sequence-parallel",
     "--sequence-parallel: turned off at --tensor-model-parallel-size 1"),
    ("ckpt_format", "--ckpt-format fsdp_dtensor",
     "--ckpt-format fsdp_dtensor: checkpoints are written as torch_dist"),
    ("groups_without_gqa", "--num-query-groups 2",
     "--num-query-groups 2: ignored without --group-query-attention"),
    ("no_position_embedding_rope", "--position-embedding-type rope --no-position-embedding",
     "--no-position-embedding: deprecated"),
    ("flash_attention_version", "--flash-attention-version 3", "--flash-attention-version 3: attention"),
    ("only_default", "--moe-router-bias-update-rate 0.001",
     "--moe-router-bias-update-rate 0.001: megatron-core's default"),
    # Megatron-LM's functional tests give these (tests/fixtures/megatron_lm/functional_tests.json).
    ("checkpoint_scheduler", "--use-checkpoint-opt_param-scheduler",
     "--use-checkpoint-opt_param-scheduler: a resume takes the lr schedule's values"),
    ("legacy_tokenizer", "--legacy-tokenizer", "--legacy-tokenizer: which of Megatron-LM's tokenizer"),
    ("etp_without_experts", "--tensor-model-parallel-size 2 --expert-tensor-parallel-size 4",
     "--expert-tensor-parallel-size 4: no effect without --num-experts"),
]


@pytest.mark.parametrize("command, line", [c[1:] for c in NOTICES], ids=[c[0] for c in NOTICES])
def test_notices(command, line):
    out = translate(shlex.split(command))
    assert [n for n in out.notices if n.startswith(line)] == out.notices[:1] != []


def test_sequence_parallel_stays_at_tp2():
    out = translate(["--sequence-parallel", "--tensor-model-parallel-size", "2"])
    assert as_dict(out.overrides)["parallel.sequence_parallel"] == "true" and not out.notices


def test_transformer_engine_without_te_says_local_layers(monkeypatch):
    monkeypatch.setattr(optional, "HAVE_TE", False)
    out = translate(["--transformer-impl", "transformer_engine"])
    assert out.notices == [
        "--transformer-impl transformer_engine: Transformer Engine is not installed: the "
        "local layers run"
    ]


BAD = [
    ("unknown_flag", "--foo 3", "--foo: unknown Megatron-LM flag"),
    ("unknown_flag_equals", "--num-layers 2 --foo=3", "--foo: unknown Megatron-LM flag"),
    ("stray_positional", "stray", "unexpected argument 'stray'"),
    ("bad_type", "--num-layers four", "--num-layers: invalid int value"),
    ("bad_choice", "--normalization BatchNorm", "--normalization: invalid choice"),
    ("refused_value", "--position-embedding-type mrope",
     "--position-embedding-type mrope: mrope and relative positions are not"),
    ("router_value", "--moe-router-load-balancing-type global_aux_loss",
     "--moe-router-load-balancing-type global_aux_loss: megatron_ext's router takes"),
    ("two_router_values", "--moe-router-load-balancing-type aux_loss aux_loss",
     "one value only"),
    ("flex_ncclep", "--moe-token-dispatcher-type flex --moe-flex-dispatcher-backend ncclep", "no ncclep backend"),
    ("wsd", "--lr-decay-style WSD", "WSD needs"),
    ("vocab_file_not_gpt2", "--tokenizer-type HuggingFaceTokenizer --vocab-file v.json",
     "is read with --tokenizer-type GPT2BPETokenizer only"),
    ("gpt2_without_merges", "--vocab-file v.json",  # GPT2BPETokenizer: pretrain_gpt.py's default
     "--merge-file: GPT2BPETokenizer needs both --vocab-file and --merge-file"),
    ("bf16_and_fp16", "--bf16 --fp16", "exclusive"),
    ("swiglu_and_squared_relu", "--swiglu --squared-relu", "exclusive"),
    ("two_vpp_flags", "--num-layers 8 --pipeline-model-parallel-size 2 "
     "--num-layers-per-virtual-pipeline-stage 2 --num-virtual-stages-per-pipeline-rank 2",
     "exclusive"),
    ("vpp_without_layers", "--num-layers-per-virtual-pipeline-stage 2 --global-batch-size 8",
     "needs --num-layers"),
    ("vpp_without_global_batch", "--pipeline-model-parallel-size 2 "
     "--num-virtual-stages-per-pipeline-rank 2", "needs --global-batch-size"),
    ("etp", "--tensor-model-parallel-size 2 --expert-tensor-parallel-size 1 --num-experts 4",
     "must equal --tensor-model-parallel-size"),
    ("short_positions", "--seq-length 256 --max-position-embeddings 128",
     "must be >= --seq-length (256)"),
    ("no_position_embedding_learned", "--no-position-embedding", "deprecated in Megatron-LM"),
    ("warmup_both", "--train-iters 10 --lr-warmup-iters 1 --lr-warmup-fraction 0.1", "exclusive"),
    ("warmup_fraction_alone", "--lr-warmup-fraction 0.1",
     "needs --lr-decay-iters or --train-iters"),
    ("samples_and_iters", "--train-samples 10 --train-iters 10", "exclusive with --train-iters"),
    ("iters_warmup_with_samples", "--train-samples 10 --lr-warmup-iters 1",
     "does not go with --train-samples"),
    ("samples_warmup_with_iters", "--lr-warmup-samples 10", "needs --train-samples"),
    ("tiktoken", "--tokenizer-type TikTokenizer --tokenizer-model t.json",
     "--tokenizer-type TikTokenizer: use HuggingFaceTokenizer"),
    ("hf_type_model_file", "--tokenizer-type HuggingFaceTokenizer --tokenizer-model t.model",
     "--tokenizer-model t.model: a SentencePiece .model is read with --tokenizer-type Llama2Tokenizer"),
    ("legacy_sentencepiece_model_file", "--tokenizer-type SentencePieceTokenizer --tokenizer-model t.model "
     "--legacy-tokenizer", "--legacy-tokenizer: Megatron-LM's legacy SentencePieceTokenizer appends <CLS>"),
    ("sentencepiece_whitespace", "--tokenizer-type Llama2Tokenizer --tokenizer-model t.model "
     "--no-tokenizer-sentencepiece-ignore-extra-whitespaces",
     "--no-tokenizer-sentencepiece-ignore-extra-whitespaces: not supported: a .model encodes"),
    ("sentencepiece_legacy", "--tokenizer-type GPTSentencePieceTokenizer --tokenizer-model t.model "
     "--tokenizer-sentencepiece-legacy", "--tokenizer-sentencepiece-legacy: not supported"),
    ("hf_without_model", "--tokenizer-type HuggingFaceTokenizer", "needs --tokenizer-model"),
    ("null_without_size", "--tokenizer-type NullTokenizer --mock-data", "NullTokenizer needs --vocab-size"),
    ("impl", "--transformer-impl inference_optimized", "use local or transformer_engine"),
]


@pytest.mark.parametrize("command, key", [
    ("--train-iters 10 --lr-warmup-samples 0", "optim.lr_warmup_iters"),
    ("--train-samples 80 --lr-warmup-iters 0", "optim.lr_warmup_samples"),
], ids=["samples_with_iters", "iters_with_samples"])
def test_zero_warmup_in_the_other_unit_is_megatron_lms_default(command, key):
    """Megatron-LM asserts the other unit's warmup is 0, its default: 0 is accepted, no warmup."""
    assert as_dict(mlm_args_to_overrides(shlex.split(command)))[key] == "0"


@pytest.mark.parametrize("command, phrase", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_command_lines(command, phrase):
    with pytest.raises(MlmArgsError) as info:
        mlm_args_to_overrides(shlex.split(command))
    assert phrase in str(info.value)


def test_one_message_lists_every_refused_flag(capsys):
    command = (
        "--num-layers 2 --vocab-file v.json --flash-attention-version 2 --foo 3 --freeze-base-for-mtp "
        "--decrease-batch-size-if-needed --rope-type yarn --override-ckpt-iteration 5"
    )
    with pytest.raises(SystemExit) as info:
        main(shlex.split(command))
    assert info.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: --foo: unknown Megatron-LM flag",
        "error: --decrease-batch-size-if-needed: the global batch is not decreased to fit: it "
        "must be divisible by --micro-batch-size * dp",
        "error: --override-ckpt-iteration 5: megatron_ext has no config key for it",
        "error: --freeze-base-for-mtp: ModelOpt (quantization/distillation/export) is not part of "
        "this trainer",
        "error: --rope-type yarn: yarn is multi-latent attention's; other attention takes "
        "--position-embedding-type yarn",
        "error: --merge-file: GPT2BPETokenizer needs both --vocab-file and --merge-file",
    ]


def test_rule_errors_name_the_typed_flag(capsys):
    command = (
        "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --tensor-model-parallel-size 3 "
        "--nproc 3 --flash-attention-version 2"
    )
    with pytest.raises(SystemExit) as info:
        main(shlex.split(command))
    assert info.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("notice: --flash-attention-version 2: ")  # notices come first
    assert err[1:] == [
        "error: --tensor-model-parallel-size 3 (parallel.tp): model.num_attention_heads (4) "
        "must be divisible by parallel.tp (3)"
    ]


@pytest.mark.parametrize("rank, printed", [("0", True), ("1", False)], ids=["rank0", "rank1"])
def test_notices_printed_once_per_launch(monkeypatch, capsys, rank, printed):
    """Under torchrun every rank reads the flags; only rank 0 prints their notices."""
    for name, value in {"RANK": rank, "WORLD_SIZE": "2", "LOCAL_RANK": rank}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit):
        main(shlex.split("--num-layers 2 --num-attention-heads 4 --tensor-model-parallel-size 3 --flash-attention-version 2"))
    notices = [line for line in capsys.readouterr().err.splitlines() if line.startswith("notice: ")]
    assert len(notices) == (1 if printed else 0)


def test_interleaved_micro_batches_refused_before_launch(capsys):
    command = (
        "--num-layers 4 --pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2 "
        "--micro-batch-size 1 --global-batch-size 3 --nproc 2"
    )
    with pytest.raises(SystemExit) as info:
        main(shlex.split(command))
    assert info.value.code == 2
    assert capsys.readouterr().err.strip() == (
        "error: --global-batch-size 3 (train.global_batch_size): the micro-batches per step "
        "(train.global_batch_size / (train.micro_batch_size * dp) = 3 / (1 * 1) = 3) must be "
        "divisible by parallel.pp (2) with parallel.vpp (interleaved pipeline)"
    )


def test_fidelity_doc_is_generated_from_the_table():
    doc = (REPO / "docs" / "megatron_flags.md").read_text()
    assert doc == flag_table_markdown(), (
        "docs/megatron_flags.md is stale: python -m megatron_ext.pretrain_gpt --flag-table "
        "> docs/megatron_flags.md"
    )


def test_flag_table_command_prints_the_doc(capsys):
    main(["--flag-table"])
    assert capsys.readouterr().out == flag_table_markdown()


def test_help_points_at_the_flag_table(capsys):
    main(["--help"])
    assert "--flag-table" in capsys.readouterr().out
