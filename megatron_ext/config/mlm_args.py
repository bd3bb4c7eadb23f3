"""Megatron-LM `pretrain_gpt.py` command lines as Hydra overrides on our config.

    mlm_args_to_overrides(["--tensor-model-parallel-size", "2", "--bf16", "train.iters=10"])
    -> ["experiment=none", ..., "parallel.tp=2", "model.precision=bf16", "train.iters=10"]

Every supported flag is one line of `FLAGS`. Decisions a Megatron-LM user should know:

- The start is `experiment=none` (one process, group defaults); `--nproc N` (ours) starts N
  local workers when not under torchrun/srun. A `key=value` argument anywhere is a Hydra
  override and is applied last, so `experiment=...` or `model=...` presets still work.
- A flag that is not given keeps megatron_ext's default, except where Megatron-LM's default
  changes the training itself; those are emitted (the `megatron_default` column): linear lr
  decay, min lr 0, no warmup, Adam beta2 0.999, global batch = micro batch * dp, and no
  distributed optimizer.
- The model is always LLaMA-style (RoPE, RMSNorm, SwiGLU, no biases, no dropout). The flags
  that select exactly that are accepted and ignored; any other value is an error. Leaving them
  out is not an error. Without --ffn-hidden-size, --hidden-size H gives Megatron's SwiGLU
  default int(8H/3 / 64) * 64.
- --max-position-embeddings is checked (>= --seq-length, Megatron's rule) and ignored: RoPE
  models have no position table.
- Tokenizers: HuggingFaceTokenizer / GPT2BPETokenizer with --tokenizer-model <tokenizer.json or
  folder> set data.tokenizer; NullTokenizer means "ids are already tokens" and maps to our byte
  tokenizer, with --vocab-size setting the embedding size. --vocab-file/--merge-file are not
  supported (data.tokenizer is one tokenizer.json).
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence


class MlmArgsError(ValueError):
    """A Megatron-LM command line we cannot map; the message names the flag."""


_UNSET = object()


@dataclass(frozen=True)
class Flag:
    """One Megatron-LM flag: how it is read and which override it becomes."""

    name: str
    # The override key it sets; None: read here and used by `_derived` or only checked.
    key: Optional[str] = None
    # Value type; None for a switch (a flag without a value).
    type: Optional[Callable[[str], Any]] = str
    # For switches: the value `key` gets when the flag is present.
    const: Any = None
    nargs: Optional[str] = None
    # Emitted when the flag is absent: Megatron-LM's default, where it differs from ours.
    megatron_default: Any = _UNSET
    # Accepted and ignored only with one of these values (switches: always); () rejects always.
    only: Optional[tuple] = None
    # Why `only` holds: the message when the value is rejected.
    why: str = ""


def value(name: str, key: str, type: Callable = str, megatron_default: Any = _UNSET) -> Flag:
    return Flag(name, key, type, megatron_default=megatron_default)


def switch(
    name: str, key: Optional[str] = None, const: Any = True, megatron_default: Any = _UNSET
) -> Flag:
    return Flag(name, key, None, const=const, megatron_default=megatron_default)


def read(name: str, type: Callable = str) -> Flag:
    """A flag whose override depends on other flags (see `_derived`)."""
    return Flag(name, None, type)


def fixed(name: str, *values: Any, type: Optional[Callable] = str, why: str) -> Flag:
    """A flag that only states what megatron_ext always does."""
    return Flag(name, None, type, only=values, why=why)


FLAGS: tuple[Flag, ...] = (
    # Parallelism.
    value("--tensor-model-parallel-size", "parallel.tp", int),
    value("--pipeline-model-parallel-size", "parallel.pp", int),
    value("--virtual-pipeline-model-parallel-size", "parallel.vpp", int),
    read("--num-layers-per-virtual-pipeline-stage", int),
    value("--decoder-first-pipeline-num-layers", "parallel.first_stage_layers", int),
    value("--decoder-last-pipeline-num-layers", "parallel.last_stage_layers", int),
    value("--context-parallel-size", "parallel.cp", int),
    value("--expert-model-parallel-size", "parallel.ep", int),
    switch("--sequence-parallel", "parallel.sequence_parallel"),
    switch(
        "--use-distributed-optimizer", "parallel.use_distributed_optimizer", megatron_default=False
    ),
    value("--nproc", "launcher.nproc", int),  # ours: local workers when not under torchrun/srun
    # Model.
    value("--num-layers", "model.num_layers", int),
    read("--hidden-size", int),
    read("--ffn-hidden-size", int),
    value("--num-attention-heads", "model.num_attention_heads", int),
    switch("--group-query-attention"),
    read("--num-query-groups", int),
    read("--kv-channels", int),
    value("--seq-length", "model.seq_length", int),
    read("--max-position-embeddings", int),
    value("--num-experts", "model.num_experts", int),
    value("--moe-router-topk", "model.moe_router_topk", int),
    value("--moe-ffn-hidden-size", "model.moe_ffn_hidden_size", int),
    value("--moe-token-dispatcher-type", "model.moe_token_dispatcher"),
    value("--moe-aux-loss-coeff", "model.moe_aux_loss_coeff", float),
    value("--vocab-size", "model.vocab_size", int),
    value("--make-vocab-size-divisible-by", "model.make_vocab_size_divisible_by", int),
    switch("--untie-embeddings-and-output-weights", "model.tie_embeddings", False),
    value("--rotary-base", "model.rotary_base", float),
    value("--norm-epsilon", "model.norm_epsilon", float),
    value("--init-method-std", "model.init_method_std", float),
    switch("--bf16", "model.precision", "bf16"),
    switch("--fp16", "model.precision", "fp16"),
    read("--transformer-impl"),
    # What megatron_ext models always are.
    fixed("--position-embedding-type", "rope", why="megatron_ext models use RoPE"),
    fixed("--normalization", "RMSNorm", why="megatron_ext models use RMSNorm"),
    fixed("--rotary-percent", 1.0, type=float, why="megatron_ext applies RoPE to whole heads"),
    fixed("--attention-dropout", 0.0, type=float, why="megatron_ext models have no dropout"),
    fixed("--hidden-dropout", 0.0, type=float, why="megatron_ext models have no dropout"),
    fixed("--swiglu", type=None, why="megatron_ext MLPs are SwiGLU"),
    fixed("--disable-bias-linear", type=None, why="megatron_ext linears have no bias"),
    fixed("--use-mcore-models", type=None, why="megatron_ext models are megatron-core models"),
    fixed("--no-gradient-accumulation-fusion", type=None, why="megatron_ext has no fused wgrad"),
    fixed("--distributed-backend", "nccl", "gloo", why="the backend follows launcher.device"),
    fixed("--ckpt-format", "torch_dist", why="megatron_ext checkpoints are torch_dist"),
    # Optimizer and schedule.
    value("--lr", "optim.lr", float),
    value("--min-lr", "optim.min_lr", float, megatron_default=0.0),
    read("--lr-warmup-iters", int),
    read("--lr-warmup-fraction", float),
    value("--lr-decay-iters", "optim.lr_decay_iters", int),
    value("--lr-decay-style", "optim.lr_decay_style", megatron_default="linear"),
    value("--weight-decay", "optim.weight_decay", float),
    value("--adam-beta1", "optim.adam_beta1", float),
    value("--adam-beta2", "optim.adam_beta2", float, megatron_default=0.999),
    value("--adam-eps", "optim.adam_eps", float),
    value("--clip-grad", "optim.clip_grad", float),
    # Training loop.
    value("--micro-batch-size", "train.micro_batch_size", int),
    value("--global-batch-size", "train.global_batch_size", int, megatron_default=None),
    value("--train-iters", "train.iters", int),
    value("--eval-interval", "train.eval_interval", int),
    value("--eval-iters", "train.eval_iters", int),
    value("--exit-interval", "train.exit_interval", int),
    switch("--manual-gc", "train.manual_gc"),
    value("--manual-gc-interval", "train.manual_gc_interval", int),
    switch("--no-manual-gc-eval", "train.manual_gc_eval", False),
    value("--seed", "train.seed", int),
    # Data.
    Flag("--data-path", "data.data_path", str, nargs="+"),
    value("--split", "data.split"),
    value("--num-workers", "data.num_workers", int),
    read("--tokenizer-type"),
    read("--tokenizer-model"),
    fixed("--vocab-file", why="data.tokenizer takes one tokenizer.json: use --tokenizer-model"),
    fixed("--merge-file", why="data.tokenizer takes one tokenizer.json: use --tokenizer-model"),
    # Checkpoints and logging.
    value("--save", "checkpoint.save"),
    value("--load", "checkpoint.load"),
    value("--save-interval", "checkpoint.interval", int),
    value("--log-interval", "logging.log_interval", int),
    value("--tensorboard-dir", "logging.tensorboard_dir"),
    value("--wandb-project", "logging.wandb_project"),
)

_BY_NAME = {flag.name: flag for flag in FLAGS}
_TOKENIZERS = ("HuggingFaceTokenizer", "GPT2BPETokenizer", "NullTokenizer")
_TRANSFORMER_IMPL = {"local": "local", "transformer_engine": "te"}
# `key=value`, `+key=value`, `++key=value`: Hydra overrides, passed through as they are.
_OVERRIDE = re.compile(r"^\+{0,2}[A-Za-z_][\w.\-/@]*=")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse would print usage and exit; we report one line
        raise MlmArgsError(message)


def _dest(name: str) -> str:
    return name.lstrip("-").replace("-", "_")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="python -m megatron_ext.pretrain_gpt",
        description="Megatron-LM pretrain_gpt.py flags, plus Hydra key=value overrides.",
        allow_abbrev=False,  # a prefix of one flag must not silently become another
    )
    for flag in FLAGS:
        help = f"-> {flag.key}" if flag.key else flag.why or None
        if flag.type is None:
            parser.add_argument(flag.name, dest=_dest(flag.name), action="store_true", help=help)
        else:
            parser.add_argument(
                flag.name, dest=_dest(flag.name), type=flag.type, nargs=flag.nargs, help=help,
                metavar=flag.type.__name__.upper(),
            )
    return parser


def _hydra_value(v: Any) -> str:
    """A Python value in Hydra's override grammar."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, list):
        return "[" + ",".join(_hydra_value(item) for item in v) + "]"
    if re.fullmatch(r"[A-Za-z_/.][\w\-./:+@]*", v) and v.lower() not in ("true", "false", "null"):
        return v
    # Quoted: commas (a sweep otherwise), spaces, `~`... `\` before a quote or at the end and
    # `${` (an interpolation otherwise) need escaping inside quotes.
    escaped = re.sub(r"(\\+)(?='|$)", r"\1\1", v).replace("'", "\\'").replace("${", "\\${")
    return f"'{escaped}'"


