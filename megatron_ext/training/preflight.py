"""What a run will read and write, checked before any worker starts: the data files, the
pretrained weights, the checkpoint to resume from (its tracker, and that it is this model's
shape) and the checkpoint directory to save to. A failure is a ConfigError naming the field and
the path; otherwise a rank would find it minutes later, as a traceback, or never (a mistyped
`checkpoint.load` trained from scratch).

Only the launcher's cheap imports are used here (no megatron) unless a checkpoint must be read
or the split of indexed datasets checked.
Paths are taken as the readers and writers take them: `~` is expanded where they expand it
(model.pretrained, data.corpus), not in checkpoint and data paths.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import socket
import sys
import warnings
from pathlib import Path
from typing import Any, Optional

from megatron_ext.checkpointing.megatron_lm import layout_key, optimizer_layout_problem
from megatron_ext.config.data_path import data_prefixes
from megatron_ext.config.mlm_namespace import model_fields
from megatron_ext.config.schema import Config, DataConfig, ModelConfig
from megatron_ext.config.validate import ConfigError, evaluates
from megatron_ext.models.convert.families import family
from megatron_ext.platform.checkpoint_storage import UncheckedTorch, checkpoint_files
from megatron_ext.checkpointing import tracker
from megatron_ext.training.file_headers import check_gguf, check_safetensors

# The model fields that decide the shapes of the tensors a checkpoint holds.
SHAPE_FIELDS = (
    "arch",
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "head_dim",
    "tie_embeddings",
    "normalization",
    "activation",
    "position_embedding_type",
    "add_bias_linear",
    "add_qkv_bias",
    "qk_layernorm",
    "multi_latent_attention",
    "num_experts",
    "hybrid_pattern",
)
# Fields that shape tensors only when their feature (the key) is on: compared when it is on in
# the config or in the checkpoint (its defaults differ between Megatron-LM's flags and ours).
FEATURE_SHAPE_FIELDS = {
    "multi_latent_attention": ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"),
    "num_experts": ("moe_ffn_hidden_size", "moe_shared_expert_intermediate_size", "moe_router_enable_expert_bias"),
    "hybrid_pattern": ("mamba_num_heads", "mamba_head_dim", "mamba_num_groups", "mamba_state_dim"),
}


def check_inputs(cfg: Config, tokenize_sft: bool = True) -> None:
    """Raise ConfigError for the first input or output of `cfg` that cannot work.
    `tokenize_sft`: read and tokenize the SFT conversations here (into the cache the ranks then
    read), so that a broken record is named before any worker starts."""
    check_data(cfg.data)
    check_split(cfg)
    if cfg.data.sft is not None and cfg.data.sft.path and tokenize_sft:
        check_sft_data(cfg)
    check_vocabulary(cfg)
    if cfg.model.pretrained:
        check_pretrained(cfg.model)
    check_load(cfg)
    if cfg.checkpoint.save:
        check_save(cfg.checkpoint.save)  # last: it creates the directory


# --- data -------------------------------------------------------------------------------------


def check_vocabulary(cfg: Config) -> None:
    """A model.vocab_size below the tokenizer's ids would index past the embedding at the first
    step. Checked here where the tokenizer is named (data.tokenizer, or the byte tokenizer of a
    run without a pretrained model) and no checkpoint decides the vocabulary; otherwise the
    Trainer checks it once it holds the tokenizer."""
    vocab, spec = cfg.model.vocab_size, cfg.data.tokenizer
    if vocab is None or cfg.checkpoint.load or (spec == "auto" and cfg.model.pretrained):
        return
    from megatron_ext.data.tokenizers import build_tokenizer  # heavy: megatron (1.4 s), only when a vocabulary is given

    ids = build_tokenizer("byte" if spec == "auto" else spec).vocab_size
    if vocab < ids:
        raise ConfigError("model.vocab_size", f"{vocab} is below the tokenizer's {ids} ids: give at least {ids}, or leave it unset")


def check_data(data: DataConfig) -> None:
    if data.mock:
        return
    for prefix in data_prefixes(list(data.data_path)):
        _check_indexed_dataset(prefix)
    if not data.data_path and data.corpus != "stdlib" and not os.path.exists(os.path.expanduser(data.corpus)):
        raise ConfigError("data.corpus", f"{data.corpus} does not exist (a text file, a folder of them, or stdlib)")


def check_split(cfg: Config) -> None:
    """`data.split` leaves every dataset of `data.data_path` documents in each split the run
    reads: training's (unless train.skip_train) and validation's when it evaluates (the test
    split is evaluated only where it has documents)."""
    data, train = cfg.data, cfg.train
    if data.mock or data.sft is not None or not data.data_path:
        return
    # megatron's split arithmetic and index reader: only for runs over indexed datasets
    from megatron.core.datasets.utils import Split

    from megatron_ext.data.datasets import check_split_coverage

    reads = {}
    if not train.skip_train:
        reads[Split.train] = "training reads it"
    if evaluates(train):
        reads[Split.valid] = f"evaluation reads it (train.eval_iters={train.eval_iters}; 0 turns evaluation off)"
    check_split_coverage(data_prefixes(list(data.data_path)), data.split, reads)


def check_sft_data(cfg: Config) -> None:
    """Every conversation of data.sft.path parses, renders and fits model.seq_length as
    data.sft.overlong allows; tokenized once, into the cache the ranks read."""
    # heavy (the tokenizer, megatron): only for SFT runs
    from megatron_ext.data.sft import SFTDataError, tokenize_sft_files
    from megatron_ext.data.sft.dataset import fit_to_length
    from megatron_ext.data.tokenizers import build_tokenizer
    from megatron_ext.models.pretrained import run_tokenizer_spec

    sft = cfg.data.sft
    spec = run_tokenizer_spec(cfg.data.tokenizer, cfg.model.pretrained)
    try:
        tokenizer = build_tokenizer(spec)
    except (OSError, ValueError) as e:
        raise ConfigError("data.tokenizer", f"{spec}: {_one_line(e)}") from None
    try:
        conversations = tokenize_sft_files(sft.path, tokenizer, sft.prompt_format, cfg.data.cache_dir)
        fit_to_length(conversations, cfg.model.seq_length + 1, sft.overlong)
    except SFTDataError as e:
        raise ConfigError("data.sft.path", str(e)) from None
    except ValueError as e:  # no chat template, an unknown prompt format
        raise ConfigError("data.sft.prompt_format", str(e)) from None


def _check_indexed_dataset(prefix: str) -> None:
    if os.path.isdir(prefix):
        found = sorted(p.stem for p in Path(prefix).glob("*.idx"))
        hint = f"; its datasets: {', '.join(str(Path(prefix, s)) for s in found)}" if found else ""
        raise ConfigError("data.data_path", f"{prefix} is a folder; give the prefix of a .bin/.idx pair{hint}")
    for suffix in (".bin", ".idx"):
        path = prefix + suffix
        if not os.path.isfile(path):
            raise ConfigError("data.data_path", f"{path} does not exist (a prefix names {prefix}.bin and {prefix}.idx)")
        if os.path.getsize(path) == 0:
            raise ConfigError("data.data_path", f"{path} is empty")


# --- pretrained weights -----------------------------------------------------------------------


def pretrained_path(spec: str) -> str:
    """The filesystem path of `model.pretrained`, `pkg:<module>/<file>` located without importing
    the package."""
    if not spec.startswith("pkg:"):
        return os.path.expanduser(spec)
    module, _, relative = spec[len("pkg:") :].partition("/")
    found = importlib.util.find_spec(module)
    if found is None or not found.submodule_search_locations:
        raise ConfigError("model.pretrained", f"{spec}: the package {module!r} is not installed")
    return os.path.join(found.submodule_search_locations[0], relative)


def check_pretrained(model: ModelConfig) -> None:
    path = pretrained_path(model.pretrained)
    try:
        if not os.path.exists(path):
            raise ValueError(f"{path} does not exist")
        if Path(path, tracker.TRACKER).is_file():
            _check_checkpoint("model.pretrained", path, None, model)
        elif os.path.isdir(path):
            _check_hf_folder(path)
        else:
            check_gguf(path)
    except ConfigError:
        raise
    except ValueError as e:
        raise ConfigError("model.pretrained", str(e)) from None


def _check_hf_folder(path: str) -> None:
    config = Path(path, "config.json")
    if not config.is_file():
        raise ValueError(f"{path} is neither a GGUF file, a Hugging Face folder (no config.json) nor a checkpoint (no {tracker.TRACKER})")
    try:
        hf_config = json.loads(config.read_text())
    except ValueError:
        raise ValueError(f"{config} is not valid JSON") from None
    if not isinstance(hf_config, dict):
        raise ValueError(f"{config} does not hold a JSON object")
    try:
        family(hf_config.get("model_type"), hf_config.get("architectures") or ())
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    weights = sorted(Path(path).glob("*.safetensors"))
    if not weights:
        raise ValueError(f"{path} has no *.safetensors files")
    for file in weights:
        check_safetensors(str(file))


# --- checkpoints ------------------------------------------------------------------------------


def check_load(cfg: Config) -> None:
    """`checkpoint.load` must hold a checkpoint, except where it may be missing: with
    `load_optional`, or when it is also `checkpoint.save` (resume-if-present: the first run of
    `checkpoint.save=runs/x checkpoint.load=runs/x` finds nothing yet); its optimizer state, when
    it is restored, must be readable in the run's layout (or rewritten in it by the launcher,
    training/relayout.py)."""
    checkpoint, model = cfg.checkpoint, cfg.model
    load = checkpoint.load
    if not load:
        return
    root = load
    optional = checkpoint.load_optional or _same_dir(load, checkpoint.save)
    try:
        iteration = tracker.latest_iteration(root)
    except ValueError as e:
        raise ConfigError("checkpoint.load", str(e)) from None
    if iteration is None:
        if tracker.holds_files(root):
            raise ConfigError("checkpoint.load", f"{root} holds no {tracker.TRACKER}: not a checkpoint directory")
        if not optional:
            state = "is empty" if os.path.isdir(root) else "does not exist"
            raise ConfigError(
                "checkpoint.load",
                f"{root} {state}; set checkpoint.load_optional=true to start from scratch when it holds no checkpoint",
            )
        if checkpoint.step is None:
            return
    _check_checkpoint("checkpoint.load", root, checkpoint.step, model, field_of_step="checkpoint.step")
    if checkpoint.load_optim and not checkpoint.finetune:
        ckpt, iteration = _checkpoint_module(), checkpoint.step or tracker.latest_iteration(root)
        ckpt.check_holds_optimizer(root, iteration)
        problem = optimizer_layout_problem(ckpt.load_common(root, iteration), layout_key(cfg.parallel))
        if problem is not None and not _relaid_copy_ready(cfg, root, iteration):
            raise ConfigError("checkpoint.load", f"{tracker.iteration_dir(root, iteration)}: {problem}")


def _relaid_copy_ready(cfg: Config, root: str, iteration: int) -> bool:
    """Whether the launcher rewrote the checkpoint in this run's layout (training/relayout.py)."""
    from megatron_ext.checkpointing.relaid import relaid_copy_ready  # torch and megatron: only for such a checkpoint

    return relaid_copy_ready(cfg, root, iteration)


