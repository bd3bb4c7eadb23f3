"""Adapters out of and into the packed runtime.

PEFT format (`adapter_config.json` + `adapter_model.safetensors`) for the Hugging Face LLaMA
that `models/convert/hf.py` exports: megatron's fused adapters become PEFT's per-projection ones.
A fused adapter x A^T B^T on linear_qkv is exactly q/k/v adapters that share A, each with its
rows of B (in Hugging Face's head order, `split_qkv`); fc1's B splits into gate_proj and up_proj
halves the same way. Loading fuses them back: adapters that share A fuse at the same rank, and
independent ones (trained by PEFT itself) fuse exactly at the summed rank with a block B.

Megatron format: the logical adapter tensors as replicated ShardedTensors in a
`dist_checkpointing` folder (loadable under any TP), the job in its common state.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from safetensors.torch import load_file, save_file

from megatron_ext.config.schema import ModelConfig
from megatron_ext.lora.job import LoraJob
from megatron_ext.models.convert.llama import fuse_qkv, split_qkv
from megatron_ext.models.pretrained import resolve

Weights = dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]  # (layer number, target) -> (A, B)

PEFT_PREFIX = "base_model.model.model.layers"
# Megatron target -> (Hugging Face module path in a layer, the projections it splits into).
HF_TARGETS = {
    "linear_qkv": ("self_attn", ("q_proj", "k_proj", "v_proj")),
    "linear_proj": ("self_attn", ("o_proj",)),
    "linear_fc1": ("mlp", ("gate_proj", "up_proj")),
    "linear_fc2": ("mlp", ("down_proj",)),
}


def _split_b(target: str, b: torch.Tensor, cfg: ModelConfig) -> tuple[torch.Tensor, ...]:
    if target == "linear_qkv":
        return split_qkv(b, cfg)
    if target == "linear_fc1":
        return tuple(b.chunk(2, dim=0))
    return (b,)


def _fuse_b(target: str, parts: list[torch.Tensor], cfg: ModelConfig) -> torch.Tensor:
    if target == "linear_qkv":
        return fuse_qkv(*parts, cfg)
    return torch.cat(parts)


def to_peft(weights: Weights, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """PEFT's tensor names and shapes (layer numbers are 1-based, Hugging Face's 0-based)."""
    tensors = {}
    for (layer, target), (a, b) in sorted(weights.items()):
        module, projections = HF_TARGETS[target]
        for projection, b_part in zip(projections, _split_b(target, b, cfg)):
            name = f"{PEFT_PREFIX}.{layer - 1}.{module}.{projection}"
            tensors[f"{name}.lora_A.weight"] = a.contiguous().clone()
            tensors[f"{name}.lora_B.weight"] = b_part.contiguous().clone()
    return tensors


def from_peft(tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> Weights:
    """The inverse of `to_peft`, for any PEFT LoRA on these projections."""
    weights = {}
    for layer in range(cfg.num_layers):
        for target, (module, projections) in HF_TARGETS.items():
            names = [f"{PEFT_PREFIX}.{layer}.{module}.{p}" for p in projections]
            present = [f"{n}.lora_A.weight" in tensors for n in names]
            if not any(present):
                continue
            if not all(present):
                missing = [p for p, here in zip(projections, present) if not here]
                raise ValueError(
                    f"lora: layer {layer} adapts {[p for p, h in zip(projections, present) if h]} but not "
                    f"{missing}; megatron fuses them into {target}, so all or none must be adapted"
                )
            a_parts = [tensors[f"{n}.lora_A.weight"] for n in names]
            b_parts = [tensors[f"{n}.lora_B.weight"] for n in names]
            if all(torch.equal(a, a_parts[0]) for a in a_parts):
                a, b = a_parts[0], _fuse_b(target, b_parts, cfg)
            else:  # independent adapters: x [A1;A2;..]^T blockdiag(B1,B2,..)^T is exact
                a = torch.cat(a_parts)
                blocks = [torch.zeros(bp.shape[0], a.shape[0], dtype=bp.dtype) for bp in b_parts]
                offset = 0
                for block, bp in zip(blocks, b_parts):
                    block[:, offset : offset + bp.shape[1]] = bp
                    offset += bp.shape[1]
                b = _fuse_b(target, blocks, cfg)
            weights[(layer + 1, target)] = (a, b)
    if not weights:
        raise ValueError("lora: the adapter has no LoRA tensors for the projections megatron adapts")
    return weights


def peft_base_model(pretrained: Optional[str], given: Optional[str] = None) -> Optional[str]:
    """The base model an adapter_config.json names, which `AutoPeftModelForCausalLM` hands to
    transformers' `from_pretrained`: the path or hub id the user gave (`lora.peft_base_model`),
    else `model.pretrained` when it is a Hugging Face folder (made absolute). A GGUF file, a
    `pkg:` spec or a megatron checkpoint is nothing transformers opens: then no name (None) and
    a warning saying which option to set."""
    if given:
        return given
    if pretrained is None:
        return None

    path = Path(resolve(pretrained))
    if (path / "config.json").is_file():
        return str(path.resolve())
    warnings.warn(
        f"lora: model.pretrained={pretrained!r} is not a Hugging Face folder, so the PEFT adapter names no base "
        "model; set lora.peft_base_model to the path or hub id of its Hugging Face export",
        stacklevel=2,
    )
    return None


def peft_config(job: LoraJob, weights: Weights, base_model: Optional[str]) -> dict:
    targets = sorted({p for (_, t) in weights for p in HF_TARGETS[t][1]})
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": job.rank,
        "lora_alpha": job.alpha,
        "lora_dropout": job.dropout,
        "target_modules": targets,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "layers_to_transform": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }


def save_peft(folder: str | Path, job: LoraJob, weights: Weights, cfg: ModelConfig, base_model: Optional[str] = None) -> Path:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(to_peft(weights, cfg), str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    (folder / "adapter_config.json").write_text(json.dumps(peft_config(job, weights, base_model), indent=2) + "\n")
    return folder


def load_peft(folder: str | Path, cfg: ModelConfig, job: LoraJob) -> tuple[LoraJob, Weights]:
    """A PEFT adapter as a job (its rank and alpha; the rest from `job`) and its weights."""
    folder = Path(folder)
    config = json.loads((folder / "adapter_config.json").read_text())
    if config.get("peft_type") != "LORA" or config.get("use_dora") or config.get("use_rslora"):
        raise ValueError(f"lora: {folder} is not a plain LoRA adapter (peft_type, use_dora, use_rslora)")
    weights = from_peft(load_file(str(folder / "adapter_model.safetensors")), cfg)
    ranks = {a.shape[0] for a, _ in weights.values()}
    if len(ranks) != 1:
        raise ValueError(f"lora: {folder} fuses to several ranks {sorted(ranks)}; one slot holds one rank")
    loaded = job.replace(
        rank=ranks.pop(),
        # Scaling alpha/r is what the weights were trained with; keep it when fusion changed r.
        alpha=config["lora_alpha"] / config["r"] * next(iter(weights.values()))[0].shape[0],
        target_modules=tuple(sorted({t for _, t in weights})),
    )
    return loaded, weights


# --- megatron checkpoints -----------------------------------------------------------------------


def sharded_weights(weights: Weights, prefix: str = "lora") -> dict[str, ShardedTensor]:
    """Logical tensors shaped like an adapter's (the adapter, its Adam moments, its gradients)
    as replicated ShardedTensors `<prefix>.layers.<layer>.<target>.<a|b>`."""
    replica = dist.get_rank()  # full tensors on every rank: rank 0's copy is written
    out = {}
    for (layer, target), (a, b) in weights.items():
        for name, t in (("a", a), ("b", b)):
            key = f"{prefix}.layers.{layer}.{target}.{name}"
            out[key] = ShardedTensor.from_rank_offsets(key, t.contiguous(), replica_id=replica)
    return out


def weights_from(state: dict, prefix: str = "lora") -> Weights:
    """The inverse of `sharded_weights` on a loaded checkpoint (other entries are skipped)."""
    head = f"{prefix}.layers."
    weights: dict = {}
    for key, tensor in state.items():
        if key.startswith(head):
            layer, target, name = key[len(head) :].split(".")
            weights.setdefault((int(layer), target), {})[name] = tensor
    return {k: (v["a"], v["b"]) for k, v in weights.items()}


def save_megatron(folder: str | Path, job: LoraJob, weights: Weights, extra: Optional[dict] = None) -> Path:
    """A dist_checkpointing checkpoint of the adapter (collective over the default group: the
    world, or a pack's ranks inside groups.as_world); `extra`: more entries (ShardedTensors or
    common state) beside it."""
    folder = Path(folder)
    if dist.get_rank() == 0:
        folder.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save({**sharded_weights(weights), **(extra or {})}, str(folder))
    if dist.get_rank() == 0:
        (folder / "lora_job.json").write_text(json.dumps(dataclasses.asdict(job), indent=2) + "\n")
    return folder


def load_megatron_state(folder: str | Path) -> tuple[LoraJob, dict]:
    """The job and every entry of a `save_megatron` checkpoint (collective over the default
    group, like `save_megatron`)."""
    folder = Path(folder)
    job = LoraJob(**json.loads((folder / "lora_job.json").read_text()))
    metadata = dist_checkpointing.load_tensors_metadata(str(folder))
    template = {
        key: ShardedTensor.from_rank_offsets(key, torch.empty(meta.global_shape, dtype=meta.dtype), replica_id=dist.get_rank())
        for key, meta in metadata.items()
    }
    return job, dist_checkpointing.load(template, str(folder))


def load_megatron(folder: str | Path) -> tuple[LoraJob, Weights]:
    job, state = load_megatron_state(folder)
    return job, weights_from(state)
