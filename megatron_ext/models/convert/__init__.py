"""Pretrained LLaMA models in and out of megatron: GGUF and Hugging Face safetensors.

- `llama`: Hugging Face tensor names and layouts <-> megatron's logical tensors (pure).
- `gguf`, `hf`: read a file into a checked `Pretrained` (config + lazily read tensors).
- `load`: logical tensors into a model of any TP/PP layout, and back out of a TP1/PP1 model.
- `checkpoint`: files <-> megatron dist checkpoints (what scripts/convert_checkpoint.py runs).
"""

from megatron_ext.models.convert.source import Pretrained, open_pretrained

__all__ = ["Pretrained", "open_pretrained"]