def _check_fixed(args: argparse.Namespace) -> None:
    for flag in FLAGS:
        given = getattr(args, _dest(flag.name))
        if flag.only is None or given is None or given is False:  # absent (0.0 == False)
            continue
        if flag.type is not None and given not in flag.only:
            raise MlmArgsError(f"{flag.name} {given} is not supported: {flag.why}")


def _direct(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for flag in FLAGS:
        if flag.key is None:
            continue
        given = getattr(args, _dest(flag.name))
        if flag.type is None:
            given = flag.const if given else None
        if given is not None:
            out[flag.key] = given
        elif flag.megatron_default is not _UNSET:
            out.setdefault(flag.key, flag.megatron_default)
    return out


def _derived(a: argparse.Namespace) -> dict[str, Any]:
    """Overrides that depend on several flags, following Megatron-LM's arguments.py."""
    out: dict[str, Any] = {}
    if a.bf16 and a.fp16:
        raise MlmArgsError("--bf16 and --fp16 are exclusive")
    if a.hidden_size is not None:
        out["model.hidden_size"] = a.hidden_size
        if a.ffn_hidden_size is None:
            out["model.ffn_hidden_size"] = int(4 * a.hidden_size * 2 / 3 / 64) * 64
    if a.ffn_hidden_size is not None:
        out["model.ffn_hidden_size"] = a.ffn_hidden_size
    if a.kv_channels is not None and (
        a.hidden_size is None
        or a.num_attention_heads is None
        or a.kv_channels * a.num_attention_heads != a.hidden_size
    ):
        raise MlmArgsError(
            f"--kv-channels {a.kv_channels} is not supported: megatron_ext uses "
            "--hidden-size / --num-attention-heads (give both)"
        )
    if a.num_query_groups is not None and not a.group_query_attention:
        raise MlmArgsError(
            "--num-query-groups needs --group-query-attention (Megatron-LM ignores it without)"
        )
    if a.group_query_attention:
        out["model.num_query_groups"] = a.num_query_groups or 1  # Megatron-LM's default is 1
    if (
        a.max_position_embeddings is not None
        and a.seq_length is not None
        and a.max_position_embeddings < a.seq_length
    ):
        raise MlmArgsError(
            f"--max-position-embeddings ({a.max_position_embeddings}) must be >= "
            f"--seq-length ({a.seq_length})"
        )
    out.update(_vpp(a))
    out.update(_warmup(a))
    out.update(_tokenizer(a))
    if a.transformer_impl is not None:
        if a.transformer_impl not in _TRANSFORMER_IMPL:
            raise MlmArgsError(
                f"--transformer-impl {a.transformer_impl} is not supported: use local or "
                "transformer_engine"
            )
        out["model.spec"] = _TRANSFORMER_IMPL[a.transformer_impl]
    return out


def _vpp(a: argparse.Namespace) -> dict[str, Any]:
    per_stage = a.num_layers_per_virtual_pipeline_stage
    if per_stage is None:
        return {}
    if a.virtual_pipeline_model_parallel_size is not None:
        raise MlmArgsError(
            "--num-layers-per-virtual-pipeline-stage and --virtual-pipeline-model-parallel-size "
            "are exclusive"
        )
    if a.num_layers is None:
        raise MlmArgsError("--num-layers-per-virtual-pipeline-stage needs --num-layers")
    pp = a.pipeline_model_parallel_size or 1
    if a.num_layers % (pp * per_stage):
        raise MlmArgsError(
            f"--num-layers ({a.num_layers}) must be divisible by --pipeline-model-parallel-size "
            f"* --num-layers-per-virtual-pipeline-stage ({pp} * {per_stage})"
        )
    return {"parallel.vpp": a.num_layers // pp // per_stage}


def _warmup(a: argparse.Namespace) -> dict[str, Any]:
    if a.lr_warmup_fraction is None:
        return {"optim.lr_warmup_iters": a.lr_warmup_iters or 0}  # Megatron-LM's default: none
    if a.lr_warmup_iters is not None:
        raise MlmArgsError("--lr-warmup-fraction and --lr-warmup-iters are exclusive")
    decay_iters = a.lr_decay_iters or a.train_iters
    if decay_iters is None:
        raise MlmArgsError("--lr-warmup-fraction needs --lr-decay-iters or --train-iters")
    return {"optim.lr_warmup_iters": round(a.lr_warmup_fraction * decay_iters)}


def _tokenizer(a: argparse.Namespace) -> dict[str, Any]:
    kind, model = a.tokenizer_type, a.tokenizer_model
    if kind is not None and kind not in _TOKENIZERS:
        raise MlmArgsError(
            f"--tokenizer-type {kind} is not supported: use HuggingFaceTokenizer with "
            f"--tokenizer-model <tokenizer.json>, or NullTokenizer"
        )
    if kind == "NullTokenizer":
        if model is not None:
            raise MlmArgsError("--tokenizer-model does not go with --tokenizer-type NullTokenizer")
        return {"data.tokenizer": "byte"}
    if kind is not None and model is None:
        raise MlmArgsError(f"--tokenizer-type {kind} needs --tokenizer-model <tokenizer.json>")
    return {"data.tokenizer": model} if model is not None else {}


def _split_overrides(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    flags = [arg for arg in argv if not _OVERRIDE.match(arg)]
    return flags, [arg for arg in argv if _OVERRIDE.match(arg)]


def mlm_args_to_overrides(argv: Sequence[str]) -> list[str]:
    """Megatron-LM flags (and trailing Hydra overrides) -> Hydra overrides on our config."""
    flag_args, passthrough = _split_overrides(argv)
    args, unknown = build_parser().parse_known_args(flag_args)
    if unknown:
        first = next((arg for arg in unknown if arg.startswith("-")), None)
        if first is not None:
            raise MlmArgsError(f"unknown Megatron-LM flag {first.split('=')[0]}")
        raise MlmArgsError(f"unexpected argument {unknown[0]!r} (overrides look like key=value)")
    _check_fixed(args)
    values = {**_direct(args), **_derived(args)}
    # Hydra applies overrides in order, so a passed-through `experiment=...` replaces ours.
    mapped = [f"{key}={_hydra_value(v)}" for key, v in values.items()]
    return ["experiment=none", *mapped, *passthrough]
