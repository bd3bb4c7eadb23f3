"""Hugging Face decoder tensors (Llama, Mistral, Qwen2/3, Mixtral, Qwen3-MoE) <-> megatron's
logical tensors: names, fusion and vocab padding.

Pure functions of tensors and a `ModelConfig`; nothing here knows about processes or layouts.
Megatron's logical tensors are the whole (unsharded) tensors its `sharded_state_dict()` describes
(see `models/logical.py`): the fused QKV (and its bias) and the SwiGLU fc1 in megatron's row
order, the word embedding and output layer padded to the padded vocabulary, one fc1/fc2 per
expert indexed (layer, expert). Placing them into a TP/PP layout is `load.py`'s job, through
megatron's own metadata. Which tensors a model has (biases, QK-norm, experts and their names)
follows from its ModelConfig (`families.family_of`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping

import torch

from megatron_ext.config.moe_pattern import moe_layer_pattern
from megatron_ext.config.schema import ModelConfig
from megatron_ext.models.convert.families import family_of
from megatron_ext.models.logical import LogicalName

EMBEDDING = "embedding.word_embeddings.weight"
OUTPUT = "output_layer.weight"
FINAL_NORM = "decoder.final_layernorm.weight"
QKV = "decoder.layers.self_attention.linear_qkv.weight"
QKV_BIAS = "decoder.layers.self_attention.linear_qkv.bias"
ATTN_NORM = "decoder.layers.self_attention.linear_qkv.layer_norm_weight"
Q_NORM = "decoder.layers.self_attention.q_layernorm.weight"
K_NORM = "decoder.layers.self_attention.k_layernorm.weight"
PROJ = "decoder.layers.self_attention.linear_proj.weight"
PROJ_BIAS = "decoder.layers.self_attention.linear_proj.bias"
MLP_NORM = "decoder.layers.mlp.linear_fc1.layer_norm_weight"
FC1 = "decoder.layers.mlp.linear_fc1.weight"
FC1_BIAS = "decoder.layers.mlp.linear_fc1.bias"
FC2 = "decoder.layers.mlp.linear_fc2.weight"
FC2_BIAS = "decoder.layers.mlp.linear_fc2.bias"
ROUTER = "decoder.layers.mlp.router.weight"
# Indexed (layer, expert).
EXPERT_FC1 = "decoder.layers.mlp.experts.experts.linear_fc1.weight"
EXPERT_FC2 = "decoder.layers.mlp.experts.experts.linear_fc2.weight"

HF_EMBEDDING = "model.embed_tokens.weight"
HF_OUTPUT = "lm_head.weight"
HF_FINAL_NORM = "model.norm.weight"
# Per-layer Hugging Face names; {i} is the layer.
HF_Q, HF_K, HF_V, HF_O = (f"model.layers.{{i}}.self_attn.{p}_proj.weight" for p in "qkvo")
HF_GATE, HF_UP, HF_DOWN = (f"model.layers.{{i}}.mlp.{p}_proj.weight" for p in ("gate", "up", "down"))
HF_ATTN_NORM = "model.layers.{i}.input_layernorm.weight"
HF_MLP_NORM = "model.layers.{i}.post_attention_layernorm.weight"
HF_Q_NORM = "model.layers.{i}.self_attn.q_norm.weight"
HF_K_NORM = "model.layers.{i}.self_attn.k_norm.weight"


def bias(weight_name: str) -> str:
    return weight_name.replace(".weight", ".bias")


def head_dim(cfg: ModelConfig) -> int:
    return cfg.head_dim or cfg.hidden_size // cfg.num_attention_heads


def query_groups(cfg: ModelConfig) -> int:
    return cfg.num_query_groups or cfg.num_attention_heads


def moe_layers(cfg: ModelConfig) -> list[bool]:
    """Which layers have experts (megatron's moe_layer_freq)."""
    if cfg.num_experts is None:
        return [False] * cfg.num_layers
    return [bool(moe) for moe in moe_layer_pattern(cfg)]


# --- fused QKV ------------------------------------------------------------------------------


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Megatron's linear_qkv rows (of a weight or a bias): per KV group g, [the query heads of g;
    k_g; v_g] (the order `SelfAttention.get_query_key_value_tensors` splits its output in)."""
    groups, d = query_groups(cfg), head_dim(cfg)
    rest = q.shape[1:]
    parts = [q.reshape(groups, -1, *rest), k.reshape(groups, d, *rest), v.reshape(groups, d, *rest)]
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def split_qkv(qkv: torch.Tensor, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of `fuse_qkv`: (q, k, v) in Hugging Face's row order."""
    groups, d = query_groups(cfg), head_dim(cfg)
    q_rows = cfg.num_attention_heads // groups * d
    rest = qkv.shape[1:]
    q, k, v = qkv.reshape(groups, q_rows + 2 * d, *rest).split([q_rows, d, d], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


# --- vocabulary padding ---------------------------------------------------------------------


def pad_vocab(weight: torch.Tensor, padded_vocab: int) -> torch.Tensor:
    """Zero rows for the padding tokens megatron adds so each TP rank holds an equal slice."""
    missing = padded_vocab - weight.shape[0]
    if missing < 0:
        raise ValueError(f"vocabulary of {weight.shape[0]} rows exceeds the padded size {padded_vocab}")
    return torch.cat([weight, weight.new_zeros(missing, weight.shape[1])]) if missing else weight


# --- which tensor is made of which ----------------------------------------------------------


@dataclass(frozen=True)
class Rule:
    """One logical tensor and the Hugging Face tensors it is made of: `copy` (one tensor as is),
    `qkv` (q, k, v fused per KV group), `gated` (SwiGLU's gate and up stacked, gate first: megatron
    applies the activation to the first half) or `vocab` (padded rows)."""

    name: LogicalName
    kind: str
    hf: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]


