"""Megatron-LM `pretrain_gpt.py` command lines as Hydra overrides on our config.

    translate(["--tensor-model-parallel-size", "2", "--bf16", "train.iters=10"]).overrides
    -> ["experiment=none", ..., "parallel.tp=2", "model.precision=bf16", "train.iters=10"]

Every flag of Megatron-LM's parser is one row of `mlm_flags.FLAGS`: mapped, accepted with a
notice, or refused. Decisions a Megatron-LM user should know:

- The start is `experiment=none` (one process, group defaults); `--nproc N` (ours) starts N
  local workers when not under torchrun/srun. A `key=value` argument anywhere is a Hydra
  override and is applied last, so `experiment=...` or `model=...` presets still work.
- Megatron-LM's defaults where they change the model or the training are emitted when their
  flag is absent (the rows' `default`): a command line without --swiglu, --normalization or
  --position-embedding-type builds GPT-3's LayerNorm, GeLU with a 4h MLP, learned absolute
  positions, biases and dropout 0.1. A `model=<preset>` override keeps the preset's
  architecture instead (the model defaults are then not emitted).
- Every unknown or refused flag of a command line is reported at once, one line each.
- Tokenizers: the types that read --tokenizer-model (HuggingFaceTokenizer, GPT2BPE,
  Llama2/SentencePiece and SFT tokenizers) take a tokenizer.json or a folder holding one, and the
  SentencePiece types (Llama2Tokenizer, SentencePieceTokenizer, GPTSentencePieceTokenizer) also a
  SentencePiece .model, read as Megatron-LM's default tokenizers read it (no bos added, eod the
  model's eos); the file becomes data.tokenizer. NullTokenizer means "ids are already tokens" and
  becomes data.tokenizer=null:<--vocab-size>, whose end of document is one id past them.
"""

from __future__ import annotations

import argparse
import functools
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from megatron_ext.config.mlm_namespace import layout_fields, model_fields
from megatron_ext.config.mlm_flags import FLAGS, MAPPED, NOTICE, OWN_FLAGS, REFUSED, UNSET, Flag
from megatron_ext.config.data_path import data_prefixes
from megatron_ext.config.tokenizer_spec import gpt2_files_spec, null_tokenizer_spec
from megatron_ext.platform import optional


class MlmArgsError(ValueError):
    """A Megatron-LM command line we cannot map; one line per problem, each naming its flag."""

    def __init__(self, problems: Sequence[str]) -> None:
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


ALL_FLAGS: tuple[Flag, ...] = (*FLAGS, *OWN_FLAGS)
_BY_NAME = {flag.name: flag for flag in ALL_FLAGS}
# Tokenizer types that read a SentencePiece .model (or a tokenizer.json, or a folder holding either).
_SENTENCEPIECE_TOKENIZERS = ("Llama2Tokenizer", "SentencePieceTokenizer", "GPTSentencePieceTokenizer")
# Tokenizer types that read --tokenizer-model: a tokenizer.json or a folder holding one, or a .model
# for the SentencePiece types.
_MODEL_TOKENIZERS = ("HuggingFaceTokenizer", "GPT2BPETokenizer", *_SENTENCEPIECE_TOKENIZERS, "SFTTokenizer")
# Megatron-LM's switches of its SentencePiece tokenizers that change the ids of a .model.
_SENTENCEPIECE_SWITCHES = ("--tokenizer-sentencepiece-legacy", "--no-tokenizer-sentencepiece-ignore-extra-whitespaces")
_TRANSFORMER_IMPL = {"local": "local", "transformer_engine": "auto"}
# Megatron-LM's --sft-tokenizer-prompt-format default, read by its SFTTokenizer.
SFT_TOKENIZER_PROMPT_FORMAT = "nemotron-h-aligned"
# `key=value`, `+key=value`, `++key=value`: Hydra overrides, passed through as they are.
_OVERRIDE = re.compile(r"^\+{0,2}[A-Za-z_][\w.\-/@]*=")
_TYPES = {"int": int, "float": float, "str": str}


