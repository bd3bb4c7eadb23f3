"""Pretrained models in and out of megatron: GGUF (llama) and Hugging Face safetensors (Llama,
Mistral, Qwen2/3, Mixtral, Qwen3-MoE).

- `families`: the transformers families megatron's GPT model space holds, and which one a
  ModelConfig is written back as.
- `hf_config`, `rope`: config.json <-> ModelConfig (RoPE settings read as transformers reads them).
- `llama`: Hugging Face tensor names and layouts <-> megatron's logical tensors (pure).
- `pretrained_model`: `Pretrained`, a checked model as read from a file (config + lazily read
  tensors).
- `gguf`, `hf`: read a file into a `Pretrained`; `source.open_pretrained` picks the reader by the
  file's form.
- `load`: logical tensors into a model of any TP/PP layout, and back out of a TP1/PP1 model.
- `checkpoint`: files <-> megatron dist checkpoints (what scripts/convert_checkpoint.py runs).
"""
