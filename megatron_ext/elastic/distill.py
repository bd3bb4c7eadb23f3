"""Curriculum distillation of the nested submodels from the frozen parent.

Budgets are drawn by the curriculum (stage 1: uniform over the budgets; stage 2: skewed toward
the full model, e.g. 0.5 / 0.3 / 0.2 from largest to smallest); `budget_draw` says what draws one.
"micro_batch" (the default): every micro-batch draws one budget from (seed, step, global
micro-batch index), and the router's Gumbel sample of its sizes comes from the same generator
right after, so every micro-batch trains at sizes of its own; all its samples carry that budget
(one group in `grouped.py`). The draw does not depend on the data-parallel layout, but does on
the micro-batch size. "sample": every sample draws its own budget from (seed, step, global
sample index), so any data-parallel layout and any micro-batch size draws the same budget for
the same sample; the router samples each budget's sizes once per step (its Gumbel noise
depends on (seed, step, budget)), so a sample's sizes are layout independent too. Inside a
micro-batch the samples are grouped by budget and the student runs each group at its sizes
(`grouped.py`); the teacher runs once on the whole micro-batch. With `budget_share` > 1 the
draws are keyed by the window of `budget_share` consecutive global micro-batches instead of the
micro-batch (per sample: by the window and the sample's row), so the micro-batches of a window
train at the same budgets and router sample: what the replicas of an expert-parallel group need,
as their experts compute each other's tokens (`expert_parallel.py`). The tokens `distill_tokens`
names (`distilled_tokens`: the loss mask, or every token a conversation predicts of itself) learn
the teacher's distribution: forward KL(teacher || student) at temperature T (times T^2),
optionally plus `ce_weight` times the next-token loss on the loss-mask tokens, reduced per token
over the micro-batch as megatron does, counting the distilled tokens. The student and the teacher
run with the batch's attention mask (`data.sft.attention_mask_of`: a packed SFT sample's
conversations each attend to themselves), so a packed sample distils as its conversations alone.

`Distiller.forward_step` has megatron's `forward_step(data_iterator, model)` contract, so the
Trainer runs it through megatron's own schedules (the `elastic` plugin), and `train_plain` runs
the same step without megatron's DDP (benchmarks, tests; one process or a TP group). Logits may
be vocabulary-parallel (`vocab_loss.py`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state
from torch import nn

from megatron_ext.data.sft.packing import attention_mask_of
from megatron_ext.elastic.config import check_distill_tokens
from megatron_ext.elastic.grouped import BudgetGroup, group_by_budget, run_groups
from megatron_ext.elastic.pipeline import chunk_index, holds_logits
from megatron_ext.elastic.router import BudgetRouter, Choice, ExpectedGap, cost_gap_loss, cost_of
from megatron_ext.elastic.space import ElasticSpace
from megatron_ext.elastic.vocab_loss import ce_per_token, kd_per_token
from megatron_ext.training.step import loss_func


@dataclass
class CurriculumConfig:
    # Fractions of the parent's cost, largest first.
    budgets: list[float] = field(default_factory=lambda: [1.0, 0.75, 0.5])
    # Steps of stage 1 (uniform per-sample budget draws); stage 2 draws with `skew` after them.
    uniform_steps: int = 50
    # Stage-2 probabilities in the order of `budgets` (None: uniform throughout).
    skew: Optional[list[float]] = field(default_factory=lambda: [0.5, 0.3, 0.2])
    temperature: float = 1.0
    ce_weight: float = 0.0
    seed: int = 0
    # "micro_batch": one budget (and one router sample) per micro-batch; "sample": one budget per
    # sample, one router sample per budget and step.
    budget_draw: str = "micro_batch"
    # Consecutive global micro-batches that draw together (1: each its own).
    budget_share: int = 1
    # The tokens the KD loss covers: "loss_mask" or "all" (`distilled_tokens`).
    distill_tokens: str = "loss_mask"

    def __post_init__(self) -> None:
        check_budget_draw(self.budget_draw)
        check_budget_share(self.budget_share)
        check_distill_tokens(self.distill_tokens)


BUDGET_DRAWS = ("micro_batch", "sample")


def check_budget_draw(value: str) -> None:
    if value not in BUDGET_DRAWS:
        raise ValueError(f"elastic.budget_draw={value!r}: must be one of {', '.join(map(repr, BUDGET_DRAWS))}")


def check_budget_share(value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"elastic.budget_share={value!r}: must be a positive integer (micro-batches per draw)")


def draw_key(micro_batch: int, share: int) -> int:
    """What keys the draws of global micro-batch `micro_batch`: its window of `share`
    consecutive micro-batches (the micro-batch itself when `share` is 1)."""
    return micro_batch // share


def distilled_tokens(batch: dict[str, torch.Tensor], which: str) -> torch.Tensor:
    """The [b, s] mask of the tokens the KD loss covers: with `which` "loss_mask" the batch's loss
    mask; with "all" every token whose label is of its own conversation, its `conversation_mask`
    (SFT samples, `data/sft/packing.py`; a superset of the loss mask), or the loss mask of a
    pre-training batch, which has none."""
    if which == "all" and "conversation_mask" in batch:
        return batch["conversation_mask"]
    return batch["loss_mask"]


def budget_probabilities(cfg: CurriculumConfig, step: int) -> list[float]:
    if step < cfg.uniform_steps or cfg.skew is None:
        return [1.0 / len(cfg.budgets)] * len(cfg.budgets)
    return list(cfg.skew)


def draw_generator(*key: object) -> torch.Generator:
    """A generator seeded by `key` alone, e.g. (seed, step, global sample index)."""
    digest = hashlib.sha256("/".join(map(str, key)).encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


def draw_budget(cfg: CurriculumConfig, step: int, generator: torch.Generator) -> int:
    probs = torch.tensor(budget_probabilities(cfg, step))
    return int(torch.multinomial(probs, 1, generator=generator))


class Distiller:
    def __init__(
        self,
        space: ElasticSpace,
        teacher: nn.Module,
        router: BudgetRouter,
        curriculum: CurriculumConfig,
        vocab: int,
        micro_batch_index: Callable[[int], int] = lambda m: m,
        send_width: Optional[int] = None,
    ) -> None:
        self.space, self.teacher, self.router, self.cfg, self.vocab = space, teacher, router, curriculum, vocab
        self.full_cost = float(cost_of(space, space.full(), router.cfg.cost))
        # Global index of the m-th micro-batch of this rank within a step (data parallelism):
        # its sample i is the step's sample micro_batch_index(m) * micro_batch_size + i.
        self.micro_batch_index = micro_batch_index
        # The hidden size a pipeline stage sends the next (`grouped.run_groups`): None is the
        # micro-batch's widest; the full one under virtual pipeline stages.
        self.send_width = send_width
        self.step = 0
        self._micro: dict[int, int] = {}  # per model chunk (`begin_step`)
        # This step's budgets: one list per micro-batch of this rank, one entry per sample.
        self.drawn: list[list[int]] = []
        self.micro_choice: Optional[Choice] = None  # budget_draw "micro_batch": the last draw's
        self._expected_gap = ExpectedGap(space, router) if ExpectedGap.fits(router) else None
        # Under pipeline parallelism: the teacher's logits of the step's micro-batches, in order,
        # computed before the student's schedule (`pipeline.forward_only`); None runs the
        # teacher inside each forward step.
        self.teacher_logits: Optional[list[torch.Tensor]] = None

    def begin_step(self, step: int) -> None:
        self.step, self.drawn = step, []
        # Micro-batches each model chunk has run this step: under virtual pipeline stages every
        # chunk of a rank runs each micro-batch, in micro-batch order, interleaved with the others.
        self._micro = {}
        self.loss_tokens = 0.0  # tokens of this rank's micro-batches that the loss counts

    def draw(self, samples: int, chunk: int = 0) -> list[int]:
        """The budgets of model chunk `chunk`'s next micro-batch's `samples` samples (recorded in
        `drawn` by chunk 0: every chunk draws the same, keyed by the micro-batch). With
        budget_draw "micro_batch" they are its one draw, and the router's sample of that budget,
        taken from the same generator, is kept for the micro-batch (`micro_choice`)."""
        micro = self._micro.get(chunk, 0)
        self._micro[chunk] = micro + 1
        key = draw_key(self.micro_batch_index(micro), self.cfg.budget_share)
        if self.cfg.budget_draw == "micro_batch":
            g = draw_generator(self.cfg.seed, self.step, key)
            budget = draw_budget(self.cfg, self.step, g)
            self.micro_choice = self.router.sample(budget, self.step, g)
            budgets = [budget] * samples
        else:
            first = key * samples  # the global sample index when budget_share is 1
            budgets = [
                draw_budget(self.cfg, self.step, draw_generator(self.cfg.seed, self.step, first + i))
                for i in range(samples)
            ]
        if chunk == 0:
            self.drawn.append(budgets)
        return budgets

    def choice(self, budget: int) -> Choice:
        """With budget_draw "sample": the router's sizes of `budget` this step, the same noise in
        every micro-batch and on every rank, sampled afresh each call (each micro-batch's
        backward frees its graph). With "micro_batch" see `micro_batch_choices`."""
        return self.router.sample(budget, self.step, draw_generator(self.cfg.seed, self.step, "router", budget))

    def forward_step(self, data_iterator, model):
        """Megatron's forward_step contract: (per-token loss [b, s], loss_func); on a pipeline
        stage before the last, the activations to send."""
        batch = next(data_iterator)
        tokens, positions, mask = batch["tokens"], batch["position_ids"], attention_mask_of(batch)
        chunk = chunk_index(model)
        budgets = self.draw(tokens.shape[0], chunk)
        if self.cfg.budget_draw == "micro_batch":
            groups = group_by_budget(budgets, lambda b: self.micro_choice)  # one group
        else:
            groups = group_by_budget(budgets, self.choice)
        covered = distilled_tokens(batch, self.cfg.distill_tokens)
        if chunk == 0:  # once per micro-batch
            self.loss_tokens += float(covered.sum())
        # Megatron sums the per-token losses over the distilled tokens and divides by their count.
        reduce = partial(loss_func, covered)
        if self.teacher_logits is None:
            with torch.no_grad():
                teacher_logits = self.teacher(tokens, positions, mask)
        elif not holds_logits(model):
            activations = run_groups(
                model, self.space, groups, tokens, positions, mask, lambda g, out: out, False, self.send_width
            )
            return activations, reduce
        else:
            teacher_logits = self.teacher_logits.pop(0)
        # The next-token loss keeps to the loss mask: where the KD tokens are more (distill_tokens
        # "all" on SFT data, a superset of the loss mask), its per-token loss is masked here.
        ce_mask = None if covered is batch["loss_mask"] else batch["loss_mask"]

        def per_token(group: BudgetGroup, logits: torch.Tensor) -> torch.Tensor:
            loss = kd_per_token(logits, group.of(teacher_logits), self.cfg.temperature, self.vocab)
            if self.cfg.ce_weight:
                ce = ce_per_token(logits, group.of(batch["labels"]), self.vocab)
                loss = loss + self.cfg.ce_weight * (ce if ce_mask is None else ce * group.of(ce_mask))
            return loss

        return run_groups(model, self.space, groups, tokens, positions, mask, per_token, True, self.send_width), reduce

    @torch.no_grad()
    def micro_batch_choices(self, count: int) -> list[tuple[int, dict[str, int]]]:
        """With budget_draw "micro_batch": (budget, sizes) of the step's global micro-batches
        0..count-1, as `draw` drew them (the router as it was then: call before it steps)."""
        out = []
        for index in range(count):
            g = draw_generator(self.cfg.seed, self.step, draw_key(index, self.cfg.budget_share))
            budget = draw_budget(self.cfg, self.step, g)
            out.append((budget, self.router.sample(budget, self.step, g).sizes))
        return out

    def average_router_grads(self, group, dp_group) -> None:
        """Turn the router's gradient, accumulated over megatron's backward of each micro-batch's
        loss sum, into that of the per-token mean over the step's loss tokens (as megatron's
        `calculate_per_token_loss` does for the model): sum over `group` (TP and DP ranks), then
        divide by the loss tokens of every replica (`dp_group`): the tokens the KD loss covers."""
        sum_router_grads(self.router, group)
        tokens = torch.tensor(self.loss_tokens, dtype=torch.float64)
        if dist.get_world_size(dp_group) > 1:
            dist.all_reduce(tokens, group=dp_group)
        for p in self.router.parameters():
            p.grad /= max(float(tokens), 1.0)

    def router_loss(self) -> torch.Tensor:
        """The cost-gap loss averaged over the budgets: exact over the grid when it is small
        enough to enumerate, else of one relaxed Gumbel sample per budget."""
        total = 0.0
        for b, fraction in enumerate(self.cfg.budgets):
            target = fraction * self.full_cost
            if self._expected_gap is not None:
                total = total + self._expected_gap(self.router, b, target, self.step)
                continue
            choice = self.router.sample(b, self.step, draw_generator(self.cfg.seed + 1, self.step, b))
            total = total + cost_gap_loss(self.space, choice, target, self.router.cfg.cost)
        return self.router.cfg.cost_weight * total / len(self.cfg.budgets)

    def warm_up_router(self, steps: int) -> None:
        """Fit the router to the budgets' costs alone before distillation starts (no model
        forward: cheap), with the temperature and scale annealed over these steps, so the
        student trains at the right sizes from its first step."""
        optimizer = torch.optim.Adam(self.router.parameters(), lr=self.router.cfg.lr)
        anneal = self.router.cfg.anneal_steps
        self.router.cfg.anneal_steps = steps
        try:
            for step in range(steps):
                self.begin_step(step)
                optimizer.zero_grad()
                self.router_loss().backward()
                optimizer.step()
        finally:
            self.router.cfg.anneal_steps = anneal
            self.begin_step(0)

    def start_router_at(self, targets: list[dict[str, int]], steps: int) -> None:
        """Fit the router so that each budget selects its `targets` sizes (e.g. chosen by
        quality, size_search.py), with a cross-entropy on each key's logits."""
        optimizer = torch.optim.Adam(self.router.parameters(), lr=self.router.cfg.lr)
        indices = [
            {k: torch.tensor(self.router.choices(k).int().tolist().index(t[k])) for k in self.router.keys}
            for t in targets
        ]
        for _ in range(steps):
            optimizer.zero_grad()
            loss = sum(
                F.cross_entropy(logits, index[k])
                for budget, index in enumerate(indices)
                for k, logits in self.router.logits(budget).items()
            )
            loss.backward()
            optimizer.step()

    @torch.no_grad()
    def heldout_kd(self, model: nn.Module, batches: list[dict], sizes: dict) -> float:
        """Mean KD loss per distilled token of the student at `sizes` on held-out batches."""
        self.space.clear_gates()
        total, count = 0.0, 0.0
        with self.space.at(sizes):
            for batch in batches:
                inputs = batch["tokens"], batch["position_ids"], attention_mask_of(batch)
                t = self.teacher(*inputs)
                per_token = kd_per_token(model(*inputs), t, self.cfg.temperature, self.vocab)
                covered = distilled_tokens(batch, self.cfg.distill_tokens)
                total += float((per_token * covered).sum())
                count += float(covered.sum())
        return total / max(count, 1.0)


