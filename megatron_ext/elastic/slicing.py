"""Zero-shot export: any trained budget of an elastic model as a standalone model, and the one
nested checkpoint that holds every budget.

A submodel is the parent's tensors cut by the axes at its sizes (`sliced_state_dict`) loaded
into a plain megatron GPTModel built from the parent's config with the submodel's sizes. No
training, no calibration: the cut is a prefix (per group for heads) of the reordered parent.

The nested checkpoint stores the reordered parent once (every budget is a prefix of it) plus the
sizes of each trained budget: `model.safetensors` (megatron's tensor names) and `elastic.json`.
An FP8 nested checkpoint (`fp8_scales`, after quantisation-aware distillation) stores the decoder
linears as FP8 codes with the parent's per-tensor scales (`fp8.py`); `slice_nested_fp8` cuts one
budget out of it as a standalone FP8 checkpoint of the same format (a nested checkpoint with that
one budget, at its full size): its codes are the nested codes' slices byte for byte and its
scales the nested scales.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from pathlib import Path
from typing import Mapping, Optional

import torch
from megatron.core.transformer.spec_utils import build_module
from safetensors.torch import load_file, save_file
from torch import nn

from megatron_ext.config.schema import ModelConfig
from megatron_ext.elastic import fp8
from megatron_ext.elastic.axes import Size
from megatron_ext.elastic.space import ElasticSpace
from megatron_ext.models.convert.checkpoint import save_model_only
from megatron_ext.models.convert.hf import write_hf
from megatron_ext.models.convert.hf_config import hf_config_from_model
from megatron_ext.models.convert.llama import logical_to_hf
from megatron_ext.models.convert.load import gather_logical
from megatron_ext.models.convert.world import build_model, model_parallel_world
from megatron_ext.models.gpt import layer_spec
from megatron_ext.models.pretrained import source_config
from megatron_ext.platform import cpu_compat
from megatron_ext.checkpointing import torch_dist as ckpt

NESTED_MANIFEST = "elastic.json"
NESTED_WEIGHTS = "model.safetensors"


@torch.no_grad()
def sliced_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict as the submodel at the axes' active sizes holds it (copies)."""
    state = model.state_dict()
    for prefix, module in model.named_modules():
        for name in module.__dict__.get("_elastic_rules", {}):
            key = f"{prefix}.{name}" if prefix else name
            if key in state:
                state[key] = getattr(module, name).detach().clone()
    return state


def parent_head_dim(cfg: ModelConfig) -> int:
    return cfg.head_dim or cfg.hidden_size // cfg.num_attention_heads


def submodel_config(parent: ModelConfig, space: ElasticSpace, sizes: Mapping[str, Size], tag: str = "") -> ModelConfig:
    """The parent's config with the submodel's sizes; the head size stays the parent's."""
    fields = space.export_fields(sizes)
    name = f"{parent.name}-{tag}" if tag else parent.name
    return dataclasses.replace(parent, **fields, head_dim=parent_head_dim(parent), name=name, pretrained=None)


def export_submodel(
    model: nn.Module, parent: ModelConfig, space: ElasticSpace, sizes: Mapping[str, Size], padded_vocab: int, tag: str = ""
) -> tuple[nn.Module, ModelConfig]:
    """A standalone GPTModel (TP=1, PP=1, in this process) equal to `model` at `sizes`.

    `model` is the elastic parent (one chunk whose layers carry the axes of `space`), `parent`
    its config, `sizes` one size per axis kind (or per axis) from the grid, as the router picked
    them for a budget, and `padded_vocab` the embedding's rows. The parent's tensors are cut at
    those sizes (a prefix of the reordered parent, per group for heads) and loaded into a plain
    megatron model built from the parent's config with the submodel's sizes: no training, no
    calibration, and its forward equals the elastic forward at `sizes`. Returns (the model, its
    config, named `<parent>-<tag>` when `tag` is given). Raises ValueError for a size an axis
    does not allow.
    """
    cfg = submodel_config(parent, space, sizes, tag)
    space.clear_gates()
    with space.at(sizes):
        state = sliced_state_dict(model)
    (sub,) = build_model(cfg, padded_vocab)
    load_submodel_state(sub, state)
    return sub, cfg


