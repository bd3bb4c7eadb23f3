"""The DPP schedule loop: run a StepPlan's per-stage op lists on megatron-core's p2p layer.

Megatron's own schedules size every p2p transfer from one `seq_length` (or exchange shapes
first) and run a fixed 1F1B order. Here the plan, identical on every rank, gives each stage its
ops and each chunk its token count, so receives are posted with the exact shape and nothing is
exchanged (`variable_seq_lengths` stays off). Sends are posted without waiting (gloo and NCCL
sends block until the peer receives; waiting would tie the stages' orders together) and are
waited on at the end of each 1F1B group.

Each op is megatron's own `forward_step` / `backward_step` on one chunk, with
`config.recompute_num_layers` set to the op's count before the forward (megatron's block
recompute reads it at every forward). Gradients accumulate across chunks and groups under DDP's
`no_sync`; then megatron's `finalize_model_grads` reduces them over data-parallel replicas and
pipeline-tied embeddings and divides by the token count of the whole global batch.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.pipeline_parallel import schedules
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron.core.utils import get_model_config, get_model_type

from megatron_ext.dpp.planning.plan import StepPlan
from megatron_ext.dpp.runtime.attention import ChunkContext
from megatron_ext.dpp.runtime.batch import chunk_inputs
from megatron_ext.dpp.runtime.memory import ActivationMeter, Timeline


@dataclass(frozen=True)
class PlannedBatch:
    """This data-parallel replica's share of a global batch and its plan. `documents[i]` holds
    the `plan.seq_lengths[i] + 1` token ids of sequence i (inputs and next-token labels)."""

    plan: StepPlan
    documents: tuple[torch.Tensor, ...]


# --- plan checks (pure) ---------------------------------------------------------------------


def _stage_orders(ops) -> tuple[list[int], list[int]]:
    return [o.chunk for o in ops if o.kind == "F"], [o.chunk for o in ops if o.kind == "B"]


def validate_plan(plan: StepPlan, num_layers_per_stage: Optional[list[int]] = None) -> None:
    """Refuse, before anything runs, a plan the runtime cannot execute: every stage must forward
    and backward each chunk of a group once, in the same chunk order on every stage (p2p
    messages between two stages match in posting order); slices of a sequence forward in order
    and backward in reverse, within one group; and the stages' orders must not wait on each
    other in a cycle."""
    if any(c.id != i for i, c in enumerate(plan.chunks)):
        raise ValueError("dpp plan: chunks[i].id must be i")
    if any(c.padding < 0 for c in plan.chunks):
        raise ValueError("dpp plan: a chunk's padding must not be negative")
    seen: set[int] = set()
    group_of_seq: dict[int, int] = {}
    for g, group in enumerate(plan.groups):
        if len(group.ops) != plan.pp:
            raise ValueError(f"dpp plan: group {g} has op lists for {len(group.ops)} stages, pp={plan.pp}")
        fwd, bwd = _stage_orders(group.ops[0])
        if sorted(fwd) != sorted(bwd) or len(set(fwd)) != len(fwd):
            raise ValueError(f"dpp plan: group {g}, stage 0 must run F and B of each of its chunks once")
        for s, ops in enumerate(group.ops):
            if _stage_orders(ops) != (fwd, bwd):
                raise ValueError(f"dpp plan: group {g}, stage {s} orders its chunks differently from stage 0")
            done: set[int] = set()
            for op in ops:
                if op.kind == "F":
                    done.add(op.chunk)
                elif op.chunk not in done:
                    raise ValueError(f"dpp plan: group {g}, stage {s}: B of chunk {op.chunk} before its F")
                if op.kind == "F" and not 0 <= op.recompute <= (num_layers_per_stage or [op.recompute] * plan.pp)[s]:
                    raise ValueError(f"dpp plan: group {g}, stage {s}: chunk {op.chunk} recomputes {op.recompute} layers")
        if seen & set(fwd):
            raise ValueError(f"dpp plan: group {g} repeats chunks of an earlier group")
        seen |= set(fwd)
        _check_slice_order(plan, fwd, bwd, g, group_of_seq)
        _check_no_cycle(plan.pp, group.ops, g)
    if seen != set(range(len(plan.chunks))):
        raise ValueError(f"dpp plan: chunks {sorted(set(range(len(plan.chunks))) - seen)} are never run")
    _check_coverage(plan)


def _check_slice_order(plan: StepPlan, fwd: list[int], bwd: list[int], g: int, group_of_seq: dict) -> None:
    for order, kind, sign in ((fwd, "forward", 1), (bwd, "backward", -1)):
        last: dict[int, int] = {}
        for c in order:
            for seg in plan.chunk(c).segments:
                if group_of_seq.setdefault(seg.seq, g) != g:
                    raise ValueError(f"dpp plan: sequence {seg.seq} has slices in groups {group_of_seq[seg.seq]} and {g}")
                if seg.seq in last and (seg.start - last[seg.seq]) * sign <= 0:
                    raise ValueError(f"dpp plan: slices of sequence {seg.seq} do not run {kind} in {'order' if sign > 0 else 'reverse'}")
                last[seg.seq] = seg.start


def _check_coverage(plan: StepPlan) -> None:
    covered: dict[int, list[tuple[int, int]]] = {}
    for chunk in plan.chunks:
        for seg in chunk.segments:
            covered.setdefault(seg.seq, []).append((seg.start, seg.length))
    for seq, length in enumerate(plan.seq_lengths):
        pos = 0
        for start, n in sorted(covered.get(seq, [])):
            if start != pos or n <= 0:
                break
            pos += n
        if pos != length:
            raise ValueError(f"dpp plan: the slices of sequence {seq} do not tile its {length} tokens")


def _check_no_cycle(pp: int, stage_ops, g: int) -> None:
    """Run the stages' op lists against each other with sends that never block."""
    pos = [0] * pp
    forwarded = [set() for _ in range(pp)]
    backwarded = [set() for _ in range(pp)]
    progress = True
    while progress:
        progress = False
        for s in range(pp):
            while pos[s] < len(stage_ops[s]):
                op = stage_ops[s][pos[s]]
                if op.kind == "F" and s > 0 and op.chunk not in forwarded[s - 1]:
                    break
                if op.kind == "B" and s < pp - 1 and op.chunk not in backwarded[s + 1]:
                    break
                (forwarded if op.kind == "F" else backwarded)[s].add(op.chunk)
                pos[s] += 1
                progress = True
    stuck = [s for s in range(pp) if pos[s] < len(stage_ops[s])]
    if stuck:
        waits = ", ".join(f"stage {s} at {stage_ops[s][pos[s]]}" for s in stuck)
        raise ValueError(f"dpp plan: group {g} deadlocks ({waits})")


