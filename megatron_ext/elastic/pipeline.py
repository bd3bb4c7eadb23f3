"""Elastic distillation across pipeline stages.

Each stage holds its layers' axes (global layer numbers) and its share of the hidden axis (the
embedding on the first stage, the final norm and output layer on the last, the layers' norms and
projections on each). What must agree over the stages:

  * importance: the hidden axis sums its scores over the stages (`reduce_scores`), so every stage
    permutes the residual stream alike; per-layer axes are scored where their layer lives;
  * costs: a submodel's parameters are the sum of every stage's (`stage_sum`), so the router, which
    runs alike on every rank, sees the whole model's cost;
  * activations: a budget's hidden size changes the shape a stage sends to the next (a micro-batch
    of several budgets sends its groups padded to the widest one's, `grouped.py`), so megatron's
    p2p communicates shapes first (`config.variable_seq_lengths`, set by the plugin);
  * the teacher: pipelined like the student, run forward-only through megatron's schedule on the
    step's micro-batches before the student's schedule (`forward_only`); the last stage keeps its
    logits for the KD loss;
  * export: the stages' tensors gathered on the first stage under the keys one process holding
    the whole model has (`gather.py`), so the nested checkpoint does not depend on PP.

Under virtual pipeline stages (`parallel.vpp`, GPT parents) a rank holds several model chunks
(megatron's interleaved schedule): the rank's axes are every chunk's (one hidden axis over all of
them; layer axes under megatron's global layer numbers, vp offsets included), so the costs summed
over the stages count each chunk once; the teacher has the student's chunks; each chunk draws
every micro-batch's budget itself (the draws are keyed by the micro-batch, so they agree), the
chunk that computes the logits is the one with `post_process` (`holds_logits`), and every chunk
sends the full hidden size, zero-padded, without `variable_seq_lengths` (`grouped.py` says why).
"""

from __future__ import annotations

from typing import Callable, Sequence, Union

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.utils import unwrap_model
from torch import nn

from megatron_ext.elastic.axes import Size


def stages() -> int:
    if not parallel_state.model_parallel_is_initialized():
        return 1
    return parallel_state.get_pipeline_model_parallel_world_size()


def chunks_of(model: Union[nn.Module, Sequence[nn.Module]]) -> list[nn.Module]:
    """A rank's model chunks: one per virtual pipeline stage (one module without VPP)."""
    return list(model) if isinstance(model, (list, tuple)) else [model]


def chunk_index(model: nn.Module) -> int:
    """The virtual pipeline stage of a (wrapped) model chunk, 0 without VPP."""
    return getattr(unwrap_model(model), "vp_stage", None) or 0


def holds_logits(model: nn.Module) -> bool:
    """Whether this (wrapped) chunk computes the logits: the last chunk of the last stage."""
    return bool(getattr(unwrap_model(model), "post_process", True))


def stage_sum(value: Size) -> Size:
    """A cost summed over the pipeline stages (the value itself without PP). Only numbers: a cost
    that must carry a gradient to the router (a grid too large to enumerate) is refused."""
    if stages() == 1:
        return value
    if isinstance(value, torch.Tensor) and value.requires_grad:
        raise ValueError(
            "elastic: under pipeline parallelism the router needs a grid small enough to enumerate "
            "(the product of the choices per kind at most 20000); use fewer elastic.grid choices"
        )
    total = torch.tensor(float(value), dtype=torch.float64)
    dist.all_reduce(total, group=parallel_state.get_pipeline_model_parallel_group())
    return int(total) if isinstance(value, int) else total


def merge_stages(local: dict) -> dict:
    """Every stage's `local` entries in one dict (in stage order, so in layer order where keyed
    by layer), on every stage; `local` itself without PP."""
    if stages() == 1:
        return dict(local)
    per_stage = [None] * stages()
    dist.all_gather_object(per_stage, local, group=parallel_state.get_pipeline_model_parallel_group())
    return {k: v for stage in per_stage for k, v in stage.items()}


def forward_only(
    model: Union[nn.Module, Sequence[nn.Module]], batches: list, forward: Callable[[nn.Module, dict], torch.Tensor], **schedule
) -> list:
    """`forward(chunk, batch)` of every batch through megatron's pipeline schedule (forward only),
    one micro-batch per batch: the last stage's outputs, in order (empty on other stages).
    `model`: the rank's chunks (the interleaved schedule, which runs a multiple of pp batches,
    reads one iterator per chunk) or one module. `schedule`: megatron's seq_length,
    micro_batch_size (and what else the schedule takes)."""
    def step(data_iterator, chunk):
        return forward(chunk, next(data_iterator)), None  # no loss function: the schedule keeps outputs

    chunks = chunks_of(model)
    return get_forward_backward_func()(
        forward_step_func=step,
        data_iterator=[iter(batches) for _ in chunks] if len(chunks) > 1 else iter(batches),
        model=chunks,
        num_microbatches=len(batches),
        forward_only=True,
        **schedule,
    )