@dataclass
class Translation:
    """A command line's Hydra overrides, its notices, and which typed flag set each key."""

    overrides: list[str]
    notices: list[str] = field(default_factory=list)
    # config key -> the flag as typed ("--tensor-model-parallel-size 3"), for error messages.
    sources: dict[str, str] = field(default_factory=dict)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse would print usage and exit; we report one line
        raise MlmArgsError([message])


def _dest(flag: Flag) -> str:
    return flag.name.lstrip("-").replace("-", "_")


def _add(parser: argparse.ArgumentParser, flag: Flag) -> None:
    # Absent flags stay out of the namespace, so "given" is "present in it".
    common: dict[str, Any] = dict(dest=_dest(flag), default=argparse.SUPPRESS)
    if flag.syntax == "bool":
        parser.add_argument(*flag.names, action=argparse.BooleanOptionalAction, **common)
    elif flag.is_switch:
        parser.add_argument(*flag.names, action="store_true", **common)
    else:
        kind, nargs = re.fullmatch(r"(int|float|str)(\+|\*|\?|\d+)?", flag.syntax).groups()
        parser.add_argument(
            *flag.names, type=_TYPES[kind], choices=flag.choices,
            nargs=int(nargs) if nargs and nargs.isdigit() else nargs,
            metavar=kind.upper(), **common,
        )


@functools.cache  # 900 flags: built once; parsing does not change it
def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="python -m megatron_ext.pretrain_gpt",
        description="Megatron-LM pretrain_gpt.py flags, plus Hydra key=value overrides.",
        allow_abbrev=False,  # a prefix of one flag must not silently become another
        add_help=False,
    )
    for flag in ALL_FLAGS:
        _add(parser, flag)
    return parser