# --- the loop ---------------------------------------------------------------------------------


def enable_block_recompute(config) -> None:
    """Let each forward choose how many of the stage's first layers megatron recomputes."""
    config.recompute_granularity = "full"
    config.recompute_method = "block"
    config.recompute_num_layers = 0
    # Sends are posted without waiting; megatron allows that only on the unbatched p2p path.
    config.batch_p2p_comm = False
    # The stage keeps each chunk's output until its backward (plain autograd backward).
    config.deallocate_pipeline_outputs = False


class DppStep:
    """Runs one step of a plan on this rank's stage. Holds the model's ChunkContext and,
    optionally, a memory meter and a timeline that record the step."""

    def __init__(self, context: ChunkContext, meter: Optional[ActivationMeter] = None, timeline: Optional[Timeline] = None):
        self.context = context
        self.meter = meter
        self.timeline = timeline
        context.cache.hold = meter.hold if meter is not None else None

    def __call__(self, planned: PlannedBatch, forward_step_func: Callable, model) -> list[dict]:
        model = model[0] if isinstance(model, list) else model
        config = get_model_config(model)
        plan = planned.plan
        pp_group = parallel_state.get_pipeline_model_parallel_group()
        stage, pp = pp_group.rank(), pp_group.size()
        if plan.pp != pp:
            raise ValueError(f"dpp: the plan is for pp={plan.pp}, this run has pp={pp}")
        first, last = stage == 0, stage == pp - 1
        p2p = P2PCommunicator(pp_group, config)
        model_type = get_model_type(model)
        tp = parallel_state.get_tensor_model_parallel_world_size() if config.sequence_parallel else 1
        uneven = [c.id for c in plan.chunks if c.tokens % tp]
        if uneven:  # before anything runs: sequence parallelism splits every chunk over the TP ranks
            raise ValueError(f"dpp: chunks {uneven} have token counts not divisible by tp={tp} (sequence parallel; "
                             "plan with token_multiple=tp)")
        losses: list = []
        total_tokens = torch.zeros([], dtype=torch.int, device=next(model.parameters()).device)
        no_sync = (config.no_sync_func or contextlib.nullcontext)()
        no_sync.__enter__()
        try:
            for group in plan.groups:
                live: dict[int, tuple] = {}
                sends: list = []
                for op in group.ops[stage]:
                    chunk = plan.chunk(op.chunk)
                    shape = (chunk.tokens // tp, 1, config.hidden_size)
                    self.context.enter(chunk.segments, plan.seq_lengths, chunk.padding)
                    began = time.perf_counter()
                    if op.kind == "F":
                        input_tensor = p2p.recv_forward(shape, first)
                        began = time.perf_counter()
                        config.recompute_num_layers = op.recompute
                        with self._metered(chunk.id):
                            output, tokens = schedules.forward_step(
                                forward_step_func,
                                iter([chunk_inputs(chunk, planned.documents)]),
                                model,
                                1,
                                input_tensor,
                                losses,
                                config,
                                cp_group_size=1,
                                is_last_stage=last,
                            )
                        total_tokens += tokens
                        live[chunk.id] = (input_tensor, output)
                        if not last:
                            sends.append((p2p.send_forward_recv_forward(output, False, None, overlap_p2p_comm=True), output))
                    else:
                        input_tensor, output = live.pop(chunk.id)
                        grad = p2p.recv_backward(shape, last)
                        began = time.perf_counter()
                        with self._metered(chunk.id):
                            input_grad = schedules.backward_step(input_tensor, output, grad, model_type, config)
                        del input_tensor, output
                        if not first:
                            sends.append((p2p.send_backward_recv_backward(input_grad, False, None, overlap_p2p_comm=True), input_grad))
                    if self.timeline is not None:
                        self.timeline.record(stage, op.kind, chunk.id, op.recompute, began, time.perf_counter())
                    self.context.leave()
                for (_, handles), _ in sends:
                    for handle in handles.values():
                        handle.wait()
            if len(self.context.cache):
                raise RuntimeError("dpp: K/V of split sequences is still cached after the step's last backward")
        finally:
            self.context.leave()
            config.recompute_num_layers = 0
            no_sync.__exit__(None, None, None)
        if config.grad_sync_func is not None:
            config.grad_sync_func(model.parameters())
        if config.finalize_model_grads_func is not None:
            config.finalize_model_grads_func([model], total_tokens if config.calculate_per_token_loss else None)
        return losses

    def _metered(self, chunk_id: int):
        return self.meter.track(chunk_id) if self.meter is not None else contextlib.nullcontext()


def dpp_forward_backward_func(step: DppStep, batches: Iterator[PlannedBatch]) -> Callable:
    """A function with the signature of megatron's `get_forward_backward_func()` result that
    trains on the next planned batch of `batches` instead of `data_iterator` (which yields the
    trainer's fixed-length samples). Forward-only calls (evaluation) keep megatron's schedule,
    with the chunk attention in its plain causal mode."""

    def forward_backward(*, forward_step_func, data_iterator, model, num_microbatches, seq_length, micro_batch_size, forward_only=False, **kwargs):
        if forward_only:
            step.context.leave()
            return get_forward_backward_func()(
                forward_step_func=forward_step_func,
                data_iterator=data_iterator,
                model=model,
                num_microbatches=num_microbatches,
                seq_length=seq_length,
                micro_batch_size=micro_batch_size,
                forward_only=True,
                **kwargs,
            )
        return step(next(batches), forward_step_func, model)

    return forward_backward
