"""torch's RMSNorm / LayerNorm for megatron's local layers, usable under sequence parallelism.

megatron-core 0.16 builds local norms as `WrappedTorchNorm`, which refuses sequence parallelism
only because nothing reduces the weight gradients: with the sequence split over TP ranks, each
rank's norm sees a slice of the tokens, so its weight gradient is a partial sum. megatron's
`finalize_model_grads` all-reduces over TP every parameter carrying `sequence_parallel = True`
(as Apex's and TE's norms mark theirs); this norm marks its parameters the same way. The module
built is torch's own, so without sequence parallelism it is exactly `WrappedTorchNorm`'s
(same arithmetic, same `weight` / `bias` state-dict keys).
"""

from __future__ import annotations

import torch
from megatron.core.transformer import TransformerConfig

NORMS = {"RMSNorm": torch.nn.RMSNorm, "LayerNorm": torch.nn.LayerNorm}


class LocalNorm:
    """Builds the norm megatron's specs ask for; called with the arguments megatron's layers and
    blocks pass to any norm (`config, hidden_size, eps, ...`), like `WrappedTorchNorm`."""

    def __new__(
        cls,
        config: TransformerConfig,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str = "LayerNorm",
    ) -> torch.nn.Module:
        # The per-call flags are ignored as in WrappedTorchNorm: megatron reads them from config.
        if config.normalization not in NORMS:
            raise ValueError(f"LocalNorm supports {', '.join(NORMS)}; got {config.normalization!r}")
        if config.layernorm_zero_centered_gamma or config.persist_layer_norm or config.memory_efficient_layer_norm:
            raise ValueError("LocalNorm (torch's norms) has no zero-centred gamma, persistent or memory-efficient variant")
        # In the model's dtype, as Megatron-LM's Float16Module casts every norm of a bf16 / fp16
        # model (whose optimizer then keeps their fp32 main copies).
        norm = NORMS[config.normalization](normalized_shape=hidden_size, eps=eps, dtype=config.params_dtype)
        if config.sequence_parallel:
            for param in norm.parameters():
                param.sequence_parallel = True
        return norm
