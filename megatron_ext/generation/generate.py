"""Text generation on a megatron GPTModel: greedy or sampled, with megatron's KV cache.

The model keeps its keys and values in megatron's own `StaticInferenceContext`: one forward over
the prompt fills the cache (prefill), then each new token is one single-token forward (decode).
Tensor parallelism works as in training (every TP rank runs the same steps and draws the same
samples from an identically seeded generator); pipeline parallelism is not supported here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
from megatron.core import parallel_state
from megatron.core.inference.contexts import StaticInferenceContext
from megatron.core.utils import unwrap_model

from megatron_ext.platform.device import current_device


@dataclass
class SamplingConfig:
    max_new_tokens: int = 32
    # 0: greedy (argmax). Otherwise logits are divided by it before sampling.
    temperature: float = 0.0
    # Sample among the k most likely tokens (0: all).
    top_k: int = 0
    # Sample among the smallest set of tokens whose probability reaches top_p (1.0: all).
    top_p: float = 1.0
    seed: int = 0
    # Generation of a sequence ends after any of these tokens (it is kept in the output).
    stop_token_ids: Sequence[int] = field(default_factory=tuple)
    # False: recompute the whole sequence every step (the reference the cache is checked with).
    use_cache: bool = True


def _vocab_logits(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Last position's logits over the real vocabulary (embedding padding dropped)."""
    return logits[:, -1, :vocab_size].float()


def _choose(logits: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator) -> torch.Tensor:
    if cfg.temperature <= 0:
        return logits.argmax(dim=-1)
    logits = logits / cfg.temperature
    if cfg.top_k > 0:
        kth = torch.topk(logits, cfg.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if cfg.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        # Drop a token when the tokens before it already reach top_p.
        drop = cumulative - sorted_logits.softmax(dim=-1) >= cfg.top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1).to(logits.device)


def _forward(model, tokens: torch.Tensor, start: int, context) -> torch.Tensor:
    positions = torch.arange(start, start + tokens.shape[1], device=tokens.device).unsqueeze(0)
    # runtime_gather_output: every TP rank gets the logits of the whole vocabulary.
    return model(tokens, positions, None, inference_context=context, runtime_gather_output=True)


@torch.no_grad()
def generate(model, prompt_ids: Sequence[int], vocab_size: int, cfg: SamplingConfig) -> list[int]:
    """The generated continuation of one prompt (prompt excluded)."""
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        raise ValueError("generation runs with parallel.pp=1 (any tp); this model is pipelined")
    model = unwrap_model(model)
    model.eval()
    device = current_device()
    tokens = torch.tensor([list(prompt_ids)], dtype=torch.long, device=device)
    max_length = tokens.shape[1] + cfg.max_new_tokens
    if max_length > model.max_sequence_length:
        raise ValueError(
            f"prompt ({tokens.shape[1]}) + max_new_tokens ({cfg.max_new_tokens}) exceeds the "
            f"model's sequence length ({model.max_sequence_length})"
        )
    generator = torch.Generator().manual_seed(cfg.seed)
    context = StaticInferenceContext(1, max_length) if cfg.use_cache else None
    new: list[int] = []
    step_input, start = tokens, 0
    for _ in range(cfg.max_new_tokens):
        logits = _forward(model, step_input, start, context)
        token = _choose(_vocab_logits(logits, vocab_size), cfg, generator)
        new.append(int(token.item()))
        if new[-1] in cfg.stop_token_ids:
            break
        tokens = torch.cat([tokens, token.view(1, 1)], dim=1)
        if context is not None:
            context.increment_sequence_len_offset(step_input.shape[1])
            context.enable_decode_mode()
            step_input, start = tokens[:, -1:], tokens.shape[1] - 1
        else:
            step_input = tokens
    return new
