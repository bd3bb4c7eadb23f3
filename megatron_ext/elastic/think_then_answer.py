"""Elastic budget control at inference: think with one nested submodel, answer with another.

The thinking phase decodes with the `think` sizes until the end-of-thinking token or the
thinking budget (then the token is appended, closing the trace); the answer phase switches the
same weights to the `answer` sizes, prefills prompt + trace and decodes the answer. Both phases
are megatron_ext's ordinary generation (`megatron_ext.generation`, megatron's KV cache); only the
active sizes differ, so no second copy of the weights exists.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

from torch import nn

from megatron_ext.elastic.space import ElasticSpace
from megatron_ext.generation.generate import SamplingConfig, generate


@dataclass
class Phase:
    sizes: dict
    prefill_tokens: int
    new_tokens: int
    seconds: float


@dataclass
class ElasticAnswer:
    trace: list[int]
    answer: list[int]
    phases: dict[str, Phase] = field(default_factory=dict)

    def report(self) -> dict:
        return {name: vars(p) for name, p in self.phases.items()}


def _timed_generate(model, ids: Sequence[int], vocab: int, cfg: SamplingConfig) -> tuple[list[int], float]:
    start = time.perf_counter()
    out = generate(model, ids, vocab, cfg)
    return out, time.perf_counter() - start


def generate_elastic(
    model: nn.Module,
    space: ElasticSpace,
    prompt_ids: Sequence[int],
    vocab_size: int,
    think_sizes: Mapping,
    answer_sizes: Mapping,
    end_think_id: int,
    think_budget: int,
    max_answer_tokens: int,
    stop_token_ids: Sequence[int] = (),
    sampling: Optional[SamplingConfig] = None,
) -> ElasticAnswer:
    """Think with `think_sizes` (at most `think_budget` tokens), answer with `answer_sizes`."""
    if think_budget < 0 or max_answer_tokens < 1:
        raise ValueError(f"think_budget ({think_budget}) must be >= 0 and max_answer_tokens ({max_answer_tokens}) >= 1")
    base = sampling or SamplingConfig()
    space.clear_gates()
    prompt = list(prompt_ids)
    result = ElasticAnswer([], [])
    trace: list[int] = []
    seconds = 0.0
    if think_budget:
        with space.at(think_sizes):
            think_cfg = _with(base, think_budget, [end_think_id])
            trace, seconds = _timed_generate(model, prompt, vocab_size, think_cfg)
    if not trace or trace[-1] != end_think_id:
        trace = trace + [end_think_id]  # the budget ran out: close the thought
    result.phases["think"] = Phase(dict(think_sizes), len(prompt), len(trace), seconds)
    with space.at(answer_sizes):
        answer, seconds = _timed_generate(model, prompt + trace, vocab_size, _with(base, max_answer_tokens, stop_token_ids))
    result.phases["answer"] = Phase(dict(answer_sizes), len(prompt) + len(trace), len(answer), seconds)
    result.trace, result.answer = trace, answer
    return result


def _with(cfg: SamplingConfig, max_new_tokens: int, stops: Sequence[int]) -> SamplingConfig:
    # replace, not a field-by-field copy: a field added to SamplingConfig later is kept.
    return dataclasses.replace(cfg, max_new_tokens=max_new_tokens, stop_token_ids=tuple(stops))
