"""`plugins=[dpp]`: dynamic pipeline parallelism for whole documents of skewed lengths.

    python -m megatron_ext.dpp.calibrate --out cost.json
    python -m megatron_ext.train experiment=none plugin=dpp parallel.pp=2 launcher.nproc=2 \
        dpp.cost_model=cost.json dpp.max_seq_len=2048

Every step reads a global batch of `dpp.docs_per_batch` whole documents (never padded), each
data-parallel replica plans its share (chunks, 1F1B order, per-stage per-chunk recompute under
`dpp.memory_budget_mb`) and runs it with the DPP schedule loop (runtime.py). The model keeps
megatron's layers; only core attention (ChunkCoreAttention) and RoPE positions change, through
the layer spec and a module swap after the model is built.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

from megatron_ext.plugin import Plugin, register_plugin

if TYPE_CHECKING:  # the plugin is registered when configs are composed: no torch import then
    from megatron_ext.training.trainer import Trainer

@dataclass
class DppConfig:
    # The longest sequence a step trains on, in tokens; longer documents follow `too_long`.
    max_seq_len: int = 1024
    # truncate | reject: what happens to a longer document (the counts are logged after the
    # first batch and at the end of training).
    too_long: str = "truncate"
    # Whole documents per global batch, over all data-parallel replicas.
    docs_per_batch: int = 16
    # Memory per pipeline stage the plan must fit: model states (as the cost model counts them)
    # plus activations. A budget no plan can meet is refused before the first step, naming the
    # smallest feasible one.
    memory_budget_mb: float = 1024.0
    # dpp, or a baseline / ablation for comparison (megatron_ext.dpp.planner.POLICIES).
    policy: str = "dpp"
    # A cost model fitted by `python -m megatron_ext.dpp.calibrate` (JSON). Required: None is
    # refused when the first batch is planned. Its activation terms are refitted to the run.
    cost_model: Optional[str] = None


def _check(cfg: DppConfig) -> None:
    from megatron_ext.dpp.planner import POLICIES

    if cfg.too_long not in ("truncate", "reject"):
        raise ValueError(f"dpp.too_long: expected truncate or reject, got {cfg.too_long!r}")
    if cfg.policy not in POLICIES:
        raise ValueError(f"dpp.policy: expected one of {POLICIES}, got {cfg.policy!r}")
    if cfg.max_seq_len < 2 or cfg.docs_per_batch < 1 or cfg.memory_budget_mb <= 0:
        raise ValueError("dpp: max_seq_len >= 2, docs_per_batch >= 1 and memory_budget_mb > 0 are required")


@register_plugin
class DppPlugin(Plugin):
    name = "dpp"
    config_class = DppConfig

    def __init__(self, cfg: Any = None) -> None:
        super().__init__(cfg if cfg is not None else DppConfig())
        _check(self.cfg)
        from megatron_ext.dpp.attention import ChunkContext
        from megatron_ext.dpp.runtime import DppStep

        self.context = ChunkContext()
        self.step = DppStep(self.context)
        self._func: Optional[Callable] = None
        self._documents = None

    def setup(self, trainer: Trainer) -> None:
        p = trainer.cfg.parallel
        if p.vpp or p.cp > 1:
            raise ValueError("dpp: interleaved pipelines (parallel.vpp) and context parallelism (parallel.cp) are not supported")
        if trainer.cfg.model.arch != "gpt":  # the chunk attention and RoPE swaps assume GPT layers
            raise ValueError(f"dpp: only model.arch=gpt is supported, not {trainer.cfg.model.arch!r}")
        if trainer.cfg.model.num_experts:
            raise ValueError("dpp: MoE models are not supported yet (model.num_experts must be unset)")

    def layer_spec(self, spec, trainer: Trainer):
        from megatron_ext.dpp.attention import dpp_layer_spec

        return dpp_layer_spec(spec, self.context)

    def after_model_built(self, model_chunks: list, trainer: Trainer) -> list:
        prepare_model(model_chunks, self.context)
        return model_chunks

    def forward_backward_func(self, trainer: Trainer) -> Optional[Callable]:
        if self._func is None:
            from megatron_ext.dpp.runtime import dpp_forward_backward_func

            batches = self._planned_batches(trainer)
            self._first = next(batches)  # plans (and refuses a hopeless budget) before training
            self._func = dpp_forward_backward_func(self.step, _prepend(self._first, batches))
        return self._func

    def _planned_batches(self, trainer: Trainer) -> Iterator:
        from megatron.core.datasets.indexed_dataset import IndexedDataset

        from megatron_ext.dpp.batch import DocumentBatches

        documents = DocumentBatches(
            IndexedDataset(_dataset_prefix(trainer)),
            self.cfg.docs_per_batch,
            self.cfg.max_seq_len,
            self.cfg.too_long,
            trainer.cfg.train.seed,
        )
        self._documents = documents
        planner = StepPlanner(self.cfg, trainer.cfg.model.num_layers, trainer.cfg.parallel.pp, _cost_model(self.cfg, trainer, self.context))
        for i, batch in enumerate(documents):
            if i == 0:
                trainer.note(documents.counts.line() + " (first batch)")
            yield planner.plan(batch)

    def on_train_end(self, trainer: Trainer) -> None:
        if self._documents is not None:
            trainer.note(self._documents.counts.line())


def _dataset_prefix(trainer: Trainer) -> str:
    """The run's (first) indexed dataset: `data.data_path`, or the default corpus."""
    from megatron_ext.data import default_corpus_prefix

    paths = [p for p in trainer.cfg.data.data_path if not _is_number(p)]
    if len(paths) > 1:
        raise ValueError("dpp: a blend of datasets is not supported yet; give one data.data_path prefix")
    if paths:
        return paths[0]
    return default_corpus_prefix(trainer._cache_dir(), trainer.cfg.data.corpus, trainer.tokenizer_spec)


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def _cost_model(cfg: DppConfig, trainer: Trainer, context):
    """The calibrated cost model, its activation terms refitted to this run's model and
    runtime (a few single-chunk forwards per stage, counted exactly)."""
    from megatron_ext.dpp.costmodel import CostModel
    from megatron_ext.dpp.memory import fit_activation_bytes

    if cfg.cost_model is None:
        raise ValueError(
            "dpp.cost_model: give a cost model fitted on this machine "
            "(python -m megatron_ext.dpp.calibrate writes one)"
        )
    return fit_activation_bytes(trainer.model, context, CostModel.from_json(cfg.cost_model))[0]