def hydra_value(v: Any) -> str:
    """A Python value in Hydra's override grammar."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, list):
        return "[" + ",".join(hydra_value(item) for item in v) + "]"
    if re.fullmatch(r"[A-Za-z_/.][\w\-./:+@]*", v) and v.lower() not in ("true", "false", "null"):
        return v
    # Quoted: commas (a sweep otherwise), spaces, `~`... `\` before a quote or at the end and
    # `${` (an interpolation otherwise) need escaping inside quotes.
    escaped = re.sub(r"(\\+)(?='|$)", r"\1\1", v).replace("'", "\\'").replace("${", "\\${")
    return f"'{escaped}'"


class _Builder:
    """Collects overrides, notices and problems while the flags of one command line are read."""

    def __init__(self, given: dict[str, Any], typed: dict[str, str]) -> None:
        self.given, self.typed = given, typed
        self.values: dict[str, Any] = {}
        self.sources: dict[str, str] = {}
        self.notices: list[str] = []
        self.problems: list[str] = []

    def has(self, name: str) -> bool:
        return _dest(_BY_NAME[name]) in self.given

    def get(self, name: str, default: Any = None) -> Any:
        return self.given.get(_dest(_BY_NAME[name]), default)

    def shown(self, name: str) -> str:
        """The flag as the user typed it: `--name value`, or `--name` for a switch."""
        return self.typed.get(name, name)

    def set(self, key: str, value: Any, *names: str) -> None:
        self.values[key] = value
        if names:
            self.sources[key] = " ".join(self.shown(n) for n in names)

    def notice(self, name: str, text: str) -> None:
        self.notices.append(f"{self.shown(name)}: {text}")

    def problem(self, name: str, text: str) -> None:
        self.problems.append(f"{self.shown(name)}: {text}")


def _shown_value(value: Any) -> str:
    return " ".join(map(str, value)) if isinstance(value, list) else str(value)


def _typed(argv: Sequence[str], given: dict[str, Any]) -> dict[str, str]:
    """Canonical flag name -> the flag as typed (the alias used, with its value)."""
    present = {arg.split("=", 1)[0] for arg in argv if arg.startswith("--")}
    out = {}
    for flag in ALL_FLAGS:
        if _dest(flag) not in given:
            continue
        alias = next((n for n in flag.names if n in present), flag.name)
        value = given[_dest(flag)]
        out[flag.name] = alias if flag.is_switch else f"{alias} {_shown_value(value)}"
    return out


def _read_rows(b: _Builder) -> None:
    """Each given flag by its row: refused, noticed, or mapped onto its key."""
    for flag in ALL_FLAGS:
        if not b.has(flag.name):
            continue
        value = b.get(flag.name)
        if flag.status == REFUSED:
            b.problem(flag.name, flag.target)
            continue
        values = value if isinstance(value, list) else [value]
        if flag.only is not None and not flag.is_switch and not set(values) <= set(flag.only):
            b.problem(flag.name, flag.refuse)
            continue
        if flag.status == NOTICE and not flag.derived:
            b.notice(flag.name, flag.target)
        elif flag.status == MAPPED and not flag.derived:
            b.set(flag.target, flag.value if flag.is_switch else value, flag.name)


def _single(b: _Builder, name: str) -> None:
    """Megatron takes a list for some MoE flags (one value per layer group); we take one."""
    value = b.get(name)
    if isinstance(value, list) and len(value) == 1:
        b.set(_BY_NAME[name].target, value[0], name)
    elif isinstance(value, list):
        b.problem(name, "one value only (per-layer-group values are not supported)")
        b.values.pop(_BY_NAME[name].target, None)


def _model_shape(b: _Builder) -> None:
    """Activation, FFN size and attention heads, following Megatron-LM's arguments.py."""
    if b.has("--bf16") and b.has("--fp16"):
        b.problem("--fp16", "--bf16 and --fp16 are exclusive")
    gated = [n for n in ("--swiglu", "--squared-relu", "--quick-geglu") if b.has(n)]
    if len(gated) > 1:
        b.problem(gated[1], f"{gated[0]} and {gated[1]} are exclusive")
    activation = _BY_NAME[gated[0]].const if gated else "gelu"
    if gated:
        b.set("model.activation", activation, gated[0])
    else:
        b.values["model.activation"] = activation  # Megatron-LM's default: GeLU
    hidden, ffn = b.get("--hidden-size"), b.get("--ffn-hidden-size")
    if hidden is not None:
        b.set("model.hidden_size", hidden, "--hidden-size")
    if ffn is not None:
        b.set("model.ffn_hidden_size", ffn, "--ffn-hidden-size")
    elif hidden is not None:
        # Megatron-LM: a SwiGLU MLP keeps the parameters of a 4h one, rounded down to 64.
        size = int(4 * hidden * 2 / 3 / 64) * 64 if activation == "swiglu" else 4 * hidden
        b.set("model.ffn_hidden_size", size, "--hidden-size")
    groups = b.get("--num-query-groups")
    if b.has("--group-query-attention"):
        # Megatron-LM's default is one group (multi-query attention).
        b.set("model.num_query_groups", groups or 1, "--group-query-attention",
              *(["--num-query-groups"] if groups else []))
    elif groups is not None:
        b.notice("--num-query-groups", "ignored without --group-query-attention, as in Megatron-LM")
    etp, tp = b.get("--expert-tensor-parallel-size"), b.get("--tensor-model-parallel-size", 1)
    if etp is not None and etp != tp:
        if b.has("--num-experts"):
            b.problem("--expert-tensor-parallel-size", "must equal --tensor-model-parallel-size with "
                      "--num-experts (megatron_ext's expert TP is the TP size)")
        else:  # it splits expert weights only: a dense model has none
            b.notice("--expert-tensor-parallel-size", "no effect without --num-experts (no expert layers)")


