"""`plugins=[dpp]`: dynamic pipeline parallelism for whole documents of skewed lengths.

    python -m megatron_ext.dpp.tools.calibrate --out cost.json
    python -m megatron_ext.train experiment=none plugin=dpp parallel.pp=2 launcher.nproc=2 \
        dpp.cost_model=cost.json dpp.max_seq_len=2048

Every step reads a global batch of `dpp.docs_per_batch` whole documents (never padded), each
data-parallel replica plans its share (chunks, 1F1B order, per-stage per-chunk recompute under
`dpp.memory_budget_mb`) and runs it with the DPP schedule loop (runtime/loop.py). The model keeps
megatron's layers; only core attention (ChunkCoreAttention) and RoPE positions change, through
the layer spec and a module swap after the model is built.
"""

from __future__ import annotations

import time
import traceback
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.datasets.utils import get_blend_from_list
from megatron.core.utils import unwrap_model

from megatron_ext.dpp.config import SECTION, DppConfig, check_settings, refuse_cost_model, refuse_layout
from megatron_ext.dpp.planning.costmodel import CostModel, stage_layers
from megatron_ext.dpp.planning.planner import STATIC_POLICIES, plan_step_info, tune_static
from megatron_ext.dpp.planning.recompute import BudgetTooSmall
from megatron_ext.dpp.runtime.ahead import PlanAhead
from megatron_ext.dpp.runtime.attention import ChunkContext, dpp_layer_spec, use_chunk_positions
from megatron_ext.dpp.runtime.batch import DocumentBatches, StreamPosition, dp_share
from megatron_ext.dpp.runtime.blend import DocumentBlend
from megatron_ext.dpp.runtime.loop import (
    DppStep,
    PlannedBatch,
    dpp_forward_backward_func,
    enable_block_recompute,
    validate_plan,
)
from megatron_ext.dpp.runtime.memory import fit_activation_bytes, fit_model_states, state_bytes_per_param
from megatron_ext.platform.device import current_device
from megatron_ext.plugin import Plugin, PluginContext, register_plugin


