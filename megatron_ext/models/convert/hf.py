"""Hugging Face model folders: read (config.json + *.safetensors) and write (atomically).

Reading takes every tensor's shape from the safetensors headers and checks the whole model
against config.json before any weight is read. Writing builds the folder under a temporary name
next to the destination and renames it into place, so a crash never leaves a half-written model
where a reader would find it.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Mapping, Optional

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from megatron_ext.models.convert import llama
from megatron_ext.models.convert.hf_config import model_config_from_hf
from megatron_ext.models.convert.pretrained_model import LazyTensors, Pretrained

# Files of a Hugging Face tokenizer that travel with a converted model.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "added_tokens.json",
)
TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")
# Buffers some older checkpoints store; RoPE recomputes them.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def read_hf(folder: str, max_seq_length: int = 2048) -> Pretrained:
    """Open and check a Hugging Face folder of one of the families in `families.py`; tensors are
    read when looked up."""
    folder = str(folder)
    with open(os.path.join(folder, "config.json")) as f:
        hf_config = json.load(f)
    try:
        cfg = model_config_from_hf(hf_config, max_seq_length, name=Path(folder).name)
    except ValueError as e:
        raise ValueError(f"{folder}: {e}") from None
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise ValueError(f"{folder}: no *.safetensors files")
    shapes, file_of = {}, {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if not name.endswith(_IGNORED_SUFFIXES):
                    shapes[name] = tuple(f.get_slice(name).get_shape())
                    file_of[name] = str(path)
    llama.check_hf_shapes(shapes, cfg, folder)

    def read(name: str) -> torch.Tensor:
        with safe_open(file_of[name], framework="pt") as f:
            return f.get_tensor(name)

    token_ids = {k: hf_config[k] for k in TOKEN_ID_KEYS if hf_config.get(k) is not None}
    return Pretrained(cfg, LazyTensors(shapes, read, folder), folder, token_ids)


def copy_tokenizer_files(source: str | os.PathLike, destination: str | os.PathLike) -> list[str]:
    """Copy the Hugging Face tokenizer files `source` has; returns their names."""
    copied = []
    for name in TOKENIZER_FILES:
        if Path(source, name).is_file():
            shutil.copy2(Path(source, name), Path(destination, name))
            copied.append(name)
    return copied


def check_free(destination: Path) -> None:
    """A destination must not exist yet, or be an empty folder: nothing is ever overwritten."""
    if destination.exists() and (not destination.is_dir() or any(destination.iterdir())):
        raise FileExistsError(f"{destination} already exists and is not empty")


def staging_dir(destination: Path) -> Path:
    """An empty folder beside a free `destination` (same file system, so the final rename is
    atomic)."""
    check_free(destination)
    destination.parent.mkdir(parents=True, exist_ok=True)
    staging = destination.parent / f".{destination.name}.{os.getpid()}.tmp"
    shutil.rmtree(staging, ignore_errors=True)  # left by a crashed run of this process id
    staging.mkdir()
    return staging


def publish(staging: Path, destination: Path) -> None:
    """Rename the finished `staging` folder to `destination` (replacing an empty folder)."""
    os.replace(staging, destination)


def write_hf(
    out: str | os.PathLike,
    tensors: Mapping[str, torch.Tensor],
    config: Mapping,
    tokenizer_dir: Optional[str | os.PathLike] = None,
) -> Path:
    """A Hugging Face model folder: model.safetensors, config.json and the tokenizer files found in
    `tokenizer_dir`. Written atomically; returns the folder."""
    out = Path(out)
    staging = staging_dir(out)
    try:
        save_file(dict(tensors), str(staging / "model.safetensors"), metadata={"format": "pt"})
        (staging / "config.json").write_text(json.dumps(dict(config), indent=2) + "\n")
        if tokenizer_dir is not None:
            copy_tokenizer_files(tokenizer_dir, staging)
        publish(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out
