"""`plugins=[elastic]`: one post-training run that yields nested submodels of the model.

    python -m megatron_ext.train plugin=elastic model.pretrained=... 'elastic.budgets=[1.0,0.75,0.5]'

Before the first step the parent is calibrated (a few training batches, forward only), every
axis is reordered by importance, and a frozen teacher copy of the reordered parent is built
beside the student on every rank. Each step then runs megatron's own schedule with the
distillation forward step (`distill.py`): per micro-batch (`budget_draw=micro_batch`, the default)
a budget is drawn and the router samples its sizes, or per sample (`budget_draw=sample`) a budget
is drawn, the router picks each budget's sizes and the student runs each micro-batch's budget
groups at their sizes (`grouped.py`); the student learns the teacher's distribution on the tokens
`distill_tokens` names. The data may be `data=sft` conversations: every forward the plugin runs
(calibration, the quality start, the teacher, the student) takes the batch's attention mask, so
the conversations of a packed sample attend each to itself. The router
has its own Adam and learning rate and steps after the model's optimizer; its gradients are
summed over the data-parallel replicas. Evaluation runs the full model. At the end, with
`export_dir`, the nested checkpoint (every budget at once; under TP and PP joined from the ranks'
pieces onto rank 0 as one process holds the model, `gather.py`) is written, plus `report.json`
(per step: the loss, the budget of every sample in global sample order, the sizes trained at: per
budget with budget_draw=sample, per micro-batch in global micro-batch order with micro_batch; the
router's choices after the step).

Layouts: data parallelism of any size (DP=2 is checked equal to one process), tensor
parallelism of GPT and hybrid parents, MoE ones with sequence parallelism (TP=2 is checked
equal to TP=1, nested checkpoint included: each rank slices its block of the global prefix, or its own Mamba
groups' heads, the losses are vocabulary-parallel, the router's gradient is summed over the TP
and DP ranks) and pipeline parallelism of GPT and hybrid parents (PP=2 is checked equal to one
process, nested checkpoint included: `pipeline.py`; each stage holds its layers' axes under their
global layer numbers and knows the whole model's axis kinds, which differ between the stages of a
hybrid; the teacher is pipelined like the student and runs forward-only through megatron's
schedule before the student's, the last stage keeps its logits; a micro-batch of several budgets
sends its groups' activations zero-padded to the widest group's hidden size). Under
expert parallelism the EP ranks are data-parallel replicas whose experts run each other's tokens,
so they draw their budgets and router samples together: `budget_share` consecutive global
micro-batches draw as one, a multiple of ep (`expert_parallel.py`; EP=2, TP=2 x EP=2 and PP=2 x
EP=2 are checked equal to one process with the same budget_share, nested checkpoint included;
the MoE axes and the export work under EP: `moe_axes.py`, `gather.py`).
Under virtual pipeline stages (GPT parents: megatron's interleaved schedule) a rank's space
holds the axes of all its chunks (one hidden axis through them, layer axes under megatron's global
layer numbers), the teacher has the same chunks, each chunk draws each micro-batch's budget and
sizes (keyed by the micro-batch) and sends the full hidden size zero-padded (`grouped.py`: megatron
crosses the shapes of a step that sends both ways at pp=2); PP=2 x VPP=2 is checked equal to one
process, nested checkpoint included (to the bit with untied embeddings). A resumed run rebuilds
the teacher from the parent's source and the
stored orders (every stage's) and continues the uninterrupted run (checked at one process and
for the hybrid at PP=2 and the MoE hybrid at EP=2: the same budgets, losses, router choices and
weights). With `fp8`, the
student distils with FP8 QAD and the nested checkpoint is written in FP8 (`fp8.py`,
`slicing.slice_nested_fp8`); under TP each per-tensor scale is the whole logical tensor's (the
shards' amax reduced with MAX over the weight's TP group) and the FP8 codes are the joined
weights quantised with it, so TP=2 trains and writes what one process does (checked for GPT,
dense and MoE hybrid parents, the MoE one also at EP=2 and TP=2 x EP=2: an expert's scale is
reduced over its expert TP group, and its codes and scale join under its global index), and so
does PP=2 (checked for GPT: a stage's scales are its own layers', gathered under their global
numbers) and PP=2 x VPP=2 (checked for GPT: every chunk of a rank is quantised, and each chunk's
codes and scales are gathered under its layers' global numbers). Each scale is computed once per
call of megatron's schedule, a step's every micro-batch or an evaluation (`fp8.fixed_scales`,
one window over all the rank's chunks), not at every read of the weight.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Optional

from megatron_ext.elastic.config import SECTION
from megatron_ext.plugin import Plugin, PluginContext, register_plugin


def default_grid(space, choices: int) -> dict[str, list[int]]:
    """Per kind: about `choices` sizes from half to the full width, in steps of the kind's
    quantum (of 8 quanta on wide axes, so matmul shapes stay aligned). Where the parent's hidden
    size is a multiple of every head count of the grid, so is every hidden size of the grid: a
    LLaMA config (transformers') refuses a hidden size that is not a multiple of the heads, so
    otherwise an exported submodel would not load there."""
    grid = {}
    for kind in space.kinds:
        full, q = space.full_of(kind), space.quantum_of(kind)
        align = q * 8 if full // q >= 64 else q
        low = max(align, (full // 2) // align * align)
        step = max(align, ((full - low) // max(choices - 1, 1)) // align * align)
        grid[kind] = sorted({*range(low, full + 1, step), full})
    if {"hidden", "heads"} <= set(grid) and space.full_of("hidden") % math.lcm(*grid["heads"]) == 0:
        grid["hidden"] = _multiples_of(grid["hidden"], math.lcm(*grid["heads"]))
    return grid


def _multiples_of(sizes: list[int], unit: int) -> list[int]:
    """`sizes` moved down to multiples of `unit` (the largest, a multiple already, stays)."""
    return sorted({max(unit, s // unit * unit) for s in sizes})


@register_plugin
class ElasticPlugin(Plugin):
    section = SECTION
    needs_step_loss = True

    def setup(self, ctx: PluginContext) -> None:
        p = ctx.cfg.parallel
        if p.cp > 1:  # the distiller's batches and KD loss are whole sequences
            raise ValueError("elastic: context parallelism (parallel.cp) is not supported")
        # heavy: torch/megatron, when a worker uses the plugin (not when the launcher builds it)
        from megatron_ext.elastic.distill import check_budget_draw, check_budget_share
        from megatron_ext.elastic.expert_parallel import check_budget_share_for_ep

        check_budget_draw(self.cfg.budget_draw)
        check_budget_share(self.cfg.budget_share)
        check_budget_share_for_ep(self.cfg.budget_share, p.ep)
        self.ready = False
        self.orders: Optional[dict] = None
        self.router_state: Optional[dict] = None
        self.history: list[dict] = []

    def after_model_built(self, model_chunks: list, ctx: PluginContext) -> list:
        # heavy: torch/megatron, when a worker uses the plugin (not when the launcher builds it)
        from megatron_ext.elastic.distill import CurriculumConfig
        from megatron_ext.elastic.router import BudgetRouter, RouterConfig, check_budgets, check_grid
        from megatron_ext.elastic.space import ElasticSpace

        c = self.cfg
        if ctx.cfg.parallel.pp > 1 and not ctx.cfg.parallel.vpp:
            # The micro-batch's (widest) hidden size is the shape one stage sends the next:
            # megatron's p2p must communicate shapes first. (Under VPP every chunk sends the full
            # hidden size instead: `grouped.py` says why.)
            for chunk in model_chunks:
                chunk.config.variable_seq_lengths = True
        self.space = ElasticSpace(model_chunks)  # every chunk's axes (virtual pipeline stages)
        self.grid = {k: [int(v) for v in vs] for k, vs in (c.grid or {}).items()} or default_grid(
            self.space, c.default_choices
        )
        check_grid(self.space, self.grid)  # bad input: refused before anything trains
        check_budgets(self.space, self.grid, list(c.budgets), c.tolerance, c.cost)
        if c.skew is not None and len(c.skew) != len(c.budgets):
            raise ValueError(f"elastic.skew has {len(c.skew)} entries for {len(c.budgets)} budgets")
        self.router = BudgetRouter(
            list(c.budgets),
            self.grid,
            RouterConfig(hidden=c.router_hidden, lr=c.router_lr, anneal_steps=c.anneal_steps, cost=c.cost),
            seed=ctx.cfg.train.seed,
        )
        self.curriculum = CurriculumConfig(
            budgets=list(c.budgets),
            uniform_steps=c.uniform_steps,
            skew=list(c.skew) if c.skew is not None else None,
            temperature=c.temperature,
            ce_weight=c.ce_weight,
            seed=ctx.cfg.train.seed,
            budget_draw=c.budget_draw,
            budget_share=c.budget_share,
            distill_tokens=c.distill_tokens,
        )
        return model_chunks

    # --- before the first step ------------------------------------------------------------------

    def _prepare(self, ctx: PluginContext) -> None:
        import torch  # heavy: torch/megatron, when a worker uses the plugin (not when the launcher builds it)
        from megatron.core import parallel_state

        from megatron_ext.elastic.distill import Distiller
        from megatron_ext.elastic.expert_parallel import check_peers_share
        from megatron_ext.elastic.importance import calibrate
        from megatron_ext.elastic.permute import reorder
        from megatron_ext.elastic.pipeline import merge_stages

        dp_group = parallel_state.get_data_parallel_group()
        dp_rank, dp = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
        check_peers_share(self.cfg.budget_share, dp_rank, dp, parallel_state.get_expert_model_parallel_group())
        fresh = self.orders is None  # a resumed run restored the reordered weights and the router
        rounds = self._calibration_rounds(ctx) if fresh else []
        if fresh:
            calibrate(self.space.axes, rounds, self._full_forward(ctx), dp_group)
            # Every stage's: a checkpoint keeps rank 0's plugin state, and a resumed stage
            # rebuilds its teacher from it.
            self.orders = merge_stages(reorder(self.space.axes))
        teacher = self._build_teacher(ctx)
        # Megatron's schedules call the config's end-of-step hook after every training step (not
        # in forward-only runs); set once, it first brings the model back to its full size.
        config = self.space.model.config
        if config.finalize_model_grads_func is not None:
            config.finalize_model_grads_func = self._at_full_size(config.finalize_model_grads_func)
        if self.cfg.fp8:
            # heavy: torch/megatron, when a worker uses the plugin (not when the launcher builds it)
            from megatron_ext.elastic import fp8

            for chunk in self.space.chunks:  # every chunk of the rank (virtual pipeline stages)
                fp8.enable(chunk)
        self.router_optimizer = torch.optim.Adam(self.router.parameters(), lr=self.cfg.router_lr)
        if self.router_state is not None:
            self.router.load_state_dict(self.router_state["router"])
            self.router_optimizer.load_state_dict(self.router_state["optimizer"])
        self.distiller = Distiller(
            self.space,
            teacher,
            self.router,
            self.curriculum,
            ctx.tokenizer.vocab_size if ctx.cfg.model.vocab_size is None else ctx.cfg.model.vocab_size,
            # Megatron's sampler deals micro-batches to the replicas in turn: rank r's m-th is
            # the global batch's (m * dp + r)-th, so every layout gives a sample one global index
            # (hence one draw).
            micro_batch_index=lambda m: m * dp + dp_rank,
            send_width=ctx.model_config.hidden_size if ctx.cfg.parallel.vpp else None,
        )
        if fresh:
            self._start_router(ctx, rounds)
        self.ready = True

    def _start_router(self, ctx: PluginContext, rounds: list[list]) -> None:
        """Fit the router before the first step, identically on every rank: to the budgets' costs
        alone (`router_start=cost`: seeded draws, no model forward), or to each budget's grid
        submodel of least KD loss to the parent on the calibration batches, pruned
        (`router_start=quality`, size_search.py), as Minitron picks its candidates."""
        # heavy: torch/megatron, when a worker uses the plugin (not when the launcher builds it)
        from megatron_ext.elastic.size_search import best_sizes

        c = self.cfg
        if c.router_start == "cost":
            self.distiller.warm_up_router(c.router_warmup_steps)
            return
        targets = best_sizes(self.space, self.grid, list(c.budgets), c.tolerance, self._kd_to_parent(ctx, rounds), c.cost)
        self.distiller.start_router_at(targets, c.router_warmup_steps)
        chosen = ", ".join(f"{b:g}: {sizes}" for b, sizes in zip(c.budgets, targets))
        ctx.note(f"elastic: each budget starts at its pruned submodel closest to the parent ({chosen})")

    def _kd_to_parent(self, ctx: PluginContext, rounds: list[list]):
        """sizes -> the student's mean KD loss per token to the teacher at those sizes on the
        calibration `rounds` (every replica's share; collective, the same value on every rank)."""
        import torch  # heavy: torch/megatron, when a worker uses the plugin (not when the launcher builds it)
        import torch.distributed as dist
        from megatron.core import parallel_state

        from megatron_ext.elastic.distill import distilled_tokens
        from megatron_ext.elastic.vocab_loss import kd_per_token
        from megatron_ext.platform.device import current_device

        teacher_logits = [self._logits(ctx, self.distiller.teacher, batches) for batches in rounds]
        # The last stage's TP rank 0 of each replica counts its tokens once; the sum over the world
        # is then the same number on every rank, so every rank picks the same sizes.
        counts = parallel_state.get_tensor_model_parallel_rank() == 0

        def loss(sizes: dict[str, int]) -> float:
            total = torch.zeros(2, dtype=torch.float64, device=current_device())
            self.space.clear_gates()
            with self.space.at(sizes):
                for batches, teacher in zip(rounds, teacher_logits):
                    for batch, student, parent in zip(batches, self._logits(ctx, self.space.chunks, batches, sizes), teacher):
                        mask = distilled_tokens(batch, self.cfg.distill_tokens).to(student.device)
                        per_token = kd_per_token(student, parent, self.cfg.temperature, self.distiller.vocab)
                        if counts:
                            total += torch.stack([(per_token * mask).sum(), mask.sum()]).double()
            dist.all_reduce(total)
            return float(total[0] / total[1])

        return loss

    def _calibration_rounds(self, ctx: PluginContext) -> list[list]:
        """The first `calibration_batches` micro-batches of the run, split over the replicas
        (each rank reads its share, as in training), so every layout scores the same samples:
        one round per batch, or under PP one round of all of them (one run of megatron's
        schedule; the interleaved one runs a multiple of pp micro-batches)."""
        # heavy: torch/megatron, when a worker uses the plugin (not when the launcher builds it)
        from megatron.core import parallel_state

        from megatron_ext.data import build_data_iterator
        from megatron_ext.elastic.pipeline import stages

        dp = parallel_state.get_data_parallel_world_size()
        if self.cfg.calibration_batches % dp:
            raise ValueError(
                f"elastic.calibration_batches ({self.cfg.calibration_batches}) must be a multiple of the "
                f"data-parallel size ({dp})"
            )
        per_rank, pp = self.cfg.calibration_batches // dp, stages()
        if ctx.cfg.parallel.vpp and per_rank % pp:
            raise ValueError(
                f"elastic.calibration_batches ({self.cfg.calibration_batches}) must be a multiple of the "
                f"data-parallel size times the pipeline size ({dp} * {pp}) under parallel.vpp: megatron's "
                f"interleaved schedule runs a multiple of pp micro-batches"
            )
        iterator = build_data_iterator(
            ctx.train_ds,
            ctx.cfg.train.micro_batch_size,
            parallel_state.get_data_parallel_rank(),
            dp,
            0,
            0,
        )
        batches = [next(iterator) for _ in range(per_rank)]
        return [batches] if pp > 1 else [[batch] for batch in batches]

    def _full_forward(self, ctx: PluginContext):
        """One calibration round's batches through the student at its full size."""
        return lambda batches: self._logits(ctx, self.space.chunks, batches)

    def _logits(self, ctx: PluginContext, model, batches: list, sizes: Optional[dict[str, int]] = None) -> list:
        """The logits of `batches` through `model` (the student's chunks, at `sizes` if given, or
        the teacher's), in eval mode and without gradients: through the pipeline's stages under PP
        (the last stage's, an empty list on the others)."""
        import torch  # heavy: torch/megatron, when a worker uses the plugin (not when the launcher builds it)

        from megatron_ext.data.sft.packing import attention_mask_of
        from megatron_ext.elastic.grouped import BudgetGroup, run_groups
        from megatron_ext.elastic.pipeline import chunks_of, forward_only, holds_logits, stages
        from megatron_ext.elastic.router import Choice
        from megatron_ext.platform.device import current_device

        chunks = chunks_of(model)
        device = current_device()

        def run(chunk, batch):
            batch = {k: v.to(device) for k, v in batch.items()}
            tokens, positions, mask = batch["tokens"], batch["position_ids"], attention_mask_of(batch)
            if sizes is None:
                return chunk(tokens, positions, mask)
            # As in training: under virtual pipeline stages a chunk sends the full hidden size.
            group = BudgetGroup(0, Choice(sizes, {}, {}, {}), torch.arange(tokens.shape[0]))
            send_width = self.distiller.send_width
            last = holds_logits(chunk)
            return run_groups(chunk, self.space, [group], tokens, positions, mask, lambda g, out: out, last, send_width)

        was_training = chunks[0].training
        for chunk in chunks:
            chunk.eval()
        try:
            with torch.no_grad():
                if stages() > 1:
                    return forward_only(chunks, batches, run, **self._schedule_shape(ctx))
                return [run(chunks[0], batch) for batch in batches]
        finally:
            for chunk in chunks:
                chunk.train(was_training)

    def _schedule_shape(self, ctx: PluginContext) -> dict:
        return {"seq_length": ctx.cfg.model.seq_length, "micro_batch_size": ctx.cfg.train.micro_batch_size}

    def _build_teacher(self, ctx: PluginContext):
        """The parent, rebuilt from its source (seeded initialisation or `model.pretrained`) and
        reordered like the student: also right after a resume, when the student has trained."""
        # heavy: torch/megatron, when a worker uses the plugin (not when the launcher builds it)
        from megatron_ext.elastic.space import ElasticSpace
        from megatron_ext.models import pretrained
        from megatron_ext.models.arch import architecture
        from megatron_ext.models.init import init_weights_layout_independent, layout_independent
        from megatron_ext.platform.device import current_device

        import torch  # heavy: torch/megatron, when a worker uses the plugin (not when the launcher builds it)

        cfg = ctx.cfg
        # The student's own family (GPT or hybrid), not always a GPT.
        arch = architecture(cfg.model)
        # The student's config without the runtime's schedule hooks (DDP's gradient sync, the
        # optimizer's loss scale): the teacher never trains, and megatron's MoE experts deep-copy
        # their config, which the hooks' process groups refuse.
        config = copy.copy(ctx.model_config)
        config.finalize_model_grads_func = config.no_sync_func = config.grad_sync_func = None
        config.param_sync_func = config.grad_scale_func = None
        # The teacher holds this rank's pipeline stage (its chunks under VPP), like the student.
        teacher = [
            arch.build(
                cfg.model,
                config,
                arch.spec(cfg.model, ctx.on_cpu),
                ctx.vocab_size,
                pre_process=student.pre_process,
                post_process=student.post_process,
                vp_stage=getattr(student, "vp_stage", None),
            ).to(current_device())
            for student in self.space.chunks
        ]
        if not cfg.model.pretrained and not layout_independent(cfg.model, ctx.on_cpu):
            raise ValueError(
                "elastic: without model.pretrained the teacher is redrawn from the seed, which needs "
                "model.layout_independent_init=true (megatron's own initialisation cannot be redrawn)"
            )
        init_weights_layout_independent(teacher, config, cfg.train.seed)
        if cfg.model.pretrained:
            pretrained.load_into(teacher, cfg.model, ctx.vocab_size)
        space = ElasticSpace(teacher)
        for axis in space.axes:
            axis.permute(torch.tensor(self.orders[axis.name]))
        for chunk in teacher:
            chunk.eval().requires_grad_(False)
        return teacher[0] if len(teacher) == 1 else teacher

    # --- the step ---------------------------------------------------------------------------------

    def on_step_begin(self, ctx: PluginContext, step: int) -> None:
        if not self.ready:
            self._prepare(ctx)
        self.distiller.begin_step(step - 1)
        self.router_optimizer.zero_grad()

    def forward_backward_func(self, ctx: PluginContext):
        # heavy: torch/megatron, when a worker uses the plugin (not when the launcher builds it)
        from megatron.core.pipeline_parallel import get_forward_backward_func

        from megatron_ext.elastic.pipeline import stages

        inner = self._scales_once_per_call(get_forward_backward_func())

        def elastic_forward_backward(*, forward_step_func, forward_only, **kwargs):
            if forward_only:  # evaluation: the full model, next-token loss
                self.space.clear_gates()
                with self.space.at(self.space.full()):
                    return inner(forward_step_func=forward_step_func, forward_only=True, **kwargs)
            if stages() > 1:
                kwargs["data_iterator"] = self._teacher_pass(kwargs)
            try:
                return inner(forward_step_func=self.distiller.forward_step, forward_only=False, **kwargs)
            finally:
                self.distiller.teacher_logits = None
                self._full_size()

        return elastic_forward_backward

    def _scales_once_per_call(self, inner):
        """With fp8: `inner` (megatron's schedule) run in a `fp8.fixed_scales` window, so each
        linear's scale is computed (reduced over its TP group) once per call, a step's every
        micro-batch or an evaluation, not at every read: the weights change only at the optimizer
        step, between calls, and each call computes its scales anew."""
        if not self.cfg.fp8:
            return inner
        # heavy: torch/megatron, when a worker uses the plugin (not when the launcher builds it)
        from megatron_ext.elastic import fp8

        def run(**kwargs):
            with fp8.fixed_scales(self.space.chunks):
                return inner(**kwargs)

        return run

    def _full_size(self) -> None:
        self.space.clear_gates()
        self.space.apply(self.space.full())

    def _at_full_size(self, finalize):
        """Megatron's end-of-step gradient reductions, run at the full size: they read parameters
        as module attributes (the tied embedding's copy on the last pipeline stage), and at the
        last micro-batch's budget an elastic module would return a slice without its gradient."""

        def run(*args, **kwargs):
            self._full_size()
            return finalize(*args, **kwargs)

        return run

    def _teacher_pass(self, kwargs: dict):
        """Under PP: the teacher's logits of the step's micro-batches, through megatron's
        schedule before the student's (the last stage keeps them); the batches are read once and
        replayed to the student's schedule (returned as its data iterator: one per model chunk
        under VPP, each over the same micro-batches, as the trainer's)."""
        import torch  # heavy: torch/megatron, when a worker uses the plugin (not when the launcher builds it)

        from megatron_ext.data.sft.packing import attention_mask_of
        from megatron_ext.elastic.pipeline import forward_only

        count = kwargs["num_microbatches"]
        iterators = kwargs["data_iterator"]
        if isinstance(iterators, list):  # virtual pipeline stages: every chunk's iterator advances
            per_chunk = [[next(it) for _ in range(count)] for it in iterators]
        else:
            per_chunk = [[next(iterators) for _ in range(count)]]
        batches = per_chunk[0]
        schedule = {k: v for k, v in kwargs.items() if k not in ("data_iterator", "model", "num_microbatches")}

        def run(teacher, batch):
            return teacher(batch["tokens"], batch["position_ids"], attention_mask_of(batch))

        with torch.no_grad():
            self.distiller.teacher_logits = forward_only(self.distiller.teacher, batches, run, **schedule)
        replay = [iter(chunk_batches) for chunk_batches in per_chunk]
        return replay if isinstance(iterators, list) else replay[0]

    def on_step_end(self, ctx: PluginContext, step: int, metrics: dict) -> None:
        import torch  # heavy: torch/megatron, when a worker uses the plugin (not when the launcher builds it)
        import torch.distributed as dist
        from megatron.core import parallel_state

        from megatron_ext.elastic.distill import in_sample_order, sum_router_grads

        group = parallel_state.get_data_parallel_group()
        self.distiller.average_router_grads(parallel_state.get_tensor_and_data_parallel_group(), group)
        # Each pipeline stage holds the gradient share of the gates of its own layers.
        sum_router_grads(self.router, parallel_state.get_pipeline_model_parallel_group())
        router_loss = self.distiller.router_loss()  # the same on every rank
        router_loss.backward()
        with torch.no_grad():  # what was trained at, before the router moves
            if self.cfg.budget_draw == "sample":  # per budget
                trained = [self.distiller.choice(b).sizes for b in range(len(self.cfg.budgets))]
            else:  # per micro-batch, in global micro-batch order
                count = len(self.distiller.drawn) * dist.get_world_size(group)
                trained = [sizes for _, sizes in self.distiller.micro_batch_choices(count)]
        self.router_optimizer.step()
        drawn = torch.tensor(self.distiller.drawn, dtype=torch.long)
        gathered = [torch.zeros_like(drawn) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, drawn, group=group)
        self.history.append(
            {
                "step": step,
                "loss": metrics["loss"],
                "router_loss": float(router_loss.detach()),
                "budgets": in_sample_order(gathered),
                "sizes": trained,
                "choices": [self.router.select(b) for b in range(len(self.cfg.budgets))],
            }
        )

    # --- checkpoints and the end ---------------------------------------------------------------

    def state_dict(self) -> dict:
        if not getattr(self, "ready", False):
            # Resumed but not stepped yet: what was loaded is still the whole state.
            return getattr(self, "_loaded", {})
        return {
            "orders": self.orders,
            "grid": self.grid,
            "router": {"router": self.router.state_dict(), "optimizer": self.router_optimizer.state_dict()},
            "choices": [self.router.select(b) for b in range(len(self.cfg.budgets))],
        }

    def load_state_dict(self, state: dict) -> None:
        if state:
            if state["grid"] != self.grid:  # the router's outputs are indices into the grid
                raise ValueError(
                    f"elastic: the checkpoint's choice grid {state['grid']} differs from this run's "
                    f"{self.grid}; resume with the same elastic.grid"
                )
            self._loaded = state
            self.orders = state["orders"]
            self.router_state = state["router"]

    def choices(self) -> dict[str, dict[str, int]]:
        """The router's sizes of every budget now."""
        return {f"{b:g}": self.router.select(i) for i, b in enumerate(self.cfg.budgets)}

    def on_train_end(self, ctx: PluginContext) -> None:
        # heavy: torch/megatron, when a worker uses the plugin (not when the launcher builds it)
        import torch.distributed as dist

        if not self.cfg.export_dir or not self.ready:
            return
        out = Path(self.cfg.export_dir)
        if dist.get_rank() == 0:
            out.mkdir(parents=True, exist_ok=True)
            (out / "report.json").write_text(json.dumps({"history": self.history, "choices": self.choices()}, indent=1))
        self._export(ctx, out)
        dist.barrier()

    def _export(self, ctx: PluginContext, out: Path) -> None:
        """The nested checkpoint, written by rank 0 from the pieces of every TP and pipeline rank
        of its replica, as one process holding the whole model would write it (`gather.py`)."""
        # heavy: torch/megatron, when a worker uses the plugin (not when the launcher builds it)
        from megatron_ext.elastic import fp8, slicing
        from megatron_ext.elastic.gather import whole_parent

        chunks = self.space.chunks
        state = whole_parent(chunks)
        # The scales are the whole tensors' on every TP rank (computed by all of them: collective),
        # and quantisation is elementwise with one scale per tensor: the joined weights' codes are
        # the shards' codes joined as gather.py joins the shards. Each chunk's scales are keyed
        # like its state and gathered with it under global layer numbers.
        scales = whole_parent(chunks, [fp8.scales(c) for c in chunks]) if self.cfg.fp8 else None
        if state is None:  # not rank 0
            return
        nested = out / "nested"
        slicing.save_nested_state(nested, state, ctx.cfg.model, ctx.vocab_size, self.choices(), fp8_scales=scales)
        kind = "FP8 nested" if self.cfg.fp8 else "nested"
        ctx.note(f"elastic: {kind} checkpoint of budgets {list(self.choices())} in {nested}")