@register_plugin
class DppPlugin(Plugin):
    section = SECTION

    def __init__(self, cfg: Any = None) -> None:
        super().__init__(cfg if cfg is not None else DppConfig())
        check_settings(self.cfg)

        self.context = ChunkContext()
        self.step = DppStep(self.context)
        self._func: Optional[Callable] = None
        self._stream = None  # the PlanAhead of the run's planned batches
        self._resume = None  # the StreamPosition a checkpoint (or the layout before a reshard) carried
        self._relayout = False  # a live reshard has rebuilt the model on another layout
        self._step_began = 0.0
        self.tokens_total, self.train_seconds = 0, 0.0
        self.planning_s = self.waited_s = 0.0  # of the streams closed so far (one per layout)

    def setup(self, ctx: PluginContext) -> None:
        # A Trainer built without train.run() has not been through preflight. Its cost model
        # is checked when the first batch is planned (the calibration's own runs have none).
        refuse_layout(ctx.cfg)

    def layer_spec(self, spec, ctx: PluginContext):
        return dpp_layer_spec(spec, self.context)

    def after_model_built(self, model_chunks: list, ctx: PluginContext) -> list:
        prepare_model(model_chunks, self.context)
        if self._stream is not None:
            # A live reshard built the model of another layout: plan again for it (cost model
            # refitted, chunks and stages anew) from the first batch not yet trained.
            self._close_stream()
            self._func = None
            self._relayout = True
        return model_chunks

    def forward_backward_func(self, ctx: PluginContext) -> Optional[Callable]:
        if self._func is None:
            p = ctx.cfg.parallel
            planner = StepPlanner(self.cfg, ctx.cfg.model.num_layers, p.pp, _cost_model(self.cfg, ctx, self.context),
                                  token_multiple=p.tp if p.sequence_parallel else 1)
            self._stream = self.plan_stream(open_documents(ctx), ctx.cfg.train.seed, planner)
            first = next(self._stream)  # plans (and refuses a hopeless budget) before training
            ctx.note(self._stream.position.counts.line() + (" (first batch on the new layout)" if self._relayout else " (first batch)"))
            self._func = dpp_forward_backward_func(self.step, _prepend(first, self._stream))
        return self._func

    def plan_stream(self, dataset, seed: int, planner: "StepPlanner"):
        """The run's planned global batches (a PlanAhead), from the start or from where the
        checkpoint this run resumed from stopped."""
        documents = DocumentBatches(dataset, self.cfg.docs_per_batch, self.cfg.max_seq_len, self.cfg.too_long, seed, start=self._resume)
        return PlanAhead(documents.positioned(), planner, ahead=self.cfg.plan_ahead)

    def state_dict(self) -> dict:
        """Where the document stream continues after the last trained batch (batches planned
        ahead are not counted: a resumed run reads them again)."""
        position = (self._stream.position if self._stream is not None else None) or self._resume
        return {"stream": position.to_dict()} if position is not None else {}

    def load_state_dict(self, state: dict) -> None:
        self._resume = StreamPosition.from_dict(state["stream"]) if "stream" in state else None

    def on_step_begin(self, ctx: PluginContext, step: int) -> None:
        self._step_began = time.perf_counter()

    def on_step_end(self, ctx: PluginContext, step: int, metrics: dict) -> None:
        """The step's real tokens (document positions trained, over all replicas) for the
        trainer's tokens/s, which otherwise counts global_batch_size x seq_length."""
        if self._stream is None:  # another plugin's forward_backward_func ran the step
            return
        seconds = time.perf_counter() - self._step_began
        tokens = self._stream.tokens
        self.tokens_total += tokens
        self.train_seconds += seconds
        metrics["tokens"] = tokens

    def on_train_end(self, ctx: PluginContext) -> None:
        if self._stream is None:
            return
        ctx.note(self._stream.position.counts.line())
        self._close_stream()
        tps = self.tokens_total / self.train_seconds if self.train_seconds else 0.0
        ctx.note(
            f"dpp: {self.tokens_total} tokens of whole documents in {self.train_seconds:.2f} s of steps "
            f"({tps:,.0f} tokens/s); planning took {self.planning_s:.2f} s, of which steps waited {self.waited_s:.2f} s"
        )

    def _close_stream(self) -> None:
        """Stop planning. A stream opened next (after a reshard) starts where this one stopped;
        its planning times join the run's."""
        self._resume = self._stream.position or self._resume
        self._stream.close()
        self.planning_s += self._stream.planning_s
        self.waited_s += self._stream.waited_s
        self._stream = None


def open_documents(ctx: PluginContext):
    """The run's documents: its indexed dataset, a blend of them (`data.data_path` with or
    without weights, see runtime/blend.py), or the default corpus."""
    prefixes, weights = get_blend_from_list(ctx.data_prefixes())
    if len(prefixes) == 1:
        return IndexedDataset(prefixes[0])
    return DocumentBlend([IndexedDataset(p) for p in prefixes], weights, seed=ctx.cfg.train.seed)


def _cost_model(cfg: DppConfig, ctx: PluginContext, chunk_context: ChunkContext):
    """The calibrated cost model, its activation terms refitted to this run's model and
    runtime (a few single-chunk forwards per stage, counted exactly) and its model states
    counted on this run's model and optimizer."""
    refuse_cost_model(cfg.cost_model, ctx.cfg)
    cost = fit_activation_bytes(ctx.model, chunk_context, CostModel.from_json(cfg.cost_model))[0]
    run = ctx.cfg
    per_param = state_bytes_per_param(run.model.precision, run.optim.optimizer, run.parallel.use_distributed_optimizer,
                                      parallel_state.get_data_parallel_world_size(with_context_parallel=True))
    return fit_model_states(ctx.model, cost, per_param)


@dataclass(frozen=True)
class PlanFailure:
    """Why the first stage has no plan, sent to the replica's other stages in its place:
    `refused` for a budget no plan fits (a ValueError for the user), else the planner's
    traceback (a bug)."""

    message: str
    refused: bool = False

    def error(self, replica: int) -> Exception:
        if self.refused:
            return ValueError(self.message)
        return RuntimeError(f"dpp: the planner failed on data-parallel replica {replica}:\n{self.message}")