def load_submodel_state(sub: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Every tensor of `sub` from the sliced parent state; parent tensors the submodel has no
    place for are the modules its sizes drop whole (MoE experts past the expert count)."""
    wanted = sub.state_dict().keys()
    missing = [k for k in wanted if k not in state]
    if missing:
        raise ValueError(f"elastic export: the submodel's {missing[:3]} have no parent tensor")
    sub.load_state_dict({k: state[k] for k in wanted}, strict=True)


def export_heterogeneous(
    model: nn.Module, parent: ModelConfig, space: ElasticSpace, sizes: Mapping[str, Size], padded_vocab: int
) -> nn.Module:
    """A standalone GPTModel with per-layer attention-head and FFN sizes (dense parents): built
    at the widest sizes, then each layer's attention and MLP rebuilt by megatron's own spec with
    that layer's sizes. Kept as a plain state dict (dist checkpoints need one shape per layer
    stack; `save_nested` stores the parent and the sizes instead)."""
    per_axis = space.check(sizes)
    widest: dict[str, int] = {}
    for name, size in per_axis.items():
        kind = space.by_name[name].kind
        widest[kind] = max(widest.get(kind, 0), size)
    cfg = submodel_config(parent, space, widest)
    space.clear_gates()
    with space.at(sizes):
        state = sliced_state_dict(model)
    (sub,) = build_model(cfg, padded_vocab)
    spec = layer_spec(cfg, use_te=False).submodules
    for layer in sub.decoder.layers:
        i = layer.layer_number - 1
        heads, ffn = per_axis[f"heads/{i}"], per_axis[f"ffn/{i}"]
        if heads != cfg.num_attention_heads:
            config = dataclasses.replace(layer.config, num_attention_heads=heads)
            layer.self_attention = build_module(
                spec.self_attention, config=config, layer_number=layer.layer_number, pg_collection=layer.pg_collection
            )
        if ffn != cfg.ffn_hidden_size:
            config = dataclasses.replace(layer.config, ffn_hidden_size=ffn)
            layer.mlp = build_module(spec.mlp, config=config, tp_group=layer.pg_collection.tp)
    load_submodel_state(sub, state)
    return sub


def param_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# --- files ------------------------------------------------------------------------------------


def save_megatron(out: str | os.PathLike, sub: nn.Module, cfg: ModelConfig, padded_vocab: int) -> Path:
    """A model-only megatron dist checkpoint (iteration 0), usable as `model.pretrained`."""
    save_model_only(str(out), [sub], cfg, padded_vocab)
    return Path(out)


def load_megatron(path: str | os.PathLike) -> tuple[nn.Module, ModelConfig]:
    """A checkpoint written by `save_megatron`, rebuilt from its own config (TP=1, PP=1)."""
    cfg = source_config(str(path))
    iteration = ckpt.latest_iteration(str(path))
    padded = ckpt.load_common(str(path), iteration)["padded_vocab_size"]
    (sub,) = build_model(cfg, padded)
    ckpt.load_checkpoint(str(path), iteration, [sub], None, load_rng=False)
    return sub, cfg


def save_hf(out: str | os.PathLike, sub: nn.Module, cfg: ModelConfig, vocab_size: int) -> Path:
    """A Hugging Face LlamaForCausalLM folder of a dense submodel.

    `sub` and `cfg` are what `export_submodel` returned, `vocab_size` the tokenizer's size (the
    padding rows are dropped). Writes the weights as safetensors and the matching config.json
    under `out`, which `transformers` loads as it is; returns the folder. Raises ValueError for
    a model whose network no Hugging Face family of the converters has (models/convert/families.py).
    """
    tensors = logical_to_hf(gather_logical([sub]), cfg, vocab_size)
    return write_hf(out, tensors, hf_config_from_model(cfg, vocab_size))


def save_nested(
    out: str | os.PathLike,
    model: nn.Module,
    parent: ModelConfig,
    padded_vocab: int,
    budgets: Mapping[str, Mapping[str, int]],
    extra: Optional[dict] = None,
    fp8_scales: Optional[Mapping[str, torch.Tensor]] = None,
) -> Path:
    """One checkpoint for every budget: the reordered parent's tensors and each budget's sizes;
    with `fp8_scales` (`fp8.scales` of the parent) its quantised weights as FP8 codes.

    `model` is the elastic parent in this process, `budgets` maps each budget's name (e.g.
    "0.5") to its sizes, `extra` adds entries to the manifest. Writes `model.safetensors` (the
    parent once: every budget is a prefix of it) and `elastic.json` (the parent's config, the
    padded vocabulary, the budgets) under `out` and returns the folder; `slice_nested` and
    `python -m megatron_ext.elastic.slicing` cut any budget out of it. Raises ValueError, before
    anything is written, for an FP8 scale that names no tensor of the parent.
    """
    return save_nested_state(out, parent_state(model), parent, padded_vocab, budgets, extra, fp8_scales)


def parent_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's tensors at full size (copies; no `_extra_state`)."""
    return {k: v.detach().contiguous().clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}


def save_nested_state(
    out: str | os.PathLike,
    state: Mapping[str, torch.Tensor],
    parent: ModelConfig,
    padded_vocab: int,
    budgets: Mapping[str, Mapping[str, int]],
    extra: Optional[dict] = None,
    fp8_scales: Optional[Mapping[str, torch.Tensor]] = None,
) -> Path:
    """`save_nested` of a parent given by its tensors (e.g. gathered from pipeline stages)."""
    if fp8_scales is not None:
        state = fp8.fp8_state(state, fp8_scales)  # refuses an unknown key before anything is written
    return write_nested(out, state, parent, padded_vocab, budgets, {**(extra or {}), "fp8": fp8_scales is not None})


