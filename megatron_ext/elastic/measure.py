"""What the elastic benchmarks measure a submodel by, and the baseline they set it against.

`heldout_losses`: next-token cross entropy and KD loss to the teacher per loss-mask token of
held-out batches. `distil_alone`: the baseline, one pruned submodel distilled by itself (forward
KL to the teacher, torch's Adam, the learning rate optionally falling linearly to zero), as the
elastic run distils all its budgets at once. `forward_latencies`: the median wall time of one
forward of each of several models, taken in turns (`forward_latency`: of one). `seed_stats`: a
measurement over seeds as its mean, standard error and values.
"""

from __future__ import annotations

import math
import statistics
from typing import Callable, Iterable, Mapping, Optional

import torch
from torch import nn

from megatron_ext.data.sft.packing import attention_mask_of
from megatron_ext.elastic.vocab_loss import ce_per_token, kd_per_token
from megatron_ext.platform.device import wall_clock


def _forward(model: nn.Module, batch: dict) -> torch.Tensor:
    return model(batch["tokens"], batch["position_ids"], attention_mask_of(batch))


@torch.no_grad()
def heldout_losses(
    model: nn.Module, batches: Iterable[dict], teacher_logits: Iterable[torch.Tensor], vocab: int
) -> tuple[float, float]:
    """(next-token CE, KD to the teacher) per loss-mask token; `teacher_logits` pairs with
    `batches` one to one (a list computed once, or a generator that runs the teacher)."""
    model.eval()
    ce_sum = kd_sum = count = 0.0
    for batch, teacher in zip(batches, teacher_logits, strict=True):
        logits, mask = _forward(model, batch), batch["loss_mask"]
        ce_sum += float((ce_per_token(logits, batch["labels"], vocab) * mask).sum())
        kd_sum += float((kd_per_token(logits, teacher, 1.0, vocab) * mask).sum())
        count += float(mask.sum())
    return ce_sum / count, kd_sum / count


def distil_alone(
    model: nn.Module,
    teacher: nn.Module,
    batches: Callable[[int], list[dict]],
    steps: int,
    lr: float,
    vocab: int,
    decay: bool = True,
) -> list[float]:
    """Distil `model` alone from `teacher` on `batches(step)` (the step's micro-batches, the loss
    a mean over all their loss-mask tokens); returns the loss per step."""
    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        if decay:
            optimizer.param_groups[0]["lr"] = lr * (1 - step / steps)
        micro = batches(step)
        tokens = sum(float(b["loss_mask"].sum()) for b in micro)
        optimizer.zero_grad()
        step_loss = 0.0
        for batch in micro:
            with torch.no_grad():
                target = _forward(teacher, batch)
            loss = (kd_per_token(_forward(model, batch), target, 1.0, vocab) * batch["loss_mask"]).sum() / tokens
            loss.backward()
            step_loss += float(loss.detach())
        optimizer.step()
        losses.append(step_loss)
    model.eval()
    return losses


def forward_latency(model: nn.Module, tokens: torch.Tensor, repeats: int = 20, warmup: int = 3) -> float:
    """Median seconds of one forward of `tokens` ([batch, seq]) after `warmup` untimed ones."""
    return forward_latencies({"model": model}, tokens, repeats, warmup)["model"]


@torch.no_grad()
def forward_latencies(
    models: Mapping[str, nn.Module], tokens: torch.Tensor, repeats: int = 20, warmup: int = 3
) -> dict[str, float]:
    """Median seconds of one forward of `tokens` per model, the models taking turns (one forward
    each per round), so a change in the machine's load falls on all of them alike. On a GPU a
    forward is timed to the end of its kernels, not of their launch."""
    positions = torch.arange(tokens.shape[1], device=tokens.device)[None].expand(tokens.shape[0], -1)
    clock = wall_clock(tokens.device)
    times: dict[str, list[float]] = {name: [] for name in models}
    for model in models.values():
        model.eval()
    for i in range(warmup + repeats):
        for name, model in models.items():
            start = clock()
            model(tokens, positions, None)
            if i >= warmup:
                times[name].append(clock() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def mean_se(values: list[float]) -> tuple[float, Optional[float]]:
    """Mean and its standard error (None from one value)."""
    se = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else None
    return statistics.fmean(values), se


def seed_stats(key: str, values: list[float]) -> dict:
    """{key: mean, key_se: its standard error, key_seeds: the values}."""
    mean, se = mean_se(values)
    return {key: mean, f"{key}_se": se, f"{key}_seeds": values}
