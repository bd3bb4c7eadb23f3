"""GGUF (llama.cpp) LLaMA files -> a `Pretrained` model: config, names, dequantized weights.

Three things differ from a Hugging Face checkpoint:
- names: `blk.3.attn_q.weight` is `model.layers.3.self_attn.q_proj.weight`;
- shapes: GGUF lists dimensions fastest-first (ggml's `ne`), the reverse of numpy/torch order;
- RoPE: llama.cpp's converter reorders the rows of every Q and K head so that the two halves
  rotated together sit side by side (its "interleaved" RoPE). Megatron (rotary_interleaved=False)
  and Hugging Face rotate the first half of a head with the second half, so the order is undone.
Quantized tensors are dequantized to fp32 with the `gguf` package's own reference code.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from megatron_ext.config.schema import ModelConfig
from megatron_ext.models.convert import llama
from megatron_ext.models.convert.pretrained_model import LazyTensors, Pretrained

T = GGMLQuantizationType
SUPPORTED_TYPES = (T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1)

_GLOBAL_NAMES = {
    "token_embd.weight": llama.HF_EMBEDDING,
    "output_norm.weight": llama.HF_FINAL_NORM,
    "output.weight": llama.HF_OUTPUT,
}
_LAYER_NAMES = {
    "attn_q": llama.HF_Q,
    "attn_k": llama.HF_K,
    "attn_v": llama.HF_V,
    "attn_output": llama.HF_O,
    "ffn_gate": llama.HF_GATE,
    "ffn_up": llama.HF_UP,
    "ffn_down": llama.HF_DOWN,
    "attn_norm": llama.HF_ATTN_NORM,
    "ffn_norm": llama.HF_MLP_NORM,
}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.weight")
# The same tables read the other way.
_GLOBAL_GGUF_NAMES = {hf: name for name, hf in _GLOBAL_NAMES.items()}
_LAYER_GGUF_PARTS = {hf.split("{i}.")[1]: part for part, hf in _LAYER_NAMES.items()}
_HF_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.(.+)")


def hf_name(gguf_name: str) -> str:
    """The Hugging Face name of a GGUF tensor; ValueError for tensors a LLaMA does not have."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_NAME.fullmatch(gguf_name)
    if match and match.group(2) in _LAYER_NAMES:
        return _LAYER_NAMES[match.group(2)].format(i=int(match.group(1)))
    raise ValueError(f"tensor {gguf_name} is not a tensor of a LLaMA model")


def gguf_name(hf: str) -> str:
    """The inverse of `hf_name` (for messages that name what the GGUF file should contain)."""
    if hf in _GLOBAL_GGUF_NAMES:
        return _GLOBAL_GGUF_NAMES[hf]
    match = _HF_LAYER_NAME.fullmatch(hf)
    if match and match.group(2) in _LAYER_GGUF_PARTS:
        return f"blk.{match.group(1)}.{_LAYER_GGUF_PARTS[match.group(2)]}.weight"
    return hf


