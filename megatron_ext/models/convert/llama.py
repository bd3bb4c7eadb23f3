"""Hugging Face LLaMA tensors <-> megatron's logical tensors: names, fusion and vocab padding.

Pure functions of tensors and a `ModelConfig`; nothing here knows about processes or layouts.
Megatron's logical tensors are the whole (unsharded) tensors its `sharded_state_dict()` describes
(see `models/logical.py`): the fused QKV and the SwiGLU fc1 in megatron's row order, the word
embedding and output layer padded to the padded vocabulary. Placing them into a TP/PP layout is
`load.py`'s job, through megatron's own metadata.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Mapping, Optional

import torch

from megatron_ext.config.schema import ModelConfig
from megatron_ext.models.logical import LogicalName

EMBEDDING = "embedding.word_embeddings.weight"
OUTPUT = "output_layer.weight"
FINAL_NORM = "decoder.final_layernorm.weight"
QKV = "decoder.layers.self_attention.linear_qkv.weight"
ATTN_NORM = "decoder.layers.self_attention.linear_qkv.layer_norm_weight"
PROJ = "decoder.layers.self_attention.linear_proj.weight"
MLP_NORM = "decoder.layers.mlp.linear_fc1.layer_norm_weight"
FC1 = "decoder.layers.mlp.linear_fc1.weight"
FC2 = "decoder.layers.mlp.linear_fc2.weight"

HF_EMBEDDING = "model.embed_tokens.weight"
HF_OUTPUT = "lm_head.weight"
HF_FINAL_NORM = "model.norm.weight"
# Per-layer Hugging Face names; {i} is the layer.
HF_Q, HF_K, HF_V, HF_O = (f"model.layers.{{i}}.self_attn.{p}_proj.weight" for p in "qkvo")
HF_GATE, HF_UP, HF_DOWN = (f"model.layers.{{i}}.mlp.{p}_proj.weight" for p in ("gate", "up", "down"))
HF_ATTN_NORM = "model.layers.{i}.input_layernorm.weight"
HF_MLP_NORM = "model.layers.{i}.post_attention_layernorm.weight"

# Per-layer tensors that are one Hugging Face tensor as is.
_LAYER_COPIES = {ATTN_NORM: HF_ATTN_NORM, PROJ: HF_O, MLP_NORM: HF_MLP_NORM, FC2: HF_DOWN}


def head_dim(cfg: ModelConfig) -> int:
    return cfg.head_dim or cfg.hidden_size // cfg.num_attention_heads


def query_groups(cfg: ModelConfig) -> int:
    return cfg.num_query_groups or cfg.num_attention_heads


# --- fused QKV ------------------------------------------------------------------------------


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Megatron's linear_qkv rows: per KV group g, [the query heads of g; k_g; v_g]
    (the order `SelfAttention.get_query_key_value_tensors` splits its output in)."""
    groups, d = query_groups(cfg), head_dim(cfg)
    columns = q.shape[-1]
    parts = [q.reshape(groups, -1, columns), k.reshape(groups, d, columns), v.reshape(groups, d, columns)]
    return torch.cat(parts, dim=1).reshape(-1, columns)


