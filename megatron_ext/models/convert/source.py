"""Where a pretrained model comes from: a GGUF file or a Hugging Face folder, told apart by
their form and read by `gguf.py` / `hf.py` into a checked `Pretrained`."""

from __future__ import annotations

from pathlib import Path

from megatron_ext.models.convert.gguf import read_gguf
from megatron_ext.models.convert.hf import read_hf
from megatron_ext.models.convert.pretrained_model import Pretrained


def open_pretrained(path: str, max_seq_length: int = 2048) -> Pretrained:
    """A `.gguf` file or a Hugging Face folder (config.json + *.safetensors)."""
    if str(path).endswith(".gguf"):
        return read_gguf(path, max_seq_length)
    if Path(path, "config.json").is_file():
        return read_hf(path, max_seq_length)
    raise ValueError(f"{path} is neither a .gguf file nor a Hugging Face folder with a config.json")