def in_sample_order(drawn: list[torch.Tensor]) -> list[int]:
    """Every replica's `Distiller.drawn` ([micro-batches, samples] each, replicas in rank order)
    as one list in the step's global sample order: replica r's m-th micro-batch holds the
    samples from (m * dp + r) * micro_batch_size on."""
    return torch.stack(drawn, 1).reshape(-1).tolist()


def sum_router_grads(router: BudgetRouter, group) -> None:
    """Sum the distillation loss's gradient of the router over `group` (before the cost-gap loss,
    which every rank computes alike, adds its own). Every gate multiplies a TP-sharded weight
    (linear_proj, fc2, the Mamba in_proj and out_proj), so each TP rank holds its block's share
    of the gradient; each data-parallel replica holds its samples' share."""
    for p in router.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        if dist.get_world_size(group) > 1:
            dist.all_reduce(p.grad, group=group)


def train_plain(
    distiller: Distiller,
    model: nn.Module,
    batches: Callable[[int], list[dict]],
    steps: int,
    lr: float,
    on_step: Optional[Callable[[int, float], None]] = None,
    decay: bool = False,
) -> list[float]:
    """Distil on one process with torch's Adam: `batches(step)` gives the step's micro-batches.
    `decay`: the model's learning rate falls linearly to zero over the steps (the router's stays).
    Returns the loss per step (token mean)."""
    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    router_optimizer = torch.optim.Adam(distiller.router.parameters(), lr=distiller.router.cfg.lr)
    losses = []
    for step in range(steps):
        if decay:
            optimizer.param_groups[0]["lr"] = lr * (1 - step / steps)
        distiller.begin_step(step)
        optimizer.zero_grad()
        router_optimizer.zero_grad()
        micro = batches(step)
        tokens = sum(float(distilled_tokens(b, distiller.cfg.distill_tokens).sum()) for b in micro)
        step_loss = 0.0
        for batch in micro:
            per_token, reduce = distiller.forward_step(iter([batch]), model)
            loss_sum, _, _ = reduce(per_token)
            (loss_sum / tokens).backward()
            step_loss += float(loss_sum.detach()) / tokens
        sum_router_grads(distiller.router, parallel_state.get_tensor_model_parallel_group())
        distiller.router_loss().backward()
        optimizer.step()
        router_optimizer.step()
        distiller.space.clear_gates()
        losses.append(step_loss)
        if on_step is not None:
            on_step(step, step_loss)
    model.eval()
    return losses