def _layer_rules(cfg: ModelConfig, i: int, moe: bool) -> list[Rule]:
    h, d, heads = cfg.hidden_size, head_dim(cfg), cfg.num_attention_heads
    kv = query_groups(cfg) * d
    layer = (i,)

    def rule(key: str, kind: str, *pairs: tuple[str, tuple[int, ...]], index: tuple[int, ...] = layer) -> Rule:
        names = tuple(name.format(i=i, e=index[-1]) for name, _ in pairs)
        return Rule(LogicalName(key, index), kind, names, tuple(shape for _, shape in pairs))

    rules = [
        rule(ATTN_NORM, "copy", (HF_ATTN_NORM, (h,))),
        rule(QKV, "qkv", (HF_Q, (heads * d, h)), (HF_K, (kv, h)), (HF_V, (kv, h))),
        rule(PROJ, "copy", (HF_O, (h, heads * d))),
        rule(MLP_NORM, "copy", (HF_MLP_NORM, (h,))),
    ]
    if cfg.add_bias_linear or cfg.add_qkv_bias:
        rules.append(rule(QKV_BIAS, "qkv", (bias(HF_Q), (heads * d,)), (bias(HF_K), (kv,)), (bias(HF_V), (kv,))))
    if cfg.add_bias_linear:
        rules.append(rule(PROJ_BIAS, "copy", (bias(HF_O), (h,))))
    if cfg.qk_layernorm:
        rules += [rule(Q_NORM, "copy", (HF_Q_NORM, (d,))), rule(K_NORM, "copy", (HF_K_NORM, (d,)))]
    if not moe:
        f = cfg.ffn_hidden_size
        rules += [rule(FC1, "gated", (HF_GATE, (f, h)), (HF_UP, (f, h))), rule(FC2, "copy", (HF_DOWN, (h, f)))]
        if cfg.add_bias_linear:
            rules += [rule(FC1_BIAS, "gated", (bias(HF_GATE), (f,)), (bias(HF_UP), (f,))), rule(FC2_BIAS, "copy", (bias(HF_DOWN), (h,)))]
        return rules
    names, f = family_of(cfg).experts, cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size
    rules.append(rule(ROUTER, "copy", (names.router, (cfg.num_experts, h))))
    for e in range(cfg.num_experts):
        rules += [
            rule(EXPERT_FC1, "gated", (names.gate, (f, h)), (names.up, (f, h)), index=(i, e)),
            rule(EXPERT_FC2, "copy", (names.down, (h, f)), index=(i, e)),
        ]
    return rules