def _positions(b: _Builder) -> None:
    maximum, seq = b.get("--max-position-embeddings"), b.get("--seq-length")
    _rope_type(b)
    if maximum is not None and seq is not None and maximum < seq:
        b.problem("--max-position-embeddings", f"must be >= --seq-length ({seq})")
    if b.has("--no-position-embedding"):
        kind = b.values.get("model.position_embedding_type", "learned_absolute")
        if kind == "rope":
            b.notice("--no-position-embedding", _BY_NAME["--no-position-embedding"].target)
        else:
            b.problem("--no-position-embedding", "deprecated in Megatron-LM, which refuses it "
                      "without rope positions: use --position-embedding-type none")


def _rope_type(b: _Builder) -> None:
    """--rope-type is multi-latent attention's RoPE: YaRN unless it says rope (megatron-core's
    MLA default). Here the model space's position_embedding_type carries it; other attention
    takes rope only, as Megatron-LM asserts."""
    kind = b.get("--rope-type")
    if not b.has("--multi-latent-attention"):
        if kind not in (None, "rope"):
            b.problem("--rope-type", "yarn is multi-latent attention's; other attention takes "
                      "--position-embedding-type yarn")
        return
    if b.values.get("model.position_embedding_type", "rope") == "rope":
        b.set("model.position_embedding_type", kind or "yarn", "--rope-type")


VPP_FLAGS = (
    "--num-layers-per-virtual-pipeline-stage", "--num-virtual-stages-per-pipeline-rank",
    "--virtual-pipeline-model-parallel-size",
)