class StepPlanner:
    """Plans this data-parallel replica's share of each global batch. The first pipeline stage
    of the replica plans and sends the plan to the others, so every stage runs the same plan
    whatever the solver's timing does."""

    def __init__(self, cfg: DppConfig, num_layers: int, pp: int, cost) -> None:
        from megatron_ext.dpp.costmodel import stage_layers

        self.cfg, self.pp, self.cost = cfg, pp, cost
        self.layers = stage_layers(num_layers, pp)
        self.static = None

    def plan(self, batch: list) -> Any:
        import torch.distributed as dist
        from megatron.core import parallel_state

        from megatron_ext.dpp.batch import dp_share
        from megatron_ext.dpp.runtime import PlannedBatch, validate_plan

        lengths = [len(d) - 1 for d in batch]
        mine = dp_share(lengths, parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank())
        share = [lengths[i] for i in mine]
        group = parallel_state.get_pipeline_model_parallel_group()
        box = [self._plan(share) if parallel_state.is_pipeline_first_stage() else None]
        if self.pp > 1:
            dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
        if isinstance(box[0], str):  # every stage refuses, with the planner's message
            raise ValueError(box[0])
        validate_plan(box[0], list(self.layers))
        return PlannedBatch(box[0], tuple(batch[i] for i in mine))

    def _plan(self, lengths: list[int]):
        from megatron_ext.dpp.checkpointing import BudgetTooSmall
        from megatron_ext.dpp.planner import STATIC_POLICIES, plan_step_info, tune_static

        budget = self.cfg.memory_budget_mb * 2**20
        try:
            if self.cfg.policy in STATIC_POLICIES and self.static is None:
                self.static = tune_static(self.cfg.policy, lengths, self.cost, self.pp, budget, self.cfg.max_seq_len, self.layers)
            return plan_step_info(lengths, self.cost, self.pp, budget, self.cfg.policy, self.layers, self.static)[0]
        except BudgetTooSmall as refused:
            return str(refused)


def prepare_model(model_chunks: list, context) -> None:
    """Chunk positions for RoPE and per-chunk block recompute on each (DDP-wrapped or bare)
    GPT model chunk."""
    from megatron.core.utils import unwrap_model

    from megatron_ext.dpp.attention import use_chunk_positions
    from megatron_ext.dpp.runtime import enable_block_recompute

    for chunk in model_chunks:
        model = unwrap_model(chunk)
        use_chunk_positions(model, context)
        enable_block_recompute(model.config)


def _prepend(first, rest: Iterator) -> Iterator:
    yield first
    yield from rest