def write_nested(
    out: str | os.PathLike,
    state: Mapping[str, torch.Tensor],
    cfg: ModelConfig,
    padded_vocab: int,
    budgets: Mapping[str, Mapping[str, int]],
    extra: dict,
) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(dict(state), str(out / NESTED_WEIGHTS))
    manifest = {
        "model": dataclasses.asdict(cfg),
        "padded_vocab_size": padded_vocab,
        "budgets": {k: dict(v) for k, v in budgets.items()},
        **extra,
    }
    (out / NESTED_MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return out


def load_nested(path: str | os.PathLike) -> tuple[nn.Module, ElasticSpace, ModelConfig, dict]:
    """The elastic parent of a nested checkpoint: (model, space, config, manifest). An FP8
    checkpoint loads dequantised: the weights its quantisation-aware student read."""
    manifest = json.loads(Path(path, NESTED_MANIFEST).read_text())
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    cfg = ModelConfig(**{k: v for k, v in manifest["model"].items() if k in known})
    (model,) = build_model(cfg, manifest["padded_vocab_size"])
    state = load_file(str(Path(path, NESTED_WEIGHTS)))
    if manifest.get("fp8"):
        state = fp8.dequantized_state(state, model.state_dict())
    result = model.load_state_dict(state, strict=False)
    # Only megatron's non-tensor `_extra_state` entries are not stored.
    missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
    if missing or result.unexpected_keys:
        raise ValueError(f"{path}: tensors do not match the model: missing {missing}, unexpected {result.unexpected_keys}")
    return model, ElasticSpace(model), cfg, manifest


def budget_sizes(path: str | os.PathLike, manifest: dict, budget: str) -> dict[str, int]:
    if budget not in manifest["budgets"]:
        raise KeyError(f"{path}: no budget {budget!r}; it has {sorted(manifest['budgets'])}")
    return manifest["budgets"][budget]


def slice_nested(path: str | os.PathLike, budget: str) -> tuple[nn.Module, ModelConfig]:
    """The standalone submodel of one budget of a nested checkpoint (dequantised if FP8)."""
    model, space, cfg, manifest = load_nested(path)
    sizes = budget_sizes(path, manifest, budget)
    return export_submodel(model, cfg, space, sizes, manifest["padded_vocab_size"], budget)


def slice_nested_fp8(path: str | os.PathLike, budget: str, out: str | os.PathLike) -> Path:
    """One budget of an FP8 nested checkpoint as a standalone FP8 checkpoint in `out`: the
    budget's slices of the nested FP8 codes (bytes, not requantised), the nested scales, and the
    other tensors sliced as `export_submodel` slices them. `slice_nested(out, budget)` reads it."""
    model, space, cfg, manifest = load_nested(path)
    if not manifest.get("fp8"):
        raise ValueError(f"{path}: not an FP8 nested checkpoint (written without fp8 scales); use slice_nested")
    sizes = budget_sizes(path, manifest, budget)
    stored = load_file(str(Path(path, NESTED_WEIGHTS)))
    scales = fp8.scales_in(stored)
    space.clear_gates()
    with space.at(sizes):
        state = sliced_state_dict(model)
        codes = fp8.sliced_codes(model, {k: stored[k] for k in scales})
    state = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
    state.update(codes)
    state.update({k + fp8.SCALE_SUFFIX: s for k, s in scales.items()})
    sub_cfg = submodel_config(cfg, space, sizes, budget)
    return write_nested(out, state, sub_cfg, manifest["padded_vocab_size"], {budget: sizes}, {"fp8": True})


def main(argv: Optional[list[str]] = None) -> None:
    """python -m megatron_ext.elastic.slicing NESTED --budget B [--megatron DIR] [--hf DIR] [--fp8 DIR]

    From an FP8 nested checkpoint --megatron and --hf write the dequantised submodel."""
    parser = argparse.ArgumentParser(description="Slice one budget out of a nested elastic checkpoint.")
    parser.add_argument("nested")
    parser.add_argument("--budget", required=True, help="a budget name of the checkpoint's elastic.json")
    parser.add_argument("--megatron", help="write a megatron checkpoint (usable as model.pretrained) here")
    parser.add_argument("--hf", help="write a Hugging Face LlamaForCausalLM folder here")
    parser.add_argument("--fp8", help="write the standalone FP8 checkpoint (of an FP8 nested checkpoint) here")
    args = parser.parse_args(argv)
    if not (args.megatron or args.hf or args.fp8):
        parser.error("give --megatron, --hf and/or --fp8")
    cpu_compat.apply()
    with model_parallel_world():
        if args.fp8:
            slice_nested_fp8(args.nested, args.budget, args.fp8)
        sub, cfg = slice_nested(args.nested, args.budget)
        padded = sub.embedding.word_embeddings.weight.shape[0]
        if args.megatron:
            save_megatron(args.megatron, sub, cfg, padded)
        if args.hf:
            save_hf(args.hf, sub, cfg, cfg.vocab_size or padded)
    print(f"budget {args.budget}: {param_count(sub)} parameters, sizes {cfg.hidden_size=} {cfg.num_attention_heads=} {cfg.ffn_hidden_size=}")


if __name__ == "__main__":
    main()