def split_qkv(qkv: torch.Tensor, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of `fuse_qkv`: (q, k, v) in Hugging Face's row order."""
    groups, d = query_groups(cfg), head_dim(cfg)
    q_rows = cfg.num_attention_heads // groups * d
    columns = qkv.shape[-1]
    q, k, v = qkv.reshape(groups, q_rows + 2 * d, columns).split([q_rows, d, d], dim=1)
    return q.reshape(-1, columns), k.reshape(-1, columns), v.reshape(-1, columns)


# --- vocabulary padding ---------------------------------------------------------------------


def pad_vocab(weight: torch.Tensor, padded_vocab: int) -> torch.Tensor:
    """Zero rows for the padding tokens megatron adds so each TP rank holds an equal slice."""
    missing = padded_vocab - weight.shape[0]
    if missing < 0:
        raise ValueError(f"vocabulary of {weight.shape[0]} rows exceeds the padded size {padded_vocab}")
    return torch.cat([weight, weight.new_zeros(missing, weight.shape[1])]) if missing else weight


# --- Hugging Face -> logical ----------------------------------------------------------------


def hf_to_logical(
    name: LogicalName, hf: Mapping[str, torch.Tensor], cfg: ModelConfig, padded_vocab: int
) -> torch.Tensor:
    """The logical tensor `name`, computed from Hugging Face tensors `hf` (read lazily: only the
    tensors this one needs are looked up)."""
    if name.key == EMBEDDING:
        return pad_vocab(hf[HF_EMBEDDING], padded_vocab)
    if name.key == OUTPUT:
        return pad_vocab(hf[HF_EMBEDDING if cfg.tie_embeddings else HF_OUTPUT], padded_vocab)
    if name.key == FINAL_NORM:
        return hf[HF_FINAL_NORM]
    if name.layer is None:
        raise KeyError(f"megatron tensor {name.key} has no Hugging Face LLaMA counterpart")
    i = name.layer
    if name.key in _LAYER_COPIES:
        return hf[_LAYER_COPIES[name.key].format(i=i)]
    if name.key == QKV:
        return fuse_qkv(hf[HF_Q.format(i=i)], hf[HF_K.format(i=i)], hf[HF_V.format(i=i)], cfg)
    if name.key == FC1:
        # SwiGLU: megatron applies the activation to the first half of fc1's output.
        return torch.cat([hf[HF_GATE.format(i=i)], hf[HF_UP.format(i=i)]])
    raise KeyError(f"megatron tensor {name.key} (layer {i}) has no Hugging Face LLaMA counterpart")


def logical_names(cfg: ModelConfig) -> list[LogicalName]:
    """Every logical tensor of a LLaMA GPTModel of this config (a tied output layer is the
    word embedding itself)."""
    names = [LogicalName(EMBEDDING), LogicalName(FINAL_NORM)]
    if not cfg.tie_embeddings:
        names.append(LogicalName(OUTPUT))
    per_layer = (ATTN_NORM, QKV, PROJ, MLP_NORM, FC1, FC2)
    return names + [LogicalName(key, (i,)) for i in range(cfg.num_layers) for key in per_layer]


class HFAsLogical(Mapping[LogicalName, torch.Tensor]):
    """Hugging Face tensors seen as megatron's logical tensors, each computed when looked up."""

    def __init__(self, hf: Mapping[str, torch.Tensor], cfg: ModelConfig, padded_vocab: int) -> None:
        self._hf, self._cfg, self._padded_vocab = hf, cfg, padded_vocab
        self._names = logical_names(cfg)

    def __getitem__(self, name: LogicalName) -> torch.Tensor:
        if name not in self._names:
            raise KeyError(name)
        return hf_to_logical(name, self._hf, self._cfg, self._padded_vocab)

    def __iter__(self) -> Iterator[LogicalName]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


# --- logical -> Hugging Face ----------------------------------------------------------------


def logical_to_hf(
    tensors: Mapping[LogicalName, torch.Tensor], cfg: ModelConfig, vocab_size: int
) -> dict[str, torch.Tensor]:
    """Hugging Face LLaMA tensors of a whole model; vocab padding rows are dropped."""
    hf = {
        HF_EMBEDDING: tensors[LogicalName(EMBEDDING)][:vocab_size],
        HF_FINAL_NORM: tensors[LogicalName(FINAL_NORM)],
    }
    if not cfg.tie_embeddings:
        hf[HF_OUTPUT] = tensors[LogicalName(OUTPUT)][:vocab_size]
    for i in range(cfg.num_layers):
        for key, hf_name in _LAYER_COPIES.items():
            hf[hf_name.format(i=i)] = tensors[LogicalName(key, (i,))]
        q, k, v = split_qkv(tensors[LogicalName(QKV, (i,))], cfg)
        gate, up = tensors[LogicalName(FC1, (i,))].chunk(2)
        hf.update(
            {
                HF_Q.format(i=i): q,
                HF_K.format(i=i): k,
                HF_V.format(i=i): v,
                HF_GATE.format(i=i): gate,
                HF_UP.format(i=i): up,
            }
        )
    # safetensors refuses views that share storage; every tensor gets its own.
    return {name: t.contiguous().clone() for name, t in hf.items()}


def expected_hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every Hugging Face tensor a LLaMA of this config has, with its shape."""
    h, d, vocab = cfg.hidden_size, head_dim(cfg), cfg.vocab_size
    kv = query_groups(cfg) * d
    shapes = {HF_EMBEDDING: (vocab, h), HF_FINAL_NORM: (h,)}
    if not cfg.tie_embeddings:
        shapes[HF_OUTPUT] = (vocab, h)
    per_layer = {
        HF_Q: (cfg.num_attention_heads * d, h),
        HF_K: (kv, h),
        HF_V: (kv, h),
        HF_O: (h, cfg.num_attention_heads * d),
        HF_GATE: (cfg.ffn_hidden_size, h),
        HF_UP: (cfg.ffn_hidden_size, h),
        HF_DOWN: (h, cfg.ffn_hidden_size),
        HF_ATTN_NORM: (h,),
        HF_MLP_NORM: (h,),
    }
    for i in range(cfg.num_layers):
        shapes.update({name.format(i=i): shape for name, shape in per_layer.items()})
    return shapes


def check_hf_shapes(
    shapes: Mapping[str, tuple[int, ...]],
    cfg: ModelConfig,
    where: str,
    label: Callable[[str], str] = str,
) -> None:
    """Raise, naming the tensor (as `label` spells a Hugging Face name) and `where`, unless
    `shapes` are exactly this config's tensors (a tied model may still carry an `lm_head` copy;
    it is ignored)."""
    expected = expected_hf_shapes(cfg)
    missing = [name for name in expected if name not in shapes]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ValueError(f"{where}: missing tensor {label(missing[0])}{more}")
    for name, shape in expected.items():
        if tuple(shapes[name]) != shape:
            raise ValueError(f"{where}: tensor {label(name)} has shape {tuple(shapes[name])}, expected {shape}")
    unknown = sorted(set(shapes) - set(expected) - {HF_OUTPUT})
    if unknown:
        raise ValueError(f"{where}: tensor {label(unknown[0])} is not part of a LLaMA model of this config")


# --- configs ----------------------------------------------------------------------------------


def _require(hf_config: Mapping[str, Any], key: str, allowed: Callable[[Any], bool], default: Any) -> None:
    value = hf_config.get(key, default)
    if not allowed(value):
        raise ValueError(f"config.json: {key}={value!r} is not supported (LLaMA-style models only)")


def rope_theta(hf_config: Mapping[str, Any]) -> float:
    """transformers 5 nests RoPE settings in `rope_parameters`; older configs keep `rope_theta`
    (and `rope_scaling`) at the top level."""
    rope = hf_config.get("rope_parameters") or {}
    scaling = hf_config.get("rope_scaling") or rope
    if scaling.get("rope_type", scaling.get("type", "default")) != "default":
        raise ValueError(f"config.json: RoPE scaling {scaling} is not supported (plain RoPE only)")
    return float(rope.get("rope_theta", hf_config.get("rope_theta", 10000.0)))


def model_config_from_hf(
    hf_config: Mapping[str, Any], max_seq_length: int = 2048, name: Optional[str] = None
) -> ModelConfig:
    """The ModelConfig of a Hugging Face LlamaForCausalLM `config.json`. The sequence length is
    the model's context capped at `max_seq_length` (RoPE needs no learned positions, so a shorter
    training length loses nothing)."""
    _require(hf_config, "model_type", lambda v: v == "llama", None)
    _require(hf_config, "hidden_act", lambda v: v == "silu", "silu")
    _require(hf_config, "attention_bias", lambda v: not v, False)
    _require(hf_config, "mlp_bias", lambda v: not v, False)
    hidden, heads = hf_config["hidden_size"], hf_config["num_attention_heads"]
    return ModelConfig(
        name=name or hf_config.get("_name_or_path") or "llama",
        num_layers=hf_config["num_hidden_layers"],
        hidden_size=hidden,
        ffn_hidden_size=hf_config["intermediate_size"],
        num_attention_heads=heads,
        num_query_groups=hf_config.get("num_key_value_heads") or heads,
        seq_length=min(hf_config.get("max_position_embeddings", max_seq_length), max_seq_length),
        vocab_size=hf_config["vocab_size"],
        tie_embeddings=bool(hf_config.get("tie_word_embeddings", False)),
        rotary_base=rope_theta(hf_config),
        norm_epsilon=float(hf_config.get("rms_norm_eps", 1e-6)),
        head_dim=hf_config["head_dim"] if hf_config.get("head_dim") not in (None, hidden // heads) else None,
    )


def hf_config_from_model(cfg: ModelConfig, vocab_size: int, extra: Optional[Mapping[str, Any]] = None) -> dict:
    """A LlamaForCausalLM `config.json` for this model (fp32 weights); `extra` adds e.g. token ids."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.ffn_hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": query_groups(cfg),
        "head_dim": head_dim(cfg),
        "vocab_size": vocab_size,
        "max_position_embeddings": cfg.seq_length,
        "rms_norm_eps": cfg.norm_epsilon,
        # Both spellings: transformers >= 5 reads rope_parameters, older versions rope_theta.
        "rope_theta": cfg.rotary_base,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rotary_base},
        "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "dtype": "float32",
        "torch_dtype": "float32",
        **(extra or {}),
    }