class StepPlanner:
    """Plans this data-parallel replica's share of each global batch. The first pipeline stage
    of the replica plans and sends the plan to the others, so every stage runs the same plan
    whatever the solver's timing does. `plan` = `agree(solve)`; `solve` communicates with no
    one, so it may run in a background thread (ahead.PlanAhead), `agree` is collective. Chunks
    are padded to multiples of `token_multiple` tokens (the TP size under sequence parallelism)."""

    def __init__(self, cfg: DppConfig, num_layers: int, pp: int, cost, token_multiple: int = 1) -> None:
        self.cfg, self.pp, self.cost, self.token_multiple = cfg, pp, cost, token_multiple
        self.layers = stage_layers(num_layers, pp)
        self.static = None

    def plan(self, batch: list) -> Any:
        return self.agree(batch, self.solve(batch))

    def solve(self, batch: list) -> tuple[list[int], Any]:
        """This replica's share of `batch` (sequence indices) and, on its first stage, the
        plan of the share or a PlanFailure (None on the other stages)."""
        lengths = [len(d) - 1 for d in batch]
        mine = dp_share(lengths, parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank())
        if not parallel_state.is_pipeline_first_stage():
            return mine, None
        return mine, self._plan([lengths[i] for i in mine])

    def agree(self, batch: list, solved: tuple[list[int], Any]) -> Any:
        """The replica's PlannedBatch: the first stage's plan on every stage, once every
        data-parallel replica has checked that all of them are on this batch and planned it."""
        mine, outcome = solved
        box = [outcome]
        if self.pp > 1:
            group = parallel_state.get_pipeline_model_parallel_group()
            dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
        _agree_across_replicas([len(d) - 1 for d in batch], box[0])
        validate_plan(box[0], list(self.layers))
        return PlannedBatch(box[0], tuple(batch[i] for i in mine))

    def _plan(self, lengths: list[int]):
        budget = self.cfg.memory_budget_mb * 2**20
        try:
            if self.cfg.policy in STATIC_POLICIES and self.static is None:
                self.static = tune_static(self.cfg.policy, lengths, self.cost, self.pp, budget, self.cfg.max_seq_len, self.layers,
                                          self.token_multiple)
            return plan_step_info(lengths, self.cost, self.pp, budget, self.cfg.policy, self.layers, self.static,
                                  token_multiple=self.token_multiple)[0]
        except BudgetTooSmall as refused:
            return PlanFailure(str(refused), refused=True)
        except Exception:  # every stage must hear of it, or the others wait for a plan forever
            return PlanFailure(traceback.format_exc())


def _agree_across_replicas(lengths: list[int], outcome: Any) -> None:
    """Every data-parallel replica raises if one of them failed to plan, or if they read
    different global batches (they would otherwise train on, or wait in gradient reductions
    for, different steps). One 3-value all-reduce per step says whether all is well; what went
    wrong is gathered only when something did."""
    group = parallel_state.get_data_parallel_group()
    mine = (tuple(lengths), outcome if isinstance(outcome, PlanFailure) else None)
    views = [mine]
    if dist.get_world_size(group) > 1:
        if _replicas_agree(mine, group):
            return
        views = [None] * dist.get_world_size(group)
        dist.all_gather_object(views, mine, group=group)
    for replica, (_, failure) in enumerate(views):
        if failure is not None:
            raise failure.error(replica)
    if any(v[0] != views[0][0] for v in views):
        raise RuntimeError(
            "dpp: data-parallel replicas read different global batches (sequence lengths "
            + "; ".join(f"replica {r}: {list(v[0])}" for r, v in enumerate(views)) + ")"
        )


def _replicas_agree(mine: tuple, group) -> bool:
    """Whether no replica of `group` failed to plan and all read the same global batch: the
    largest failure flag and the largest and smallest digest of the batch's lengths, in one
    all-reduce (a digest fits a float64 exactly)."""
    lengths, failure = mine
    digest = float(zlib.crc32(repr(lengths).encode()))
    flags = torch.tensor([float(failure is not None), digest, -digest], dtype=torch.float64, device=current_device())
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    failed, largest, negated_smallest = flags.tolist()
    return not failed and largest == -negated_smallest


def prepare_model(model_chunks: list, context) -> None:
    """Chunk positions for RoPE and per-chunk block recompute on each (DDP-wrapped or bare)
    GPT model chunk."""
    for chunk in model_chunks:
        model = unwrap_model(chunk)
        use_chunk_positions(model, context)
        enable_block_recompute(model.config)


def _prepend(first, rest: Iterator) -> Iterator:
    yield first
    yield from rest

