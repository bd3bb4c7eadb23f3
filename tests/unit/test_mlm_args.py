"""Megatron-LM command lines -> Hydra overrides -> our Config."""

from __future__ import annotations

import shlex

import pytest

from megatron_ext.config import compose_config
from megatron_ext.config.mlm_args import MlmArgsError, mlm_args_to_overrides
from megatron_ext.pretrain_gpt import main


def as_dict(overrides: list[str]) -> dict[str, str]:
    return dict(o.split("=", 1) for o in overrides)


# What an empty command line gives: experiment=none plus Megatron-LM's defaults where ours differ.
BASE = {
    "experiment": "none",
    "parallel.use_distributed_optimizer": "false",
    "optim.min_lr": "0.0",
    "optim.lr_decay_style": "linear",
    "optim.adam_beta2": "0.999",
    "train.global_batch_size": "null",
    "optim.lr_warmup_iters": "0",
}


def field(cfg, path: str):
    for part in path.split("."):
        cfg = getattr(cfg, part)
    return cfg


# (id, command line, overrides beyond BASE, Config fields after composing)
CASES = [
    (
        "parallel",
        "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --context-parallel-size 2 "
        "--expert-model-parallel-size 2 --sequence-parallel --use-distributed-optimizer --nproc 8",
        {
            "parallel.tp": "2", "parallel.pp": "2", "parallel.cp": "2", "parallel.ep": "2",
            "parallel.sequence_parallel": "true", "parallel.use_distributed_optimizer": "true",
            "launcher.nproc": "8",
        },
        {"parallel.tp": 2, "parallel.pp": 2, "parallel.cp": 2, "parallel.sequence_parallel": True,
         "parallel.use_distributed_optimizer": True, "launcher.nproc": 8},
    ),
    (
        "vpp_from_layers_per_stage",
        "--num-layers 8 --pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 2",
        {"model.num_layers": "8", "parallel.pp": "2", "parallel.vpp": "2"},
        {"parallel.vpp": 2, "model.num_layers": 8},
    ),
    (
        "uneven_stages",
        "--num-layers 6 --pipeline-model-parallel-size 3 --decoder-first-pipeline-num-layers 1 "
        "--decoder-last-pipeline-num-layers 1",
        {"model.num_layers": "6", "parallel.pp": "3", "parallel.first_stage_layers": "1",
         "parallel.last_stage_layers": "1"},
        {"parallel.first_stage_layers": 1, "parallel.last_stage_layers": 1},
    ),
    (
        "vpp_direct",
        "--pipeline-model-parallel-size 2 --virtual-pipeline-model-parallel-size 2",
        {"parallel.pp": "2", "parallel.vpp": "2"},
        {"parallel.vpp": 2},
    ),
    (
        "model",
        "--num-layers 4 --hidden-size 256 --num-attention-heads 8 --group-query-attention "
        "--num-query-groups 2 --kv-channels 32 --seq-length 512 --max-position-embeddings 1024 "
        "--rotary-base 500000 --norm-epsilon 1e-6 --init-method-std 0.01 "
        "--untie-embeddings-and-output-weights --vocab-size 1000 --make-vocab-size-divisible-by 64",
        {
            "model.num_layers": "4", "model.hidden_size": "256", "model.ffn_hidden_size": "640",
            "model.num_attention_heads": "8", "model.num_query_groups": "2",
            "model.seq_length": "512", "model.rotary_base": "500000.0",
            "model.norm_epsilon": "1e-06", "model.init_method_std": "0.01",
            "model.tie_embeddings": "false", "model.vocab_size": "1000",
            "model.make_vocab_size_divisible_by": "64",
        },
        {"model.num_layers": 4, "model.hidden_size": 256, "model.ffn_hidden_size": 640,
         "model.num_query_groups": 2, "model.seq_length": 512, "model.rotary_base": 500000.0,
         "model.tie_embeddings": False, "model.vocab_size": 1000},
    ),
    (
        "mqa_default_groups",
        "--group-query-attention --ffn-hidden-size 100",
        {"model.num_query_groups": "1", "model.ffn_hidden_size": "100"},
        {"model.num_query_groups": 1, "model.ffn_hidden_size": 100},
    ),
    (
        "moe",
        "--num-experts 8 --moe-router-topk 1 --moe-ffn-hidden-size 64 "
        "--moe-token-dispatcher-type alltoall --moe-aux-loss-coeff 0.01",
        {"model.num_experts": "8", "model.moe_router_topk": "1", "model.moe_ffn_hidden_size": "64",
         "model.moe_token_dispatcher": "alltoall", "model.moe_aux_loss_coeff": "0.01"},
        {"model.num_experts": 8, "model.moe_token_dispatcher": "alltoall"},
    ),
    (
        "optimizer",
        "--lr 6e-5 --min-lr 6e-6 --lr-warmup-iters 10 --lr-decay-iters 100 --lr-decay-style cosine "
        "--weight-decay 0.1 --adam-beta1 0.8 --adam-beta2 0.95 --adam-eps 1e-6 --clip-grad 0.5",
        {"optim.lr": "6e-05", "optim.min_lr": "6e-06", "optim.lr_warmup_iters": "10",
         "optim.lr_decay_iters": "100", "optim.lr_decay_style": "cosine",
         "optim.weight_decay": "0.1", "optim.adam_beta1": "0.8", "optim.adam_beta2": "0.95",
         "optim.adam_eps": "1e-06", "optim.clip_grad": "0.5"},
        {"optim.lr": 6e-5, "optim.lr_warmup_iters": 10, "optim.lr_decay_style": "cosine",
         "optim.adam_beta2": 0.95},
    ),
    (
        "warmup_fraction",
        "--train-iters 1000 --lr-warmup-fraction .01",
        {"train.iters": "1000", "optim.lr_warmup_iters": "10"},
        {"optim.lr_warmup_iters": 10},
    ),
    (
        "training",
        "--micro-batch-size 2 --global-batch-size 32 --train-iters 50 --eval-interval 25 "
        "--eval-iters 3 --exit-interval 7 --seed 7 --log-interval 5",
        {"train.micro_batch_size": "2", "train.global_batch_size": "32", "train.iters": "50",
         "train.eval_interval": "25", "train.eval_iters": "3", "train.exit_interval": "7",
         "train.seed": "7", "logging.log_interval": "5"},
        {"train.global_batch_size": 32, "train.micro_batch_size": 2, "train.exit_interval": 7},
    ),
    (
        "manual_gc",
        "--manual-gc --manual-gc-interval 100 --no-manual-gc-eval",
        {"train.manual_gc": "true", "train.manual_gc_interval": "100", "train.manual_gc_eval": "false"},
        {"train.manual_gc": True, "train.manual_gc_interval": 100, "train.manual_gc_eval": False},
    ),
    (
        "data_hf_tokenizer",
        "--data-path 0.7 /d/a_text_document 0.3 /d/b --split 949,50,1 --num-workers 2 "
        "--tokenizer-type HuggingFaceTokenizer --tokenizer-model /tok/tokenizer.json",
        {"data.data_path": "['0.7',/d/a_text_document,'0.3',/d/b]", "data.split": "'949,50,1'",
         "data.num_workers": "2", "data.tokenizer": "/tok/tokenizer.json"},
        {"data.data_path": ["0.7", "/d/a_text_document", "0.3", "/d/b"], "data.split": "949,50,1",
         "data.tokenizer": "/tok/tokenizer.json"},
    ),
    (
        "null_tokenizer",
        "--tokenizer-type NullTokenizer --vocab-size 512",
        {"data.tokenizer": "byte", "model.vocab_size": "512"},
        {"data.tokenizer": "byte", "model.vocab_size": 512},
    ),
    (
        "checkpoint_logging",
        "--save /ck --load /ck --save-interval 50 --tensorboard-dir /tb --wandb-project proj",
        {"checkpoint.save": "/ck", "checkpoint.load": "/ck", "checkpoint.interval": "50",
         "logging.tensorboard_dir": "/tb", "logging.wandb_project": "proj"},
        {"checkpoint.save": "/ck", "checkpoint.interval": 50, "logging.wandb_project": "proj"},
    ),
    ("bf16", "--bf16", {"model.precision": "bf16"}, {"model.precision": "bf16"}),
    ("fp16", "--fp16", {"model.precision": "fp16"}, {"model.precision": "fp16"}),
    ("impl_local", "--transformer-impl local", {"model.spec": "local"}, {"model.spec": "local"}),
    ("impl_te", "--transformer-impl transformer_engine", {"model.spec": "te"},
     {"model.spec": "te"}),
    (
        "what_we_always_do",
        "--position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear "
        "--use-mcore-models --no-gradient-accumulation-fusion --distributed-backend gloo "
        "--attention-dropout 0.0 --hidden-dropout 0 --rotary-percent 1.0 --ckpt-format torch_dist",
        {},
        {},
    ),
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
    out = mlm_args_to_overrides(shlex.split(command))
    assert out[0] == "experiment=none"
    assert as_dict(out) == {**BASE, **overrides}


@pytest.mark.parametrize(
    "command, fields", [(c[1], c[3]) for c in CASES], ids=[c[0] for c in CASES]
)
def test_overrides_compose(command, fields):
    cfg = compose_config(mlm_args_to_overrides(shlex.split(command)))
    assert {path: field(cfg, path) for path in fields} == fields
    # Megatron-LM's defaults, not the default experiment's.
    assert cfg.launcher.nproc == fields.get("launcher.nproc", 1)
    assert cfg.optim.lr_decay_style == fields.get("optim.lr_decay_style", "linear")


def test_hydra_overrides_pass_through_last():
    out = mlm_args_to_overrides(["--num-layers", "4", "model=llama_tiny_gqa", "train.iters=3"])
    assert out[-2:] == ["model=llama_tiny_gqa", "train.iters=3"]
    cfg = compose_config(out)
    assert (cfg.model.num_layers, cfg.model.num_query_groups, cfg.train.iters) == (4, 2, 3)


def test_passed_through_experiment_replaces_none():
    cfg = compose_config(mlm_args_to_overrides(["experiment=default"]))
    assert cfg.launcher.nproc == 4


def test_megatron_gpt3_example_maps_cleanly():
    # Megatron-LM examples/gpt3/train_gpt3_175b_distributed.sh, scaled down, without the flags
    # we do not support (--attention-backend, --rampup-batch-size, --vocab-file/--merge-file).
    command = """
        --num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 128
        --max-position-embeddings 128
        --micro-batch-size 1 --global-batch-size 16 --train-iters 500 --weight-decay 0.1
        --adam-beta1 0.9 --adam-beta2 0.95 --init-method-std 0.006 --clip-grad 1.0 --fp16
        --lr 6.0e-5 --lr-decay-style cosine --min-lr 6.0e-6 --lr-warmup-fraction .001
        --lr-decay-iters 430
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2
        --data-path /data/gpt_text_document --split 949,50,1
        --tokenizer-type GPT2BPETokenizer --tokenizer-model /data/gpt2/tokenizer.json
        --log-interval 100 --save-interval 10000 --eval-interval 1000 --save /ckpt --load /ckpt
        --eval-iters 10 --tensorboard-dir /tb
    """
    cfg = compose_config(mlm_args_to_overrides(shlex.split(command)))
    assert (cfg.parallel.tp, cfg.parallel.pp, cfg.model.num_layers) == (2, 2, 4)
    train = cfg.train
    assert (train.micro_batch_size, train.global_batch_size, train.iters) == (1, 16, 500)
    assert cfg.model.precision == "fp16"
    assert cfg.model.ffn_hidden_size == 320  # Megatron-LM's SwiGLU default for hidden 128
    assert cfg.optim.lr_warmup_iters == 0  # round(0.001 * 430)
    assert (cfg.optim.lr, cfg.optim.min_lr, cfg.optim.lr_decay_iters) == (6e-5, 6e-6, 430)
    assert cfg.data.data_path == ["/data/gpt_text_document"]
    assert cfg.data.tokenizer == "/data/gpt2/tokenizer.json"
    ckpt = cfg.checkpoint
    assert (ckpt.save, ckpt.load, ckpt.interval) == ("/ckpt", "/ckpt", 10000)


def test_megatron_llama_example_maps_cleanly():
    # The model part of Megatron-LM's examples/llama/train_llama3_8b_h100_fp8.sh, scaled down.
    command = """
        --use-mcore-models --num-layers 2 --hidden-size 256 --ffn-hidden-size 896
        --num-attention-heads 8 --group-query-attention --num-query-groups 2 --kv-channels 32
        --seq-length 256 --max-position-embeddings 256 --position-embedding-type rope
        --rotary-base 1000000 --rotary-percent 1.0 --attention-dropout 0.0 --hidden-dropout 0.0
        --swiglu --init-method-std 0.0134 --untie-embeddings-and-output-weights
        --normalization RMSNorm --disable-bias-linear --bf16 --transformer-impl local
    """
    cfg = compose_config(mlm_args_to_overrides(shlex.split(command)))
    model = cfg.model
    assert (model.hidden_size, model.ffn_hidden_size, model.num_query_groups) == (256, 896, 2)
    assert (model.rotary_base, model.tie_embeddings, model.spec) == (1e6, False, "local")


BAD = [
    ("unknown_flag", "--foo 3", "unknown Megatron-LM flag --foo"),
    ("unknown_flag_equals", "--num-layers 2 --foo=3", "unknown Megatron-LM flag --foo"),
    ("stray_positional", "stray", "unexpected argument 'stray'"),
    ("bad_type", "--num-layers four", "--num-layers: invalid int value"),
    ("layernorm", "--normalization LayerNorm",
     "--normalization LayerNorm is not supported: megatron_ext models use RMSNorm"),
    ("learned_positions", "--position-embedding-type learned_absolute",
     "megatron_ext models use RoPE"),
    ("dropout", "--hidden-dropout 0.1", "--hidden-dropout 0.1 is not supported"),
    ("partial_rope", "--rotary-percent 0", "--rotary-percent 0.0 is not supported"),
    ("vocab_file", "--vocab-file v.json", "use --tokenizer-model"),
    ("bf16_and_fp16", "--bf16 --fp16", "exclusive"),
    ("two_vpp_flags", "--num-layers 8 --pipeline-model-parallel-size 2 "
     "--num-layers-per-virtual-pipeline-stage 2 --virtual-pipeline-model-parallel-size 2",
     "exclusive"),
    ("vpp_without_layers", "--num-layers-per-virtual-pipeline-stage 2", "needs --num-layers"),
    ("groups_without_gqa", "--num-query-groups 2", "needs --group-query-attention"),
    ("kv_channels", "--hidden-size 256 --num-attention-heads 8 --kv-channels 64",
     "--kv-channels 64 is not supported"),
    ("short_positions", "--seq-length 256 --max-position-embeddings 128",
     "must be >= --seq-length"),
    ("warmup_both", "--train-iters 10 --lr-warmup-iters 1 --lr-warmup-fraction 0.1", "exclusive"),
    ("warmup_fraction_alone", "--lr-warmup-fraction 0.1",
     "needs --lr-decay-iters or --train-iters"),
    ("sentencepiece", "--tokenizer-type SentencePieceTokenizer",
     "--tokenizer-type SentencePieceTokenizer is not supported"),
    ("hf_without_model", "--tokenizer-type HuggingFaceTokenizer", "needs --tokenizer-model"),
    ("impl", "--transformer-impl inference_optimized", "use local or transformer_engine"),
]


@pytest.mark.parametrize("command, phrase", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_command_lines(command, phrase):
    with pytest.raises(MlmArgsError) as info:
        mlm_args_to_overrides(shlex.split(command))
    assert phrase in str(info.value)


def test_main_reports_unknown_flag_with_exit_code_2(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--num-layers", "2", "--foo"])
    assert info.value.code == 2
    assert capsys.readouterr().err.strip() == "error: unknown Megatron-LM flag --foo"
