"""A model's axes: the model-wide hidden axis plus, for each decoder layer, what the first
registered layer adapter that recognises it returns (`axes.register_layer_adapter`).

Importing this module registers the built-in adapters: dense layers (attention + SwiGLU MLP,
`dense_axes.py`) and, tried before them, Mamba, MoE and single-sublayer layers (`hybrid_axes.py`).
"""

from __future__ import annotations

from typing import Sequence, Union

from torch import nn

import megatron_ext.elastic.dense_axes  # noqa: F401  (registers the dense adapter)
import megatron_ext.elastic.hybrid_axes  # noqa: F401  (Mamba, MoE and single-sublayer layers)
from megatron_ext.elastic.axes import Axis, HiddenAxis, Touch, layer_axes, resize_norm
from megatron_ext.elastic.pipeline import chunks_of


def _model_touches(model: nn.Module) -> tuple[list[Touch], list[nn.Module]]:
    """The embedding, the final norm and the output layer of a megatron LanguageModule."""
    touches, norms = [], []
    output = getattr(model, "output_layer", None) if getattr(model, "post_process", True) else None

    def resize_output(_: nn.Module, size: int) -> None:
        # ColumnParallelLinear checks a passed-in (tied) weight against `input_size`.
        output.input_size = size

    tied_output = output is not None and output.weight is None
    if getattr(model, "pre_process", True):
        touches.append(
            Touch(
                model.embedding.word_embeddings,
                "weight",
                1,
                resize_output if tied_output else None,
                owned=True,
                tp_sharded=True,
                logits=tied_output,
            )
        )
    final = getattr(model.decoder, "final_layernorm", None) or getattr(model.decoder, "final_norm", None)
    if final is not None:
        touches.append(Touch(final, "weight", 0, resize_norm, owned=True))
        norms.append(final)
    if output is not None and not tied_output:
        # Under pipeline parallelism a tied output layer is a copy of the first stage's embedding
        # on the last: cut and permuted alike, counted once (by the embedding).
        owned = not model.share_embeddings_and_output_weights
        touches.append(Touch(output, "weight", 1, resize_output, owned=owned, tp_sharded=True, logits=True))
    return touches, norms


def discover(model: Union[nn.Module, Sequence[nn.Module]]) -> list[Axis]:
    """Every axis of an (unwrapped) megatron GPTModel / MambaModel, hidden first, attached:
    reads of the touched tensors now follow the axes' active sizes (all full). `model` may be a
    rank's model chunks (virtual pipeline stages): one hidden axis runs through all of them."""
    chunks = chunks_of(model)
    touches, norms, per_layer = [], [], []
    for chunk in chunks:
        found_touches, found_norms = _model_touches(chunk)
        touches += found_touches
        norms += found_norms
        for layer in chunk.decoder.layers:
            found = layer_axes(layer)
            per_layer += found.axes
            touches += found.hidden
            norms += found.norms
    vocab = next((c.embedding.word_embeddings.weight.shape[0] for c in chunks if hasattr(c, "embedding")), 0)
    first = chunks[0]
    hidden = HiddenAxis(
        first.config.hidden_size,
        touches,
        norms,
        vocab,
        first.share_embeddings_and_output_weights,
        first.config.sequence_parallel,
    )
    axes = [hidden] + per_layer
    for axis in axes:
        axis.attach()
    return axes
