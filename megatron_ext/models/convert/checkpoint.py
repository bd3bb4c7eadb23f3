"""Pretrained model files <-> megatron dist checkpoints (torch_dist, any layout).

    import_checkpoint("SmolLM2.gguf" or "hf_folder/", "ckpt/", tp=2, pp=2)
    export_checkpoint("ckpt/", "hf_out/")

Import starts tp*pp local workers; each builds its stage of megatron's GPTModel, loads its part
of the weights and joins one `dist_checkpointing.save`. The checkpoint is model-only (no
optimizer state) at iteration 0: training starts from it through `model.pretrained`, which loads
the weights and nothing else (no optimizer, scheduler, counters or RNG), in any layout.

Export loads a checkpoint of any layout (dist_checkpointing reshards) into a TP1/PP1 model in
this process and writes a Hugging Face folder of the model's transformers family
(`families.family_of`).

Both write atomically: the result is assembled under a temporary name beside the destination and
renamed into place, and every input problem is raised before anything is written.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any, Optional

import torch.distributed as dist

from megatron_ext.checkpointing.megatron_lm import content_metadata, saved_model_config, to_saved
from megatron_ext.config.mlm_namespace import RunFacts, megatron_lm_args
from megatron_ext.config.schema import Config, LauncherConfig, ModelConfig, ParallelConfig
from megatron_ext.config.validate import validate
from megatron_ext.data.gguf_tokenizer import GGUFTokenizer
from megatron_ext.data.tokenizers import build_tokenizer, stop_token_ids
from megatron_ext.models.convert.hf import check_free, copy_tokenizer_files, publish, staging_dir, write_hf
from megatron_ext.models.convert.hf_config import hf_config_from_model
from megatron_ext.models.convert.llama import logical_to_hf
from megatron_ext.models.convert.load import gather_logical, load_pretrained
from megatron_ext.models.convert.source import open_pretrained
from megatron_ext.models.convert.world import build_model, model_parallel_world
from megatron_ext.models.gpt import padded_vocab_size
from megatron_ext.platform.launch import launch_local
from megatron_ext.checkpointing import torch_dist as ckpt

# Beside iter_*/: the Hugging Face tokenizer files of the imported model, for the export.
TOKENIZER_DIR = "tokenizer"


def common_state(model: ModelConfig, padded_vocab: int, tp: int, pp: int, token_ids: dict) -> dict[str, Any]:
    """The plain state of an imported checkpoint, shaped like the Trainer's."""
    return {
        "iteration": 0,
        "consumed_samples": 0,
        "padded_vocab_size": padded_vocab,
        "layout": {"tp": tp, "pp": pp, "vpp": None},
        "config": {"model": dataclasses.asdict(model)},
        "plugins": {},
        "token_ids": token_ids,
    }