def _parallel(b: _Builder) -> None:
    if b.has("--sequence-parallel"):
        if b.get("--tensor-model-parallel-size", 1) == 1:
            b.notice("--sequence-parallel", "turned off at --tensor-model-parallel-size 1, as "
                     "Megatron-LM does")
        else:
            b.set("parallel.sequence_parallel", True, "--sequence-parallel")
    vpp = [n for n in VPP_FLAGS if b.has(n)]
    if vpp and not b.has("--global-batch-size"):
        # Megatron-LM's default global batch, micro batch * dp, is one micro-batch per step:
        # fewer than the interleaved schedule's group of pp micro-batches.
        b.problem(vpp[0], "needs --global-batch-size (a multiple of --micro-batch-size * dp * "
                  "--pipeline-model-parallel-size)")
    per_stage = b.get("--num-layers-per-virtual-pipeline-stage")
    if per_stage is None:
        return
    name = "--num-layers-per-virtual-pipeline-stage"
    layers, pp = b.get("--num-layers"), b.get("--pipeline-model-parallel-size", 1)
    if b.has("--virtual-pipeline-model-parallel-size") or b.has(
        "--num-virtual-stages-per-pipeline-rank"
    ):
        b.problem(name, "exclusive with --num-virtual-stages-per-pipeline-rank")
    elif layers is None:
        b.problem(name, "needs --num-layers")
    elif layers % (pp * per_stage):
        b.problem(name, f"--num-layers ({layers}) must be divisible by "
                  f"--pipeline-model-parallel-size * {name} ({pp} * {per_stage})")
    else:
        b.set("parallel.vpp", layers // pp // per_stage, name, "--num-layers")


_WARMUPS = ("--lr-warmup-iters", "--lr-warmup-samples")


def _schedule(b: _Builder) -> None:
    """Warmup in iterations or samples (Megatron-LM: one or the other, by --train-samples)."""
    samples = b.has("--train-samples")
    if samples and b.has("--train-iters"):
        b.problem("--train-samples", "exclusive with --train-iters")
    wrong = ["--lr-warmup-iters", "--lr-decay-iters"] if samples else [
        "--lr-warmup-samples", "--lr-decay-samples"]
    for name in wrong:
        # A warmup of 0 in the other unit is Megatron-LM's default, which its checks accept.
        if b.has(name) and not (name in _WARMUPS and b.get(name) == 0):
            b.problem(name, "does not go with --train-samples" if samples
                      else "needs --train-samples (a sample-based schedule)")
    fraction = b.get("--lr-warmup-fraction")
    warmup = "--lr-warmup-samples" if samples else "--lr-warmup-iters"
    if fraction is None:
        count = b.get(warmup, 0)  # Megatron-LM's default: no warmup
        key = "optim.lr_warmup_samples" if samples else "optim.lr_warmup_iters"
        b.set(key, count, *([warmup] if b.has(warmup) else []))
        return
    if b.has(warmup):
        b.problem("--lr-warmup-fraction", f"exclusive with {warmup}")
        return
    unit = "samples" if samples else "iters"
    decay = b.get(f"--lr-decay-{unit}") or b.get(f"--train-{unit}")
    if decay is None:
        b.problem("--lr-warmup-fraction", f"needs --lr-decay-{unit} or --train-{unit}")
        return
    b.set(f"optim.lr_warmup_{unit}", round(fraction * decay), "--lr-warmup-fraction")


def _tokenizer(b: _Builder) -> None:
    kind, model = b.get("--tokenizer-type"), b.get("--tokenizer-model")
    if kind == "NullTokenizer":
        _null_tokenizer(b, model)
        return
    if kind is not None and kind not in _MODEL_TOKENIZERS:
        b.problem("--tokenizer-type", "use HuggingFaceTokenizer with --tokenizer-model "
                  "<tokenizer.json or folder>, Llama2Tokenizer with a SentencePiece .model, or NullTokenizer")
        return
    files = b.get("--vocab-file"), b.get("--merge-file")
    if any(f is not None for f in files):
        _gpt2_files(b, kind, *files)
        return
    if model is None:
        if kind is not None:
            files = "tokenizer.json, .model" if kind in _SENTENCEPIECE_TOKENIZERS else "tokenizer.json"
            b.problem("--tokenizer-type", f"needs --tokenizer-model <{files} or folder>")
        return
    if model.endswith(".model"):
        _sentencepiece_model(b, kind, model)
        return
    if kind == "SFTTokenizer" and not b.has("--sft"):
        b.notice("--tokenizer-type", "the chat prompt format is not applied without --sft: pretraining text")
    b.set("data.tokenizer", model, "--tokenizer-model")


def _sft(b: _Builder) -> None:
    """--sft: the --data-path files are conversations (our `data=sft` preset); Megatron-LM's
    packing flags name what packed conversations do anyway."""
    packing = [name for name in ("--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss") if b.has(name)]
    if not b.has("--sft"):
        for name in packing:
            b.problem(name, "document boundaries of pre-training data are not masked here (with --sft, packed "
                      "conversations are kept apart)")
        if b.has("--sft-tokenizer-prompt-format"):
            b.notice("--sft-tokenizer-prompt-format", "read only with --sft")
        return
    paths = b.values.pop("data.data_path", None)
    if not paths:
        b.problem("--sft", "needs --data-path: the JSONL files of conversations")
        return
    if data_prefixes(paths) != paths:
        b.problem("--data-path", "weights are not read with --sft: give the files of conversations")
        return
    b.set("data", "sft", "--sft")
    b.set("data.sft.path", paths, "--sft", "--data-path")
    prompt_format = b.get("--sft-tokenizer-prompt-format")
    if prompt_format is None and b.get("--tokenizer-type") == "SFTTokenizer":
        prompt_format = SFT_TOKENIZER_PROMPT_FORMAT
    if prompt_format is not None:
        b.set("data.sft.prompt_format", prompt_format, "--sft-tokenizer-prompt-format")
    for name in packing:
        b.notice(name, "packed conversations do this here (data.sft.pack)")


def _sentencepiece_model(b: _Builder, kind: Optional[str], model: str) -> None:
    """A SentencePiece .model, read as Megatron-LM's default tokenizers read it for the three types
    that take one: text encoded as sentencepiece encodes it, eod the model's eos."""
    if kind not in (None, *_SENTENCEPIECE_TOKENIZERS):
        *others, last = _SENTENCEPIECE_TOKENIZERS
        b.problem("--tokenizer-model", f"a SentencePiece .model is read with --tokenizer-type {', '.join(others)} or {last}")
        return
    if kind == "SentencePieceTokenizer" and b.has("--legacy-tokenizer"):
        b.problem("--legacy-tokenizer", "Megatron-LM's legacy SentencePieceTokenizer appends <CLS>, <SEP>, "
                  "<EOD> and <MASK> to the vocabulary and ends documents with <EOD>: not supported (without "
                  "--legacy-tokenizer the model's eos ends them)")
    for name in _SENTENCEPIECE_SWITCHES:
        if b.has(name):
            b.problem(name, "not supported: a .model encodes text here as sentencepiece itself does "
                      "(Megatron-LM's default)")
    b.set("data.tokenizer", model, "--tokenizer-model")


def _null_tokenizer(b: _Builder, model: Optional[str]) -> None:
    """Megatron-LM's NullTokenizer reads ids, not text: --vocab-size V is its size (ids 0..V-1,
    the end of document V), and the embedding is padded from V + 1 as Megatron-LM pads it."""
    if model is not None:
        b.problem("--tokenizer-model", "does not go with --tokenizer-type NullTokenizer")
    size = b.get("--vocab-size")
    if size is None:
        b.problem("--tokenizer-type", "NullTokenizer needs --vocab-size (its number of token ids)")
        return
    b.set("data.tokenizer", null_tokenizer_spec(size), "--tokenizer-type", "--vocab-size")
    b.values.pop("model.vocab_size", None)  # derived from the tokenizer, not --vocab-size itself


def _gpt2_files(b: _Builder, kind: Optional[str], vocab: Optional[str], merges: Optional[str]) -> None:
    """Megatron-LM's GPT2BPETokenizer reads GPT-2's vocab.json and merges.txt; it is the
    tokenizer type pretrain_gpt.py defaults to."""
    if kind not in (None, "GPT2BPETokenizer"):
        b.problem("--vocab-file", "is read with --tokenizer-type GPT2BPETokenizer only")
    elif vocab is None or merges is None:
        b.problem("--vocab-file" if vocab is None else "--merge-file",
                  "GPT2BPETokenizer needs both --vocab-file and --merge-file")
    else:
        b.set("data.tokenizer", gpt2_files_spec(vocab, merges), "--vocab-file")


def _implementation(b: _Builder) -> None:
    impl = b.get("--transformer-impl")
    if impl is None:
        return
    if impl not in _TRANSFORMER_IMPL:
        b.problem("--transformer-impl", "use local or transformer_engine")
        return
    b.set("model.spec", _TRANSFORMER_IMPL[impl], "--transformer-impl")
    if impl == "transformer_engine" and not optional.HAVE_TE:
        b.notice("--transformer-impl", "Transformer Engine is not installed: the local layers run")


def _checkpoint_format(b: _Builder) -> None:
    kind = b.get("--ckpt-format")
    if kind is not None and kind != "torch_dist":
        b.notice("--ckpt-format", "checkpoints are written as torch_dist (megatron-core's "
                 "dist_checkpointing), which Megatron-LM reads")


def _attention_window(b: _Builder) -> None:
    """--window-size "L,R" (Megatron-LM's tuple syntax, parentheses optional) and an integer
    --window-attn-skip-freq; Megatron-LM's per-layer list pattern for the latter is refused."""
    if b.has("--window-size"):
        text = b.get("--window-size").strip().strip("()")
        try:
            window = [int(side) for side in text.split(",")]
        except ValueError:
            window = []
        if len(window) == 2:
            b.set("model.window_size", window, "--window-size")
        else:
            b.problem("--window-size", "two integers L,R (keys before and after a query)")
    if b.has("--window-attn-skip-freq"):
        freq = b.get("--window-attn-skip-freq")
        if freq.strip().isdigit():
            b.set("model.window_attn_skip_freq", int(freq), "--window-attn-skip-freq")
        else:
            b.problem("--window-attn-skip-freq", "an integer N (full attention in every N-th layer); per-layer patterns are not supported")


# What --use-checkpoint-args leaves to the command line when it gives them (Megatron-LM's
# load_args_from_checkpoint sets these only where the argument is unset).
_COMMAND_LINE_FIRST = {
    "--num-layers": "num_layers", "--hidden-size": "hidden_size", "--ffn-hidden-size": "ffn_hidden_size",
    "--seq-length": "seq_length", "--num-attention-heads": "num_attention_heads", "--kv-channels": "head_dim",
    "--max-position-embeddings": "max_position_embeddings",
}


# Reads the `args` Namespace of checkpoint `step` (None: the latest) under a --load directory;
# None when there is none. The entry point gives it: reading a checkpoint is below this layer.
SavedArgsReader = Callable[[str, Optional[int]], Optional[argparse.Namespace]]


def _checkpoint_args(b: _Builder, read_saved_args: Optional[SavedArgsReader]) -> None:
    """--use-checkpoint-args: the model's flags from the `args` of the checkpoint --load names
    (--use-mp-args-from-checkpoint-args: its parallel sizes too); without a checkpoint there,
    the command line's, as Megatron-LM does."""
    if not b.has("--use-checkpoint-args"):
        if b.has("--use-mp-args-from-checkpoint-args"):
            b.problem("--use-mp-args-from-checkpoint-args", "needs --use-checkpoint-args")
        return
    load = b.get("--load")
    args = read_saved_args(load, b.get("--ckpt-step")) if load is not None and read_saved_args else None
    if args is None:
        b.notice("--use-checkpoint-args", "no checkpoint in --load: the command line's model flags are used")
        return
    given = {name for flag, name in _COMMAND_LINE_FIRST.items() if b.has(flag)}
    for name, value in model_fields(args).items():
        if name not in given:
            b.set(f"model.{name}", value, "--use-checkpoint-args")
    if b.has("--use-mp-args-from-checkpoint-args"):
        for name, value in layout_fields(args).items():
            b.set(f"parallel.{name}", value, "--use-mp-args-from-checkpoint-args")


def _derived(b: _Builder) -> None:
    """Overrides that depend on several flags, following Megatron-LM's arguments.py."""
    _model_shape(b)
    _attention_window(b)
    _positions(b)
    _parallel(b)
    _schedule(b)
    _tokenizer(b)
    _sft(b)
    _implementation(b)
    _checkpoint_format(b)
    if b.has("--skip-train"):  # Megatron-LM's arguments.py: no optimizer to load into
        b.set("checkpoint.load_optim", False, "--skip-train")
    for name in ("--moe-router-load-balancing-type", "--moe-aux-loss-coeff"):
        if b.has(name):
            _single(b, name)


def _defaults(b: _Builder, keep_model: bool) -> None:
    """Megatron-LM's defaults for the absent flags (a `model=` preset keeps its architecture)."""
    for flag in ALL_FLAGS:
        if flag.default is UNSET or flag.target in b.values:
            continue
        if keep_model and flag.target.startswith("model."):
            continue
        b.values[flag.target] = flag.default
    if keep_model and "model.activation" not in b.sources:
        b.values.pop("model.activation", None)


def _split(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    flags = [arg for arg in argv if not _OVERRIDE.match(arg)]
    return flags, [arg for arg in argv if _OVERRIDE.match(arg)]


def _unknown(flag_args: Sequence[str], unknown: Sequence[str]) -> list[str]:
    """Every unknown flag, and every stray word that is not an unknown flag's value."""
    left, problems = set(unknown), []
    for i, arg in enumerate(flag_args):
        if arg not in left:
            continue
        if arg.startswith("-"):
            problems.append(f"{arg.split('=')[0]}: unknown Megatron-LM flag")
            continue
        before = flag_args[i - 1] if i else ""
        if not (before.startswith("-") and "=" not in before and before in left):
            problems.append(f"unexpected argument {arg!r} (overrides look like key=value)")
    return problems


def translate(argv: Sequence[str], read_saved_args: Optional[SavedArgsReader] = None) -> Translation:
    """Megatron-LM flags (and Hydra overrides) -> Hydra overrides on our config, the notices
    to print, and the typed flag behind each key. Raises MlmArgsError listing every problem.
    `read_saved_args` reads a checkpoint's `args` for --use-checkpoint-args."""
    flag_args, passthrough = _split(argv)
    namespace, unknown = build_parser().parse_known_args(flag_args)
    given = vars(namespace)
    b = _Builder(given, _typed(flag_args, given))
    b.problems += _unknown(flag_args, unknown)
    _read_rows(b)
    _derived(b)
    _checkpoint_args(b, read_saved_args)
    if b.problems:
        raise MlmArgsError(b.problems)
    _defaults(b, keep_model=any(arg.startswith("model=") for arg in passthrough))
    # Hydra applies overrides in order, so a passed-through `experiment=...` replaces ours.
    mapped = [f"{key}={hydra_value(v)}" for key, v in b.values.items()]
    return Translation(["experiment=none", *mapped, *passthrough], b.notices, b.sources)


def mlm_args_to_overrides(argv: Sequence[str]) -> list[str]:
    """Megatron-LM flags (and trailing Hydra overrides) -> Hydra overrides on our config."""
    return translate(argv).overrides


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _what(flag: Flag) -> str:
    """The table's last column: the key, the notice or the reason, with value limits."""
    if flag.status == MAPPED:
        text = f"`{flag.target}`" + (" (with other flags)" if flag.derived else "")
        if flag.is_switch:
            text += f" = `{hydra_value(flag.value)}`"
    else:
        text = flag.target
    if flag.only is not None:
        text += f"; only {', '.join(map(_shown_value, flag.only))}, else refused: {flag.refuse}"
    if flag.note:
        text += f"; {flag.note}"
    if flag.default is not UNSET:
        text += f"; absent: Megatron-LM's `{hydra_value(flag.default)}`"
    return _cell(text)


def flag_table_markdown() -> str:
    """docs/megatron_flags.md: every flag of the parser with its status, from `ALL_FLAGS`."""
    counts = {s: sum(f.status == s for f in FLAGS) for s in (MAPPED, NOTICE, REFUSED)}
    lines = [
        "# Megatron-LM flags in `python -m megatron_ext.pretrain_gpt`",
        "",
        "Generated from `megatron_ext/config/mlm_flags.py` by "
        "`python -m megatron_ext.pretrain_gpt --flag-table`; do not edit by hand.",
        "",
        "Each flag of Megatron-LM's `pretrain_gpt.py` parser is **mapped** (the same meaning, "
        "onto a config key), accepted with a one-line **notice** (no effect here), or "
        "**refused** with the reason; a command line lists every refused flag at once. "
        f"Megatron-LM's {len(FLAGS)} flags: {counts[MAPPED]} mapped, {counts[NOTICE]} notice, "
        f"{counts[REFUSED]} refused.",
        "",
    ]
    title = None
    for flag in ALL_FLAGS:
        if flag.group != title:
            title = flag.group
            lines += ["", f"## {title}", "", "| flag | value | status | key / notice / reason |",
                      "| --- | --- | --- | --- |"]
        names = " ".join(f"`{n}`" for n in flag.names)
        choices = f" ({'/'.join(map(str, flag.choices))})" if flag.choices else ""
        lines.append(f"| {names} | {flag.syntax}{_cell(choices)} | {flag.status} | {_what(flag)} |")
    return "\n".join(lines) + "\n"
