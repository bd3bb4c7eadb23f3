"""Pretrained models in and out of megatron: GGUF (llama) and Hugging Face safetensors (Llama,
Mistral, Qwen2/3, Mixtral, Qwen3-MoE).

- `families`: the transformers families megatron's GPT model space holds, and which one a
  ModelConfig is written back as.
- `hf_config`, `rope`: config.json <-> ModelConfig (RoPE settings read as transformers reads them).
- `llama`: Hugging Face tensor names and layouts <-> megatron's logical tensors (pure).
- `gguf`, `hf`: read a file into a checked `Pretrained` (config + lazily read tensors).
- `load`: logical tensors into a model of any TP/PP layout, and back out of a TP1/PP1 model.
- `checkpoint`: files <-> megatron dist checkpoints (what scripts/convert_checkpoint.py runs).
"""

from megatron_ext.models.convert.source import Pretrained, open_pretrained

__all__ = ["Pretrained", "open_pretrained"]
