"""The Trainer: megatron-core's model, DDP, optimizer, scheduler and schedules in one loop.

    trainer = Trainer(cfg, plugins)   # inside an initialised torch.distributed world
    trainer.setup()                   # layout, data, model, optimizer, checkpoint resume
    summary = trainer.train()

Everything that is megatron's stays megatron's: `GPTModel`, `DistributedDataParallel`,
`get_megatron_optimizer` (Adam, DistributedOptimizer, grad clipping), `OptimizerParamScheduler`,
`get_forward_backward_func` (1F1B / interleaved), `finalize_model_grads`, dist_checkpointing.
The Trainer only wires them together and calls the plugins' hooks.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import math
import os
import time
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.datasets.utils import Split
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
from megatron.core.distributed import finalize_model_grads
from megatron.core.num_microbatches_calculator import (
    get_current_global_batch_size,
    get_num_microbatches,
    init_num_microbatches_calculator,
    reconfigure_num_microbatches_calculator,
)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.pipeline_parallel.utils import (
    is_pp_first_stage,
    is_pp_last_stage,
    is_vp_first_stage,
    is_vp_last_stage,
)
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.transformer import TransformerConfig

from megatron_ext.config.capabilities import refusals
from megatron_ext.config.mlm_namespace import RunFacts, megatron_lm_args
from megatron_ext.config.schema import Config, LoggingConfig, ParallelConfig
from megatron_ext.config.validate import ConfigError, evaluates
from megatron_ext.data import build_data_iterator, build_gpt_datasets, build_tokenizer, default_corpus_prefix
from megatron_ext.data.datasets import split_has_documents
from megatron_ext.data.mock import build_mock_datasets
from megatron_ext.data.sft import SFTDataError, build_sft_datasets
from megatron_ext.evaluation.loss import forward_only_loss
from megatron_ext.models.arch import architecture
from megatron_ext.models.gpt import padded_vocab_size
from megatron_ext.models import pretrained
from megatron_ext.models.init import init_weights_layout_independent, layout_independent
from megatron_ext.parallel.ddp import wrap_in_ddp
from megatron_ext.parallel.groups import parallel_state_sizes
from megatron_ext.parallel.layout import ParallelLayout
from megatron_ext.platform.device import current_device
from megatron_ext.platform.grad_norm_check import NonFiniteGradNorm, refuse_nonfinite_grad_norm, takes_norm_in_step
from megatron_ext.platform.moe_aux_loss_scale import set_aux_loss_scale
from megatron_ext.plugin import Plugin
from megatron_ext.plugin_context import PluginContext
from megatron_ext.checkpointing import relaid, torch_dist as ckpt
from megatron_ext.checkpointing.megatron_lm import (
    content_metadata,
    layout_key,
    optimizer_layout_problem,
    scheduler_from_samples,
    to_saved,
)
from megatron_ext.training.batch_schedule import BatchSchedule
from megatron_ext.training.flops import flops_per_iteration
from megatron_ext.training.layout_controller import LayoutController
from megatron_ext.training.manual_gc import ManualGC
from megatron_ext.training.metrics import MetricsReporter
from megatron_ext.training.numerics import (
    Fault,
    LossSpikes,
    check_grad_norm,
    gradient_norm_before_step,
    grads_finite,
    ranks_where,
)
from megatron_ext.training.mtp_loss import mtp_losses, reset_mtp_tracker
from megatron_ext.training.params_norm import params_l2_norm
from megatron_ext.training.preemption import stop_request
from megatron_ext.training.schedule import build_scheduler, counts_samples, scale_lr, scheduler_increment, train_iters
from megatron_ext.training.skipped_steps import SkippedSteps, gradient_stats
from megatron_ext.training.step import PendingLosses, forward_step, step_loss
from megatron_ext.training.timers import Timers


def _leave_as_allocated(weight: torch.Tensor) -> None:
    """An init method that draws nothing (for weights the caller fills)."""


@dataclasses.dataclass
class TrainState:
    """The counters a checkpoint carries besides tensors."""

    iteration: int = 0
    consumed_samples: int = 0
    flops: float = 0.0  # Megatron-LM's num_floating_point_operations_so_far
    skipped_samples: int = 0  # Megatron-LM's skipped_train_samples: passed over by rollbacks


class Trainer:
    """One run of megatron-core training in an initialised torch.distributed world: `setup()`
    builds the layout's process groups, the data, megatron's model (DDP-wrapped), optimizer and
    lr scheduler, and resumes from checkpoint.load; `train()` runs megatron's schedules step by
    step, evaluates, saves and stops on a pre-emption signal at a step boundary;
    `layout_controller` changes the parallel layout between two steps. The plugins' hooks are
    called in their order (`megatron_ext.plugin.Plugin`), each with that plugin's
    `plugin_context(plugin)`: what of this Trainer it may use."""

    def __init__(self, cfg: Config, plugins: list[Plugin] = ()) -> None:
        refused = refusals((p.name, p.capabilities) for p in plugins)
        if refused:  # as validation does, for a Trainer built without train.run()
            raise ConfigError("plugins", refused[0], [("plugins", r) for r in refused[1:]])
        self.cfg = cfg
        self.plugins = list(plugins)
        # What each plugin's hooks receive, one object per plugin for the whole run: it reads
        # this Trainer live, so it follows a change of layout.
        self._contexts = {id(p): PluginContext(self, p) for p in self.plugins}
        self.state = TrainState()
        self.on_cpu = current_device().type == "cpu"
        # The running layout, dp resolved for this world (None once the trainer left it).
        self.layout: Optional[ParallelLayout] = ParallelLayout.from_config(cfg.parallel, dist.get_world_size())
        # Every change of layout goes through it (layout_controller.py).
        self.layout_controller = LayoutController(self)
        self.batches = self._batch_schedule()
        if cfg.train.train_samples is not None:
            # A sample-based run trains the iterations its samples fill; everything reads them
            # there. A copy, not dataclasses.replace: that keeps only the fields of this
            # process's schema class, and a config received from another process may carry
            # plugin sections this one has not registered.
            self.cfg = copy.copy(cfg)
            self.cfg.train = dataclasses.replace(cfg.train, iters=train_iters(cfg.train, self.batches))
        self.model: list = []
        self.optimizer = None
        self.reporter: Optional[MetricsReporter] = None  # the log of `train()`, from its start
        self.model_config = None  # megatron's TransformerConfig of the current layout
        self.scheduler: Optional[OptimizerParamScheduler] = None
        self.vocab_size: Optional[int] = None
        self.tokenizer = None  # built by setup(), after the plugins' setup hooks
        self.train_ds = None
        self.resumed_from: Optional[int] = None  # the checkpoint iteration setup() loaded
        # The indexed datasets' prefixes, resolved once per run: a new layout and a trainer set
        # up from a running job's state reuse them (resolving the default corpus walks its files).
        self.data_path: Optional[list[str]] = None
        self.skipped_steps = SkippedSteps()
        self.spikes = LossSpikes(cfg.train.spike_factor, cfg.train.spike_window)
        self.pending_losses = PendingLosses()  # the step losses not read yet (read on log steps)
        self.rollbacks = 0
        self.rolled_back_to: Optional[int] = None
        # Whether this step's own gradients were finite before their data-parallel reduction.
        self._own_grads_finite: Optional[torch.Tensor] = None
        self.timers = Timers()
        # Megatron's queue of background checkpoint writes (checkpoint.async_save).
        self._async_saves = AsyncCallsQueue() if cfg.checkpoint.async_save else None

    # --- set-up ------------------------------------------------------------------------------

    def plugin_context(self, plugin: Plugin) -> PluginContext:
        """What `plugin`'s hooks receive (one of this Trainer's plugins)."""
        return self._contexts[id(plugin)]

    def setup(self) -> None:
        """Build everything: the layout's groups, the plugins' set-up, tokenizer, model,
        optimizer, scheduler and data, resumed from checkpoint.load when it holds a checkpoint."""
        self._setup()

    def _setup(self, from_state: Optional[dict] = None) -> None:
        """`setup`; `from_state`: from a running job's common state instead of checkpoint.load
        (`LayoutController.join`), the weights and optimizer states left for the caller to fill."""
        # Megatron keeps the MoE aux-loss scale process-global, shaped by its first user: a
        # backward outside megatron's schedules earlier in this process leaves a shape the
        # schedules then cannot copy into.
        set_aux_loss_scale(None)
        reset_mtp_tracker()
        self._init_layout()
        for p in self.plugins:
            p.setup(self.plugin_context(p))
        self.tokenizer_spec = pretrained.run_tokenizer_spec(self.cfg.data.tokenizer, self.cfg.model.pretrained)
        self.tokenizer = build_tokenizer(self.tokenizer_spec)
        resume = self._resume_point() if from_state is None else None
        self.resumed_from = resume[1] if resume is not None else None
        if from_state is not None:
            self.vocab_size = from_state["padded_vocab_size"]
            self.data_path = from_state["data_path"]
        else:
            self.vocab_size = self._vocab_size(resume)
        fresh = resume is None and from_state is None
        self.model, self.model_config = self.build_model(
            self.cfg.parallel, initialise=from_state is None, load_pretrained=fresh
        )
        self.optimizer = self.build_optimizer(self.model, self.model_config, self.cfg.parallel)
        self.scheduler = self._build_scheduler()
        if resume is not None:
            self._load(*resume)
        if from_state is not None:
            self._restore_common(from_state)
        self._follow_schedule()
        self._build_data()

    def _init_layout(self) -> None:
        parallel_state.initialize_model_parallel(**parallel_state_sizes(self.cfg.parallel))
        self._seed_and_batches()

    def _seed_and_batches(self) -> None:
        """What a layout needs besides its groups: the seeds and the micro-batch calculator."""
        # Same seed on every rank: with CPU initialisation each layer's full weight is drawn
        # from it and then sliced, so every layout starts from identical weights.
        torch.manual_seed(self.cfg.train.seed)
        model_parallel_cuda_manual_seed(self.cfg.train.seed)
        self.batches = self._batch_schedule()
        init_num_microbatches_calculator(
            dist.get_rank(),
            None,
            self.batches.at(self.state.consumed_samples),
            self.cfg.train.micro_batch_size,
            self.layout.dp,
        )

    def _global_batch_size(self, dp: Optional[int] = None) -> int:
        """Megatron-LM's args.global_batch_size: the batch of every step, or the last one of a
        ramp or step schedule."""
        t = self.cfg.train
        return t.global_batch_size or t.micro_batch_size * (dp or self.layout.dp)

    def _batch_schedule(self) -> BatchSchedule:
        return BatchSchedule.of(self.cfg.train, self.cfg.model.seq_length, self._global_batch_size())

    def _follow_schedule(self) -> int:
        """The global batch of the next step, at the samples consumed so far; megatron's
        micro-batch calculator is set to it."""
        batch = self.batches.at(self.state.consumed_samples)
        if batch != get_current_global_batch_size():
            reconfigure_num_microbatches_calculator(
                dist.get_rank(), None, batch, self.cfg.train.micro_batch_size, self.layout.dp
            )
        return batch

    def _batch_changes(self) -> bool:
        """Whether the next step's global batch differs from the last step's."""
        return self.batches.at(self.state.consumed_samples) != get_current_global_batch_size()

    def _resume_point(self) -> Optional[tuple[str, int, dict]]:
        """(directory, iteration, common state) of the checkpoint to resume from, if any."""
        load = self.cfg.checkpoint.load
        if not load:
            return None
        iteration = self.cfg.checkpoint.step or ckpt.latest_iteration(load)
        if iteration is None:
            if ckpt.holds_files(load):
                raise ValueError(f"checkpoint.load: {load} has no {ckpt.TRACKER}")
            return None  # `save == load` on a first run: start fresh
        if not ckpt.iteration_dir(load, iteration).is_dir():
            raise ValueError(f"checkpoint.step: {load} has no checkpoint of iteration {iteration}")
        if relaid.needs_relayout(self.cfg, load, iteration) and relaid.relaid_copy_ready(self.cfg, load, iteration):
            load = str(relaid.relaid_copy(self.cfg, load, iteration))  # the launcher's rewrite in this layout
        return load, iteration, ckpt.load_common(load, iteration)

    def _vocab_size(self, resume: Optional[tuple[str, int, dict]]) -> int:
        """The padded vocabulary is fixed for the run: a resumed run keeps its checkpoint's."""
        if resume is not None:
            saved = resume[2]["padded_vocab_size"]
            if saved % self.cfg.parallel.tp:
                raise ValueError(
                    f"parallel.tp: the checkpoint's padded vocabulary ({saved}) is not divisible "
                    f"by tp={self.cfg.parallel.tp}"
                )
            return saved
        vocab = self.cfg.model.vocab_size or self.tokenizer.vocab_size
        if vocab < self.tokenizer.vocab_size:  # its ids would index past the embedding
            raise ConfigError(
                "model.vocab_size", f"{vocab} is below the tokenizer's {self.tokenizer.vocab_size} ids: "
                f"give at least {self.tokenizer.vocab_size}, or leave it unset"
            )
        return padded_vocab_size(vocab, self.cfg.model, self.cfg.parallel.tp)

    def build_model(
        self,
        parallel: ParallelConfig,
        groups: Optional[ProcessGroupCollection] = None,
        initialise: bool = True,
        load_pretrained: bool = False,
    ) -> tuple[list, TransformerConfig]:
        """The model chunks of layout `parallel`, DDP-wrapped, and megatron's config for them.
        `groups`: the layout's process groups, when they are not megatron's current ones (the
        layout controller builds a layout beside the running one). With `initialise=False`
        the weights are left as allocated (for a caller that fills every one of them)."""
        cfg = dataclasses.replace(self.cfg, parallel=parallel)
        arch = architecture(cfg.model)
        config = arch.transformer_config(cfg.model, parallel, self.on_cpu)
        config.test_mode = cfg.train.test_mode  # a run's setting, as Megatron-LM's TrainingConfig has it
        if not initialise:
            # Not `perform_initialization=False`: megatron then also skips marking weights as
            # tensor-parallel, and the grad norm counts TP shards once instead of per rank.
            config.init_method = config.output_layer_init_method = _leave_as_allocated
            config.embedding_init_method = _leave_as_allocated
        spec = arch.spec(cfg.model, self.on_cpu)
        for p in self.plugins:
            spec = p.layer_spec(spec, self.plugin_context(p))
        pp_group = groups.pp if groups is not None else parallel_state.get_pipeline_model_parallel_group()
        chunks = []
        for vp_stage in range(parallel.vpp or 1):
            stage = vp_stage if parallel.vpp else None
            model = arch.build(
                cfg.model,
                config,
                spec,
                self.vocab_size,
                pre_process=is_pp_first_stage(pp_group) and is_vp_first_stage(vp_stage, parallel.vpp),
                post_process=is_pp_last_stage(pp_group) and is_vp_last_stage(vp_stage, parallel.vpp),
                vp_stage=stage,
                pg_collection=groups,
            )
            chunks.append(model.to(current_device()))
        if initialise and layout_independent(cfg.model, self.on_cpu):
            init_weights_layout_independent(chunks, config, cfg.train.seed)
        # Before the optimizer exists: with bf16 params it copies them into fp32 main params.
        if cfg.model.pretrained and load_pretrained:
            pretrained.load_into(chunks, cfg.model, self.vocab_size)
        for p in self.plugins:
            chunks = p.after_model_built(chunks, self.plugin_context(p))
        wrapped = wrap_in_ddp(config, parallel, chunks, groups)
        self._wire_schedule_hooks(config, wrapped, parallel)
        return wrapped, config

    def _wire_schedule_hooks(self, config, model: list, parallel: ParallelConfig) -> None:
        """What megatron's schedules call around a step: DP grad sync and its deferral."""
        config.finalize_model_grads_func = self._finalize_model_grads
        config.no_sync_func = [m.no_sync for m in model] if len(model) > 1 else model[0].no_sync
        if parallel.overlap_grad_reduce:
            config.grad_sync_func = (
                [m.start_grad_sync for m in model] if len(model) > 1 else model[0].start_grad_sync
            )

    def _finalize_model_grads(self, model: list, *args, **kwargs) -> None:
        """megatron's `finalize_model_grads` (the data-parallel reduction of the gradients among
        others), after noting whether this rank's own gradients are finite when steps are
        checked: a fault then names the ranks it arose on, not every replica the reduction spread
        it to. Not with overlap_grad_reduce, whose reduction starts during the backward pass."""
        if self._checks_numerics() and not self.cfg.parallel.overlap_grad_reduce:
            self._own_grads_finite = grads_finite(model)
        finalize_model_grads(model, *args, **kwargs)

    def build_optimizer(
        self,
        model: list,
        model_config: TransformerConfig,
        parallel: ParallelConfig,
        groups: Optional[ProcessGroupCollection] = None,
    ):
        """Megatron's optimizer over `model` (built by `build_model` for `parallel`); it scales
        the loss of `model_config`'s schedules."""
        o, cfg = self.cfg.optim, self.cfg
        config = OptimizerConfig(
            optimizer=o.optimizer,
            lr=o.lr,
            min_lr=o.min_lr,
            weight_decay=o.weight_decay,
            adam_beta1=o.adam_beta1,
            adam_beta2=o.adam_beta2,
            adam_eps=o.adam_eps,
            clip_grad=o.clip_grad,
            # megatron-core's standard param-group overrides give the embedding and output
            # layer these as their group's max_lr / min_lr, which the scheduler then follows.
            decoupled_lr=o.decoupled_lr,
            decoupled_min_lr=o.decoupled_min_lr,
            bf16=cfg.model.precision == "bf16",
            fp16=cfg.model.precision == "fp16",
            params_dtype=model_config.params_dtype,
            use_distributed_optimizer=parallel.use_distributed_optimizer,
            log_num_zeros_in_grad=cfg.logging.log_num_zeros_in_grad,
        )
        # Megatron's gloo groups only serve the legacy DP-zero checkpoint formats (ours is fully
        # reshardable), and megatron takes them from its global state only.
        optimizer = get_megatron_optimizer(
            config, model, use_gloo_process_groups=groups is None, pg_collection=groups
        )
        model_config.grad_scale_func = optimizer.scale_loss
        if self._checks_numerics() and takes_norm_in_step(optimizer):
            refuse_nonfinite_grad_norm(optimizer)  # the check rides on the norm megatron's step computes
        return optimizer

    def _build_scheduler(self) -> OptimizerParamScheduler:
        return build_scheduler(self.optimizer, self.cfg.optim, self.cfg.train, self.batches)

    def _build_data(self) -> None:
        self.train_ds, self.valid_ds = self.open_datasets()
        self.test_ds = self._open_test_dataset()
        # train.skip_train reads no training batch (the checkpoint evaluated may have consumed
        # more samples than its train.iters cover).
        self.train_iter = None if self.train_ds is None else self._iterator(self.train_ds, self.state.consumed_samples)

    def open_datasets(self, dp: Optional[int] = None) -> tuple:
        """(training, validation) datasets, sized for `dp` data-parallel ranks (default: this
        layout's); each None where the run reads none of it (no training set with skip_train,
        no validation set without evaluations). Collective: megatron's builder has the other
        ranks wait for rank 0's index files."""
        cfg = self.cfg
        gbs = self._global_batch_size(dp)
        # Every evaluation reads the same held-out batches, so one round of them is enough.
        eval_samples = cfg.train.eval_iters * gbs if evaluates(cfg.train) else 0
        batches = BatchSchedule.of(cfg.train, cfg.model.seq_length, gbs)
        # a rollback passes over samples: the data goes on that much further
        train_samples = 0 if cfg.train.skip_train else batches.samples(cfg.train.iters) + self.state.skipped_samples
        train_ds, valid_ds, _ = self._datasets((train_samples, eval_samples, 0))
        return train_ds, valid_ds

    def _open_test_dataset(self):
        """Megatron-LM's test set, evaluated once after training: `eval_iters` global batches
        of the split's test share, when it gives the test split documents."""
        cfg = self.cfg
        if not evaluates(cfg.train):
            return None
        if not (cfg.data.mock or cfg.data.sft) and not split_has_documents(self.data_path, cfg.data.split, Split.test):
            return None
        return self._datasets((0, 0, cfg.train.eval_iters * self._global_batch_size()))[2]

    def _datasets(self, num_samples: tuple[int, int, int]) -> tuple:
        """(train, valid, test) with these sample counts: megatron's mock datasets, SFT
        conversations (data.sft), or GPT datasets over data.data_path (default: the corpus,
        tokenized once into the cache)."""
        cfg = self.cfg
        if cfg.data.sft:
            try:
                return build_sft_datasets(
                    cfg.data.sft, self.tokenizer, cfg.model.seq_length, cfg.data.split, num_samples, cfg.train.seed,
                    self._cache_dir(),
                )
            except SFTDataError as e:  # one line from the ranks too (launched by torchrun or srun)
                raise ConfigError("data.sft.path", str(e)) from None
        if cfg.data.mock:
            return build_mock_datasets(
                self.tokenizer, cfg.model.seq_length, num_samples, cfg.train.seed, self._index_cache_dir()
            )
        return build_gpt_datasets(
            self.data_prefixes(),
            self.tokenizer,
            cfg.model.seq_length,
            cfg.data.split,
            num_samples,
            cfg.train.seed,
            self._index_cache_dir(),
        )

    def data_prefixes(self) -> list[str]:
        """The run's indexed datasets: data.data_path (a blend, weights included), or the
        default corpus, tokenized into the cache on first use."""
        if self.data_path is None:
            self.data_path = list(self.cfg.data.data_path) or [
                default_corpus_prefix(self._cache_dir(), self.cfg.data.corpus, self.tokenizer_spec)
            ]
        return self.data_path

    def _cache_dir(self) -> str:
        return os.path.expanduser(self.cfg.data.cache_dir)

    def _index_cache_dir(self) -> str:
        """Where megatron's GPTDataset keeps its sample indices (Megatron-LM's
        --data-cache-path is data.cache_dir)."""
        return os.path.join(self._cache_dir(), "index")

    def _iterator(self, dataset, consumed_samples: int):
        """This rank's micro-batches from `consumed_samples` on. Interleaved schedules advance
        one iterator per model chunk, each over the same micro-batches."""
        iterators = [
            build_data_iterator(
                dataset,
                self.cfg.train.micro_batch_size,
                parallel_state.get_data_parallel_rank(),
                parallel_state.get_data_parallel_world_size(),
                consumed_samples,
                self.cfg.data.num_workers,
            )
            for _ in self.model
        ]
        return iterators if len(iterators) > 1 else iterators[0]

    # --- the loop ----------------------------------------------------------------------------

    def forward_backward_func(self) -> Callable:
        """The function that runs one step's forward and backward passes over its micro-batches:
        the first plugin's `Plugin.forward_backward_func` that returns one (dpp's dynamic
        pipeline), else megatron's schedule for this layout (`get_forward_backward_func()`: no
        pipelining, 1F1B or interleaved 1F1B). It takes megatron's schedule arguments and returns
        the losses of the micro-batches on the last pipeline stage."""
        for p in self.plugins:
            func = p.forward_backward_func(self.plugin_context(p))
            if func is not None:
                return func
        return get_forward_backward_func()

    def train_step(self) -> dict[str, Any]:
        """One optimizer step: the global batch of this step (following a batch-size schedule),
        zeroed gradients, the forward and backward passes of its micro-batches
        (`forward_backward_func`), the optimizer step (skipped, and counted, on an fp16 overflow)
        and the lr scheduler's. Advances `state.iteration` and `state.consumed_samples`. Returns
        the step's metrics, the same on every rank: lr, loss_scale, skipped_iterations, global_batch_size and consumed_samples; grad_norm,
        and num_zeros_in_grad when it is on, except on a step the loss scaler skipped (see
        `gradient_stats`); the MTP losses when those are on. The step's loss is left pending on
        the device (`pending_losses`): `train()` reads it, or `train_step_with_loss`. Collective:
        every rank calls it."""
        global_batch = self._follow_schedule()
        self._own_grads_finite = None  # noted by _finalize_model_grads, where a schedule calls it
        for m in self.model:
            m.zero_grad_buffer()
        self.optimizer.zero_grad()
        losses = self.timers.timed("forward-backward", self.forward_backward_func())(
            forward_step_func=forward_step,
            data_iterator=self.train_iter,
            model=self.model,
            num_microbatches=get_num_microbatches(),
            seq_length=self.cfg.model.seq_length,
            micro_batch_size=self.cfg.train.micro_batch_size,
            forward_only=False,
        )
        # fp16's dynamic scale is a device tensor (a host sync to read); every other precision's is 1.
        loss_scale = self.optimizer.get_loss_scale().item() if self.cfg.model.precision == "fp16" else 1.0
        try:
            if self._checks_numerics() and not takes_norm_in_step(self.optimizer):
                check_grad_norm(gradient_norm_before_step(self.optimizer))
            update_ok, grad_norm, num_zeros_in_grad = self.timers.timed("optimizer", self.optimizer.step)()
        except NonFiniteGradNorm as e:
            # where it was not noted before the reduction, the gradients as reduced
            own_finite = self._own_grads_finite if self._own_grads_finite is not None else grads_finite(self.model)
            raise Fault(self.state.iteration + 1, str(e), self.state.consumed_samples + global_batch,
                        ranks_where(not bool(own_finite))) from None
        # Megatron-LM's skipped iteration: counted, with no step of the schedule (skipped_steps.py).
        if update_ok:
            self.scheduler.step(increment=scheduler_increment(self.cfg.train, self.batches, global_batch))
        self.state.iteration += 1
        self.state.consumed_samples += global_batch
        self.state.flops += flops_per_iteration(self.cfg.model, self.vocab_size, global_batch) or 0.0
        skipped = self.skipped_steps.record(self.state.iteration, update_ok, loss_scale, self.optimizer)
        if skipped is not None:
            self.note(skipped)
        self.pending_losses.add(self.state.iteration, step_loss(losses))
        metrics = {
            "lr": self.optimizer.param_groups[0]["lr"],
            "loss_scale": loss_scale,
            "skipped_iterations": self.skipped_steps.total,
            "global_batch_size": global_batch,
            "consumed_samples": self.state.consumed_samples,
        }
        zeros = num_zeros_in_grad if self.cfg.logging.log_num_zeros_in_grad else None
        metrics.update(gradient_stats(grad_norm, zeros))
        if self.cfg.model.mtp_num_layers:
            metrics.update(mtp_losses(self.cfg.model.mtp_num_layers, get_num_microbatches()))
        return metrics

    def train_step_with_loss(self) -> dict[str, Any]:
        """`train_step`, its loss read at once into `metrics["loss"]` (a host sync): for callers
        that drive the steps one by one rather than through `train()`. Collective."""
        metrics = self.train_step()
        self._read_losses(metrics)
        return metrics

    def _reads_loss_at(self, iteration: int) -> bool:
        """Whether the losses pending are read after step `iteration` (the same answer on every
        rank): on log steps; every step where something checks or uses each step's loss (the NaN
        check, as Megatron-LM's reads it every step; TensorBoard or W&B, as Megatron-LM writes them
        every step; the spike check; a plugin that reads it or moves the layout,
        `Plugin.needs_step_loss`)."""
        log = self.cfg.logging
        return (
            iteration % log.log_interval == 0
            or self._checks_numerics()
            or bool(log.tensorboard_dir or log.wandb_project)
            or self.cfg.train.spike_factor is not None
            or any(p.needs_step_loss for p in self.plugins)
        )

    def _read_losses(self, metrics: dict) -> None:
        """Read the pending step losses into the report, the newest into `metrics["loss"]`, and
        check them: a non-finite loss, or one above the spike factor, is a Fault (a non-finite
        one names the ranks whose own loss it was). Collective."""
        losses = self.pending_losses.read()
        if not losses:
            return
        if self.reporter is not None:
            self.reporter.record_losses(losses)
        metrics["loss"] = losses[max(losses)]
        if not (self._checks_numerics() or self.cfg.train.spike_factor is not None):
            return
        for iteration, loss in losses.items():
            try:
                self.spikes.check(iteration, loss, self.state.consumed_samples)
            except Fault as fault:
                if not math.isfinite(loss):  # every rank is here (the loss is broadcast)
                    fault.ranks = ranks_where(not self.pending_losses.finite_on_this_rank(iteration))
                raise

    def _checks_numerics(self) -> bool:
        """Megatron-LM's NaN check; with fp16 the loss scaler skips non-finite steps itself."""
        return self.cfg.train.check_for_nan and self.cfg.model.precision != "fp16"

    def _rollback_target(self) -> Optional[int]:
        """The newest checkpoint under checkpoint.save; one further back when the run failed again
        from it before saving a newer one (its state leads to the fault)."""
        root = self.cfg.checkpoint.save
        latest = ckpt.latest_iteration(root) if root else None
        if latest is None:
            return None
        saved = [i for i in ckpt.saved_iterations(root) if i <= latest]
        if saved and saved[-1] == self.rolled_back_to:
            saved.pop()
        return saved[-1] if saved else None

    def _stopped_by(self, fault: Fault, reporter: MetricsReporter) -> dict:
        """The summary of a run a fault stopped: nothing saved after it, the newest checkpoint
        named (the last good state), under "fault" for the entry point to report."""
        root = self.cfg.checkpoint.save
        latest = ckpt.latest_iteration(root) if root else None
        kept = f"the newest checkpoint is iteration {latest} of {root}" if latest is not None else "no checkpoint was saved"
        line = f"{fault}: stopped without saving ({kept})"
        reporter.note(line)
        for p in self.plugins:
            p.on_train_end(self.plugin_context(p))
        return {**reporter.summary(None, None, None), "fault": line}

    def _roll_back(self, fault: Fault) -> bool:
        """Under nan_policy=rollback: back to the newest checkpoint under checkpoint.save, the
        samples up to the fault's passed over, the lr scaled; False where that cannot be (another
        policy, no checkpoint, max_rollbacks reached). Collective."""
        t, root = self.cfg.train, self.cfg.checkpoint.save
        self._finalize_saves()
        target = self._rollback_target()
        if t.nan_policy != "rollback" or self.rollbacks >= t.max_rollbacks or target is None:
            return False
        common = ckpt.load_common(root, target)
        ckpt.load_checkpoint(root, target, self.model, self.optimizer, load_rng=common["layout"] == self._layout_key())
        self.rolled_back_to = target
        self.scheduler = self._build_scheduler()  # megatron's load_state_dict adds the steps loaded to its own
        self._restore_common(common)
        skipped = fault.consumed_samples - self.state.consumed_samples
        self.state.skipped_samples += skipped
        self.state.consumed_samples = fault.consumed_samples
        scale_lr(self.scheduler, t.rollback_lr_scale)
        self.train_ds, self.valid_ds = self.open_datasets()
        self.train_iter = self._iterator(self.train_ds, self.state.consumed_samples)
        self.spikes.clear()
        self.rollbacks += 1
        self.note(
            f"rollback {self.rollbacks}/{t.max_rollbacks}: {fault}; back to iteration {target}, samples "
            f"{fault.consumed_samples - skipped}-{fault.consumed_samples - 1} skipped, lr x{t.rollback_lr_scale:g}"
        )
        return True

    def evaluate(self, dataset=None) -> Optional[float]:
        """Loss on a held-out split (default: validation): the same `eval_iters` global
        batches every time (Megatron-LM's global batch, whatever a schedule trains at)."""
        dataset = self.valid_ds if dataset is None else dataset
        if dataset is None or not self.cfg.train.eval_iters:
            return None
        return forward_only_loss(
            self.model,
            self._iterator(dataset, 0),
            self._global_batch_size() // (self.cfg.train.micro_batch_size * self.layout.dp) * self.cfg.train.eval_iters,
            self.cfg.model.seq_length,
            self.cfg.train.micro_batch_size,
            self.forward_backward_func(),
        )

    def train(self) -> dict:
        """The training loop after `setup()`: from `state.iteration` up to `train.iters` (or
        `train.exit_interval` more), each step between the plugins' `on_step_begin` and
        `on_step_end`, logged, evaluated every `train.eval_interval` and saved every
        `checkpoint.interval`; a pre-emption signal the ranks agree on stops it after the current
        step. At the end: the final checkpoint (with `checkpoint.save`), the final evaluation on
        the validation and test sets (when trained to the end), the plugins' `on_train_end`.
        With `train.skip_train` only that final evaluation runs (`_evaluate_only`).
        Returns the run summary: final_loss, eval_loss, test_loss, tokens, train_seconds,
        tokens_per_s, plus the per-step losses and the log's notes; an empty dict on a rank a
        plugin moved out of the job."""
        cfg = self.cfg
        # Rank 0 reports: it is in every world a worker pool forms (the loss is on every rank).
        self.reporter = reporter = MetricsReporter(
            self._logging(),
            cfg.train.iters,
            self.state.iteration,
            dist.get_rank() == 0,
            self.layout.world,
        )
        self._note_restart()
        if cfg.train.skip_train:
            return self._evaluate_only()
        if cfg.train.nan_policy == "rollback" and cfg.checkpoint.save and ckpt.latest_iteration(cfg.checkpoint.save) is None:
            self.save()  # the starting point: a state to roll back to before the first interval's save
        stop_at = cfg.train.iters
        if cfg.train.exit_interval:
            stop_at = min(stop_at, self.state.iteration + cfg.train.exit_interval)
        metrics: dict = {}
        eval_loss, evaluated_at = None, None
        fault: Optional[Fault] = None  # the one that stopped the run
        with stop_request() as stop, ManualGC(cfg.train).training() as collector:
            while self.state.iteration < stop_at:
                self._save_before_batch_change()
                for p in self.plugins:
                    p.on_step_begin(self.plugin_context(p), self.state.iteration + 1)
                if self.layout is None:  # a hook moved the job to a layout without this rank
                    return {}
                start = time.perf_counter()
                try:
                    metrics = self.train_step()
                    if self._reads_loss_at(self.state.iteration) or self.state.iteration >= stop_at:
                        self._read_losses(metrics)
                except Fault as raised:
                    self._read_losses({})  # the steps before the fault's, into the report
                    if self._roll_back(raised):
                        continue
                    fault = raised
                    break
                seconds = time.perf_counter() - start
                if cfg.logging.log_params_norm:
                    metrics["params_norm"] = params_l2_norm(self.model)
                for p in self.plugins:
                    p.on_step_end(self.plugin_context(p), self.state.iteration, metrics)
                # A plugin that trains batches of other sizes (dpp) says how many tokens it did.
                batch = metrics["global_batch_size"]
                reporter.step(
                    self.state.iteration, metrics, metrics.pop("tokens", batch * cfg.model.seq_length), seconds,
                    self.timers.pop(), flops_per_iteration(cfg.model, self.vocab_size, batch),
                )
                collector.after_step(self.state.iteration)
                if evaluates(cfg.train) and self.state.iteration % cfg.train.eval_interval == 0:
                    with collector.evaluation():
                        eval_loss, evaluated_at = self.evaluate(), self.state.iteration
                    reporter.eval(self.state.iteration, eval_loss)
                self._finalize_saves(blocking=False)
                if self._due_for_checkpoint():
                    self.save()
                if stop.agreed():
                    reporter.note(f"signal received: stopping after iteration {self.state.iteration}")
                    break
            self._finalize_saves()  # a save of this iteration still being written counts once published
            if fault is None:
                self._read_losses(metrics)  # of the steps a signal stopped after
            if fault is not None:
                return self._stopped_by(fault, reporter)
            if cfg.checkpoint.save and not self._saved_at_current_iteration():
                self.save()
            test_loss = None
            if self.state.iteration >= cfg.train.iters and evaluates(cfg.train):
                with collector.evaluation():
                    eval_loss, test_loss = self._final_evaluation(eval_loss, evaluated_at)
            self._finalize_saves()  # the final save, written while the final evaluation ran
            for p in self.plugins:
                p.on_train_end(self.plugin_context(p))
            return reporter.summary(metrics.get("loss"), eval_loss, test_loss)

    def _logging(self) -> LoggingConfig:
        """logging, less what a skip_train run leaves alone: Megatron-LM writes its evaluation
        to neither TensorBoard nor W&B, whose curves are the training run's (a point there
        would sit beside the one that run logged), and there is no step to show progress of."""
        if not self.cfg.train.skip_train:
            return self.cfg.logging
        return dataclasses.replace(self.cfg.logging, progress_bar=False, tensorboard_dir=None, wandb_project=None)

    def _evaluate_only(self) -> dict:
        """Megatron-LM's --skip-train: the final evaluation of the weights as set up, at the
        iteration they were saved at, with no step before it and no save after it; no plugin's
        `on_train_end` either (nothing was trained to export)."""
        if not evaluates(self.cfg.train):
            self.note("skipping training (train.skip_train) with train.eval_iters=0: nothing to evaluate")
            return self.reporter.summary(None, None)
        self.note(f"skipping training (train.skip_train): evaluating the weights of iteration {self.state.iteration}")
        eval_loss, test_loss = self._final_evaluation(None, None)
        return self.reporter.summary(None, eval_loss, test_loss)

    def _final_evaluation(
        self, eval_loss: Optional[float], evaluated_at: Optional[int]
    ) -> tuple[Optional[float], Optional[float]]:
        """Megatron-LM's evaluation after a run that trained to the end (not one stopped by a
        signal or exit_interval): `eval_iters` batches of the validation set (the periodic
        evaluation's, when it just ran at this iteration: the same batches, the same weights)
        and of the test set when the split has one."""
        if evaluated_at != self.state.iteration:
            eval_loss = self.evaluate()
            self.reporter.eval(self.state.iteration, eval_loss)
        test_loss = self.evaluate(self.test_ds) if self.test_ds is not None else None
        if test_loss is not None:
            self.reporter.eval(self.state.iteration, test_loss, split="test")
        return eval_loss, test_loss

    def _note_restart(self) -> None:
        """Say so when the launcher restarted the job after a worker failed."""
        restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        if restarts:
            where = (
                f"the checkpoint of iteration {self.resumed_from}"
                if self.resumed_from is not None
                else "the start: there was no checkpoint"
            )
            self.note(f"restart {restarts} of the job after a worker failed: resumed from {where}")

    # --- checkpoints ---------------------------------------------------------------------------

    def _save_before_batch_change(self) -> None:
        """Megatron-LM saves a checkpoint before the first step of a new global batch."""
        c = self.cfg.checkpoint
        if c.save and self.state.iteration and self._batch_changes() and not self._saved_at_current_iteration():
            self.save()

    def _due_for_checkpoint(self) -> bool:
        c = self.cfg.checkpoint
        return bool(c.save and c.interval and self.state.iteration % c.interval == 0)

    def _saved_at_current_iteration(self) -> bool:
        return ckpt.latest_iteration(self.cfg.checkpoint.save) == self.state.iteration

    def common_state(self) -> dict[str, Any]:
        """What a checkpoint holds besides the model and optimizer tensors, the same on every
        rank: the iteration, consumed samples, operations so far, lr scheduler state, padded
        vocabulary size, tokenizer, data path, the layout keys that decide the RNG streams,
        each plugin's `state_dict()` and the whole config."""
        return {
            "iteration": self.state.iteration,
            "consumed_samples": self.state.consumed_samples,
            "flops": self.state.flops,
            "skipped_samples": self.state.skipped_samples,
            "scheduler": self.scheduler.state_dict(),
            "padded_vocab_size": self.vocab_size,
            "tokenizer": self.tokenizer_spec,
            "data_path": self.data_path,
            "layout": self._layout_key(),
            "plugins": {p.name: p.state_dict() for p in self.plugins},
            "config": dataclasses.asdict(self.cfg),
        }

    def megatron_lm_args(self) -> argparse.Namespace:
        """This run as Megatron-LM's `args`, what its checkpoints carry (config/mlm_namespace.py)."""
        return megatron_lm_args(
            self.cfg,
            RunFacts(
                world_size=self.layout.world,
                data_parallel_size=self.layout.dp,
                padded_vocab_size=self.vocab_size,
                global_batch_size=self._global_batch_size(),
                iteration=self.state.iteration,
                consumed_train_samples=self.state.consumed_samples,
                skipped_train_samples=self.state.skipped_samples,
            ),
        )

    def _samples_per_step(self) -> int:
        """What one step of this run's scheduler is in Megatron-LM's samples (megatron_lm.py)."""
        return 1 if counts_samples(self.cfg.train, self.batches) else self._global_batch_size()

    def _layout_key(self) -> dict:
        """What decides which model-parallel RNG stream each rank has."""
        return layout_key(self.cfg.parallel)

    def save(self) -> None:
        """Save a checkpoint of this iteration under `checkpoint.save` (megatron's
        dist_checkpointing: model, distributed optimizer state unless `save_optim` is false, the
        RNG streams unless `save_rng` is false, and `common_state()`), keeping the
        `checkpoint.keep_last` newest. With `checkpoint.async_save` the files are written in the
        background and published once every rank is done. Collective: every rank calls it."""
        # An async save first waits for the one before it: a save clears unpublished staging.
        self._finalize_saves()
        c = self.cfg.checkpoint
        common = self.common_state()
        if not c.save_optim:  # Megatron-LM's --no-save-optim leaves out the lr schedule too
            del common["scheduler"]
        ckpt.save_checkpoint(
            c.save,
            self.state.iteration,
            self.model,
            self.optimizer if c.save_optim else None,
            to_saved(common, self.megatron_lm_args(), self._samples_per_step()),
            content_metadata(self.cfg.parallel.use_distributed_optimizer, fully_reshardable=True),
            keep_last=c.keep_last,
            async_queue=self._async_saves,
            save_rng=c.save_rng,
        )

    def _finalize_saves(self, blocking: bool = True) -> None:
        """Publish the async saves whose writes are done on every rank; `blocking`: wait for
        all of them (collective, like megatron's finalisation)."""
        if self._async_saves is not None:
            self._async_saves.maybe_finalize_async_calls(blocking=blocking)

    def _load(self, root: str, iteration: int, common: dict) -> None:
        # RNG policy: restored when the TP x PP layout is the one that saved it (bitwise
        # continuation); in another layout the per-rank streams do not correspond, so they keep
        # the fresh seeding of this run.
        # checkpoint.load_optim / load_rng / finetune choose what else comes back, as Megatron-LM's
        # load_checkpoint does for --no-load-optim / --no-load-rng / --finetune.
        c = self.cfg.checkpoint
        same_layout = common["layout"] == self._layout_key()
        load_optim = c.load_optim and not c.finetune
        problem = optimizer_layout_problem(common, self._layout_key()) if load_optim else None
        if problem is not None:
            raise ConfigError("checkpoint.load", f"{ckpt.iteration_dir(root, iteration)}: {problem}")
        ckpt.load_checkpoint(
            root,
            iteration,
            self.model,
            self.optimizer if load_optim else None,
            load_rng=same_layout and c.load_rng and not c.finetune,
        )
        if not load_optim:
            # fp16/bf16: the fp32 main params were copied from the weights before they were loaded.
            self.optimizer.reload_model_params()
        if not c.finetune:
            self._restore_common(common, load_scheduler=load_optim)

    def _restore_common(self, common: dict, load_scheduler: bool = True) -> None:
        """Counters, scheduler (unless not `load_scheduler`) and plugin states from
        `common_state()` or a checkpoint's `load_common`."""
        self.state = TrainState(
            common["iteration"], common["consumed_samples"], common.get("flops", 0.0), common.get("skipped_samples", 0)
        )
        if load_scheduler:
            scheduler = common.get("scheduler")
            if "scheduler_samples" in common:
                scheduler = scheduler_from_samples(common["scheduler_samples"], self._samples_per_step())
            self.scheduler.load_state_dict(scheduler)
        for plugin in self.plugins:
            plugin.load_state_dict(common["plugins"].get(plugin.name, {}))

    def note(self, line: str) -> None:
        """A line in the run's log, printed once by the reporting rank (rank 0) and kept in the
        run summary's `notes`: how plugins say what they did (a reshard, an export). Before
        `train()` starts (no summary yet) rank 0 prints it."""
        if self.reporter is not None:
            self.reporter.note(line)
        elif dist.get_rank() == 0:
            print(line, flush=True)

    # --- the end of the run on this rank -----------------------------------------------------

    def close(self) -> None:
        """End this run on this rank: leave its layout (`LayoutController.release`)."""
        self.layout_controller.release()