def save_model_only(
    out: str | os.PathLike, chunks: list, model: ModelConfig, padded_vocab: int, tp: int = 1, pp: int = 1, token_ids: Optional[dict] = None
) -> None:
    """A model-only checkpoint of iteration 0 (no optimizer, no RNG) at `out`, its `args` those
    of a Megatron-LM run of `model` at TP=`tp` x PP=`pp` (collective over this world)."""
    cfg = Config(model=model, parallel=ParallelConfig(tp=tp, pp=pp, use_distributed_optimizer=False))
    world = dist.get_world_size()
    args = megatron_lm_args(
        cfg, RunFacts(world, world // (tp * pp), padded_vocab, cfg.train.global_batch_size or 1, 0, 0, fully_reshardable=False)
    )
    common = common_state(model, padded_vocab, tp, pp, token_ids or {})
    ckpt.save_checkpoint(out, 0, chunks, None, to_saved(common, args, 1), content_metadata(False, False), save_rng=False)


def _check_layout(model: ModelConfig, tp: int, pp: int) -> None:
    """The training config's own rules (heads, query groups, layers vs tp/pp)."""
    # A checkpoint holds no activations: sequence parallelism, which megatron's MoE layer needs
    # to train under TP, changes nothing in it.
    parallel = ParallelConfig(tp=tp, pp=pp, dp=1, sequence_parallel=tp > 1 and model.num_experts is not None)
    cfg = Config(model=model, parallel=parallel, launcher=LauncherConfig(nproc=tp * pp))
    validate(cfg, tp * pp)


def import_checkpoint(source: str, out: str, tp: int = 1, pp: int = 1, max_seq_length: int = 2048) -> Path:
    """Convert a `.gguf` file or a Hugging Face folder into a megatron checkpoint at `out`."""
    pretrained = open_pretrained(source, max_seq_length)  # every problem with the file is raised here
    _check_layout(pretrained.config, tp, pp)
    out_path = Path(out)
    staging = staging_dir(out_path)
    try:
        launch_local(tp * pp, save_imported, (source, str(staging), tp, pp, max_seq_length), "127.0.0.1", 0)
        _write_tokenizer(pretrained.path, staging / TOKENIZER_DIR)
        publish(staging, out_path)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out_path


def save_imported(source: str, out: str, tp: int, pp: int, max_seq_length: int = 2048) -> None:
    """One rank's part of an import, in a world of tp*pp ranks (joined here, or the one this
    process is in): build its stage, load its weights, join the collective save to `out`."""
    with model_parallel_world(tp, pp):
        pretrained = open_pretrained(source, max_seq_length)
        padded = padded_vocab_size(pretrained.config.vocab_size, pretrained.config, tp)
        chunks = build_model(pretrained.config, padded)
        load_pretrained(chunks, pretrained, padded)
        save_model_only(out, chunks, pretrained.config, padded, tp, pp, pretrained.token_ids)


def _write_tokenizer(source: str, folder: Path) -> None:
    """The Hugging Face tokenizer files of `source` (a Hugging Face folder, or a GGUF file whose
    vocabulary is rebuilt as one) into `folder`."""
    folder.mkdir()
    if Path(source).is_dir():
        copy_tokenizer_files(source, folder)
        return

    try:
        GGUFTokenizer(source).save_pretrained(str(folder))
    except ValueError as e:  # e.g. a sentencepiece vocabulary: the weights still convert
        warnings.warn(f"no tokenizer exported: {e}", stacklevel=2)


def _tokenizer_source(spec: Optional[str]) -> Optional[str]:
    """What `_write_tokenizer` reads for a training run's `data.tokenizer` (as its checkpoint
    records it): a GGUF file, or the folder of a tokenizer.json / .model; None for the
    tokenizers that have no files (byte, null:<V>, GPT-2's vocab and merges)."""
    path = Path(spec) if spec else None
    if path is None or not path.exists():
        return None
    if path.suffix == ".gguf" or path.is_dir():
        return str(path)
    return str(path.parent) if path.name in ("tokenizer.json", "tokenizer.model") or path.suffix == ".model" else None


def _run_token_ids(spec: Optional[str]) -> dict[str, Any]:
    """config.json's token ids for a training run's tokenizer: its bos, and the tokens the
    runtime's generation stops at (its eos and its end of document) as the eos ids."""
    if _tokenizer_source(spec) is None:
        return {}
    tokenizer = build_tokenizer(spec)
    stops = stop_token_ids(tokenizer)
    ids: dict[str, Any] = {"eos_token_id": stops[0] if len(stops) == 1 else list(stops)}
    if getattr(tokenizer, "bos", None) is not None:
        ids["bos_token_id"] = tokenizer.bos
    return ids


def export_checkpoint(load: str, out: str, iteration: Optional[int] = None) -> Path:
    """Write checkpoint `iteration` (default: the latest) of `load` as a Hugging Face folder."""
    iteration = ckpt.latest_iteration(load) if iteration is None else iteration
    if iteration is None or not ckpt.iteration_dir(load, iteration).is_dir():
        raise FileNotFoundError(f"{load}: no checkpoint" + (f" of iteration {iteration}" if iteration is not None else ""))
    common = ckpt.load_common(load, iteration)
    model = saved_model_config(common)
    padded = common["padded_vocab_size"]
    vocab = model.vocab_size or padded
    # Before the slow part: a model no transformers family has is refused here.
    config = hf_config_from_model(model, vocab, common.get("token_ids") or _run_token_ids(common.get("tokenizer")))
    check_free(Path(out))
    with model_parallel_world():
        chunks = build_model(model, padded)
        ckpt.load_checkpoint(load, iteration, chunks, None, load_rng=False)
        tensors = logical_to_hf(gather_logical(chunks), model, vocab)
    tokenizer = Path(load, TOKENIZER_DIR)
    if tokenizer.is_dir():  # an imported model's own files
        return write_hf(out, tensors, config, tokenizer)
    source = _tokenizer_source(common.get("tokenizer"))  # a training run's tokenizer
    if source is None:
        return write_hf(out, tensors, config, None)
    with tempfile.TemporaryDirectory() as scratch:
        _write_tokenizer(source, Path(scratch, TOKENIZER_DIR))
        return write_hf(out, tensors, config, Path(scratch, TOKENIZER_DIR))