def _same_dir(a: str, b: Optional[str]) -> bool:
    return b is not None and os.path.abspath(a) == os.path.abspath(b)


def _check_checkpoint(
    field: str, root: str, step: Optional[int], model: ModelConfig, field_of_step: Optional[str] = None
) -> None:
    """The checkpoint of `root` to be read (iteration `step`, else the tracker's) exists, holds a
    model of `model`'s shape, read from its common state, and every shard it names is whole."""
    try:
        iteration = step or tracker.latest_iteration(root)
    except ValueError as e:
        raise ConfigError(field, str(e)) from None
    folder = tracker.iteration_dir(root, iteration or 0)
    if iteration is None or not folder.is_dir():
        raise ConfigError(field_of_step if step else field, f"{root} has no checkpoint of iteration {iteration} ({folder} is missing)")
    saved = _saved_model(field, root, iteration)
    differing = [
        f"model.{name}={getattr(model, name)!r} but the checkpoint has {saved[name]!r}"
        for name in _shape_fields(model, saved)
        if name in saved and saved[name] != getattr(model, name)
    ]
    if differing:
        raise ConfigError(field, f"{folder} holds another model shape: {'; '.join(differing)}")
    _check_shards(field, folder)


def _shape_fields(model: ModelConfig, saved: dict[str, Any]) -> list[str]:
    fields = list(SHAPE_FIELDS)
    for feature, names in FEATURE_SHAPE_FIELDS.items():
        if getattr(model, feature) or saved.get(feature):
            fields += names
    return fields