def unpermute_rope_rows(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row order: within each head, GGUF row 2*j + s is Hugging Face row
    s * head_dim/2 + j (s = 0 for the first rotated half, 1 for the second)."""
    rows, columns = weight.shape
    half = rows // heads // 2
    return weight.reshape(heads, half, 2, columns).transpose(1, 2).reshape(rows, columns)


def _field(reader: GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def model_config(reader: GGUFReader, path: str, max_seq_length: int = 2048) -> ModelConfig:
    """The ModelConfig a llama GGUF's metadata describes."""
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"{path}: architecture {arch!r} is not supported (only 'llama')")

    def meta(key: str, default: Any = None) -> Any:
        value = _field(reader, f"llama.{key}", default)
        if value is None:
            raise ValueError(f"{path}: metadata llama.{key} is missing")
        return value

    heads, hidden = int(meta("attention.head_count")), int(meta("embedding_length"))
    if int(meta("rope.dimension_count", hidden // heads)) != hidden // heads:
        raise ValueError(f"{path}: RoPE on part of each head (llama.rope.dimension_count) is not supported")
    if _field(reader, "llama.rope.scaling.type", "none") != "none":
        raise ValueError(f"{path}: RoPE scaling (llama.rope.scaling.type) is not supported")
    names = {t.name for t in reader.tensors}
    return ModelConfig(
        name=str(_field(reader, "general.basename") or _field(reader, "general.name") or "llama"),
        num_layers=int(meta("block_count")),
        hidden_size=hidden,
        ffn_hidden_size=int(meta("feed_forward_length")),
        num_attention_heads=heads,
        num_query_groups=int(meta("attention.head_count_kv", heads)),
        seq_length=min(int(meta("context_length", max_seq_length)), max_seq_length),
        max_position_embeddings=int(meta("context_length", max_seq_length)),
        vocab_size=_vocab_size(reader, path),
        tie_embeddings="output.weight" not in names,
        rotary_base=_decimal(meta("rope.freq_base", 10000.0)),
        norm_epsilon=_decimal(meta("attention.layer_norm_rms_epsilon")),
    )


def _decimal(value: float) -> float:
    """GGUF stores these as float32: 1e-5 reads back as 9.99999974e-06. The shortest decimal
    that rounds to the same float32 is the number the model's authors wrote."""
    return float(str(np.float32(value)))


def _vocab_size(reader: GGUFReader, path: str) -> int:
    if "llama.vocab_size" in reader.fields:
        return int(_field(reader, "llama.vocab_size"))
    if "tokenizer.ggml.tokens" in reader.fields:
        return len(reader.fields["tokenizer.ggml.tokens"].data)
    for t in reader.tensors:
        if t.name == "token_embd.weight":
            return int(t.shape[-1])
    raise ValueError(f"{path}: no vocabulary size (llama.vocab_size, tokenizer.ggml.tokens or token_embd.weight)")


def _torch_shape(tensor) -> tuple[int, ...]:
    # GGUF lists dimensions fastest-first.
    return tuple(int(n) for n in reversed(tensor.shape))


def read_gguf(path: str, max_seq_length: int = 2048) -> Pretrained:
    """Open and check a llama GGUF; weights are dequantized when looked up. Every problem (other
    architecture, unsupported quantization, missing or misshapen tensor) is raised here."""
    path = str(path)
    reader = GGUFReader(path)
    cfg = model_config(reader, path, max_seq_length)
    by_hf = {}
    for t in reader.tensors:
        try:
            by_hf[hf_name(t.name)] = t
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
        if t.tensor_type not in SUPPORTED_TYPES:
            supported = ", ".join(s.name for s in SUPPORTED_TYPES)
            raise ValueError(f"{path}: tensor {t.name} has type {t.tensor_type.name}; supported: {supported}")
    shapes = {name: _torch_shape(t) for name, t in by_hf.items()}
    llama.check_hf_shapes(shapes, cfg, path, label=lambda name: f"{gguf_name(name)} ({name})")
    # Rows of Q and K heads come in llama.cpp's RoPE order.
    rope_heads = {}
    for i in range(cfg.num_layers):
        rope_heads[llama.HF_Q.format(i=i)] = cfg.num_attention_heads
        rope_heads[llama.HF_K.format(i=i)] = llama.query_groups(cfg)

    def read(name: str) -> torch.Tensor:
        t = by_hf[name]
        values = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32)
        weight = torch.from_numpy(values.reshape(_torch_shape(t)))
        return unpermute_rope_rows(weight, rope_heads[name]) if name in rope_heads else weight

    return Pretrained(cfg, LazyTensors(shapes, read, path), path, _token_ids(reader))


def _token_ids(reader: GGUFReader) -> dict:
    ids = {
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id"),
    }
    return {k: int(v) for k, v in ids.items() if v is not None}