def rules(cfg: ModelConfig) -> list[Rule]:
    """Every logical tensor of a model of this config with its Hugging Face tensors (a tied
    output layer is the word embedding itself). Raises for configs no transformers family has."""
    family_of(cfg)  # raises for a model no family has
    vocab, h = cfg.vocab_size, cfg.hidden_size
    found = [
        Rule(LogicalName(EMBEDDING), "vocab", (HF_EMBEDDING,), ((vocab, h),)),
        Rule(LogicalName(FINAL_NORM), "copy", (HF_FINAL_NORM,), ((h,),)),
    ]
    if not cfg.tie_embeddings:
        found.append(Rule(LogicalName(OUTPUT), "vocab", (HF_OUTPUT,), ((vocab, h),)))
    for i, moe in enumerate(moe_layers(cfg)):
        found += _layer_rules(cfg, i, moe)
    return found


_NUMBERED_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")


def canonical(name: LogicalName) -> LogicalName:
    """A block whose layers differ (dense and MoE mixed) names each layer's tensors with the
    layer number in the key (`decoder.layers.3.mlp.router.weight`) and no layer axis; a uniform
    block has `decoder.layers.mlp.router.weight` at index (3,). The rules use the second form."""
    numbered = _NUMBERED_LAYER.fullmatch(name.key)
    if numbered is None:
        return name
    return LogicalName(f"decoder.layers.{numbered[2]}", (int(numbered[1]), *name.index))


def logical_names(cfg: ModelConfig) -> list[LogicalName]:
    return [rule.name for rule in rules(cfg)]


# --- Hugging Face -> logical ----------------------------------------------------------------


def _combine(rule: Rule, parts: list[torch.Tensor], cfg: ModelConfig, padded_vocab: int) -> torch.Tensor:
    if rule.kind == "qkv":
        return fuse_qkv(*parts, cfg)
    if rule.kind == "gated":
        return torch.cat(parts)
    if rule.kind == "vocab":
        return pad_vocab(parts[0], padded_vocab)
    return parts[0]


def _split(rule: Rule, tensor: torch.Tensor, cfg: ModelConfig, vocab_size: int) -> tuple[torch.Tensor, ...]:
    if rule.kind == "qkv":
        return split_qkv(tensor, cfg)
    if rule.kind == "gated":
        return tuple(tensor.chunk(2))
    if rule.kind == "vocab":
        return (tensor[:vocab_size],)
    return (tensor,)


class HFAsLogical(Mapping[LogicalName, torch.Tensor]):
    """Hugging Face tensors seen as megatron's logical tensors, each computed when looked up
    (only the tensors that one needs are read)."""

    def __init__(self, hf: Mapping[str, torch.Tensor], cfg: ModelConfig, padded_vocab: int) -> None:
        self._hf, self._cfg, self._padded_vocab = hf, cfg, padded_vocab
        self._rules = {rule.name: rule for rule in rules(cfg)}

    def __getitem__(self, name: LogicalName) -> torch.Tensor:
        rule = self._rules[canonical(name)]
        return _combine(rule, [self._hf[n] for n in rule.hf], self._cfg, self._padded_vocab)

    def __iter__(self) -> Iterator[LogicalName]:
        return iter(self._rules)

    def __len__(self) -> int:
        return len(self._rules)


# --- logical -> Hugging Face ----------------------------------------------------------------


def logical_to_hf(
    tensors: Mapping[LogicalName, torch.Tensor], cfg: ModelConfig, vocab_size: int
) -> dict[str, torch.Tensor]:
    """Hugging Face tensors of a whole model; vocab padding rows are dropped."""
    tensors = {canonical(name): t for name, t in tensors.items()}
    hf = {}
    for rule in rules(cfg):
        hf.update(zip(rule.hf, _split(rule, tensors[rule.name], cfg, vocab_size)))
    # safetensors refuses views that share storage; every tensor gets its own.
    return {name: t.contiguous().clone() for name, t in hf.items()}


def expected_hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every Hugging Face tensor a model of this config has, with its shape."""
    return {name: shape for rule in rules(cfg) for name, shape in zip(rule.hf, rule.shapes)}


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
        raise ValueError(f"{where}: tensor {label(unknown[0])} is not part of a model of this config")