def _checkpoint_module():
    """checkpointing/torch_dist.py, imported (with megatron) only when there is a checkpoint to read."""
    with warnings.catch_warnings():  # megatron's import notes are the workers' to print
        warnings.simplefilter("ignore")
        from megatron_ext.checkpointing import torch_dist as ckpt  # heavy: megatron, only when there is a checkpoint to read

    return ckpt


def _saved_model(field: str, root: str, iteration: int) -> dict[str, Any]:
    """The model section of the config that wrote the checkpoint ({} when it has none)."""
    try:
        common = _checkpoint_module().load_common(root, iteration)
    except Exception as e:  # a missing or damaged common.pt, whatever megatron raises for it
        raise ConfigError(field, f"{tracker.iteration_dir(root, iteration)} is not a readable checkpoint ({_one_line(e)})") from None
    if common.get("config") is None and common.get("args") is not None:  # Megatron-LM's: what its args say
        return model_fields(common["args"])
    model = (common.get("config") or {}).get("model") or {}
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    return {k: v for k, v in model.items() if k in known}


def _check_shards(field: str, folder: Path) -> None:
    """Every file the checkpoint's metadata stores items in exists and reaches the end of its
    last item (a copy cut short, a lost shard). Checkpoints of other formats than torch_dist
    have no such metadata: their readers find damage."""
    if _sharded_backend(folder) != "torch_dist":
        return
    try:
        needed = checkpoint_files(folder)
    except UncheckedTorch as e:
        print(f"warning: {field}: the sizes of {folder}'s shards are not checked: {e}", file=sys.stderr)
        return
    except Exception as e:  # a missing or damaged .metadata, whatever unpickling raises for it
        raise ConfigError(field, f"{folder} is not a readable checkpoint ({_one_line(e)})") from None
    for name, size in sorted(needed.items()):
        path = folder / name
        if not path.is_file():
            raise ConfigError(field, f"shard {path} is missing (the checkpoint's metadata needs {size} bytes there)")
        actual = path.stat().st_size
        if actual < size:
            raise ConfigError(field, f"shard {path} is cut short: {actual} bytes, the checkpoint's metadata needs {size}")


def _sharded_backend(folder: Path) -> Optional[str]:
    """The format of a megatron checkpoint's tensors, from its metadata.json (None: none)."""
    try:
        return json.loads((folder / "metadata.json").read_text()).get("sharded_backend")
    except (OSError, ValueError, AttributeError):
        return None


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def check_save(save: str) -> None:
    """`checkpoint.save` can be written: created if missing (as the first save would), then a
    file made and removed in it."""
    root = Path(save)
    if root.exists() and not root.is_dir():
        raise ConfigError("checkpoint.save", f"{root} is not a directory")
    try:
        tracker.latest_iteration(root)
    except ValueError as e:
        raise ConfigError("checkpoint.save", str(e)) from None
    probe = root / f".write_test.{socket.gethostname()}.{os.getpid()}"  # every rank of srun probes
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe.touch()
        probe.unlink()
    except OSError as e:
        raise ConfigError("checkpoint.save", f"{root} is not writable ({e.strerror or e})") from None
