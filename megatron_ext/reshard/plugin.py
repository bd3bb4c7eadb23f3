"""`plugins=[reshard]`: change the layout of a running job between two steps.

Triggers, checked before every step:
  - a schedule in the config:   reshard.schedule='[{step: 100, layout: {tp: 1, pp: 2, dp: 2}}]'
  - a request file, polled:     reshard.request_file=/path/req.json  containing
                                {"layout": {"pp": 2, "dp": 2}}; it is renamed to *.done once
                                taken, so a cluster scheduler or a person can ask again, or to
                                *.rejected (one log line says why) when it cannot be taken
  - Python:                     reshard_to(trainer, {"tp": 1, "dp": 4}) (e.g. RLHF phase switches)
A layout names the sizes that change; the others keep the run's values (dp is derived when
left out and tp/pp/cp change).

Every move is prepared in the background while training goes on: as soon as it is requested,
or `prepare_steps_ahead` steps before its scheduled step. Preparing plans the move and, with
`prebuild` (the default), builds the new layout's groups, model and optimizer beside the running
one (for a move to another number of workers, the new torch world too, on the standby workers
that will join as well); the stall is then the switch and the transfer. A move within the same
workers (live.py) rolls back if it fails. A move to another number of workers (dp named so that
tp·pp·dp·cp changes) goes through the worker pool (pool.py): the job is launched with as many
processes as its largest layout needs, and the ones a layout does not use wait on standby.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

from megatron_ext.parallel.layout import ParallelLayout
from megatron_ext.plugin import Plugin, PluginContext, Runner, register_plugin
from megatron_ext.reshard.config import SECTION, check_schedule, target_config
from megatron_ext.reshard.request import RequestError, read_request, retire

if TYPE_CHECKING:  # annotations only
    from megatron_ext.reshard.live import Preparation


@dataclass(frozen=True)
class _Planned:
    """A move being prepared in the background."""

    target: Any  # ParallelConfig
    prepared: Preparation

    def done(self) -> bool:
        return self.prepared.done()


@register_plugin
class ReshardPlugin(Plugin):
    section = SECTION
    needs_step_loss = True

    def runner(self) -> Runner:
        # The job's processes form a worker pool, so that the number of workers can change
        # while it trains.
        # heavy: torch/megatron, when a worker uses the plugin (not when the launcher builds it)
        from megatron_ext.reshard.pool import pooled_worker

        return Runner(pooled_worker)

    def setup(self, ctx: PluginContext) -> None:
        # heavy: torch/megatron, when a worker uses the plugin (not when the launcher builds it)
        import torch.distributed as dist

        from megatron_ext.reshard.pool import current_pool

        self.reports: list = []
        self._due = {int(entry["step"]): dict(entry["layout"]) for entry in self.cfg.schedule}
        pool = current_pool()  # a Trainer built without train.run(): check here too
        check_schedule(ctx.cfg, self.cfg.schedule, pool.size if pool else dist.get_world_size())
        self._next: Optional[tuple[int, _Planned]] = None  # the next scheduled move
        self._requested_move: Optional[_Planned] = None
        self._stuck: Optional[tuple] = None  # a request file (rank 0's view) that cannot be renamed

    def on_step_begin(self, ctx: PluginContext, step: int) -> None:
        self._prepare_next(ctx, step - 1)  # at the first step (fresh or resumed)
        if step in self._due:
            target = target_config(ctx.cfg.parallel, self._due[step])
            if target == ctx.cfg.parallel:
                return  # a rank that joined at this step: the move is done
            self._apply(ctx, step, self._scheduled(ctx, step, target))
        elif self._requested_move is not None:
            if _everywhere(self._requested_move.done()):
                planned, self._requested_move = self._requested_move, None
                self._apply(ctx, step, planned)
        else:
            self._poll(ctx, step)
        if ctx.layout is not None:  # still in the job's world
            self._prepare_next(ctx, step)

    def _prepare_next(self, ctx: PluginContext, step: int) -> None:
        """Plan the next scheduled move in the background, from the layout it will leave."""
        upcoming = [s for s in sorted(self._due) if s > step]
        if not upcoming or upcoming[0] - step > self.cfg.prepare_steps_ahead:
            return
        if self._next is not None and self._next[0] == upcoming[0]:
            return
        target = target_config(ctx.cfg.parallel, self._due[upcoming[0]])
        if target != ctx.cfg.parallel:
            self._next = (upcoming[0], self._prepare(ctx, target))

    def _scheduled(self, ctx: PluginContext, step: int, target) -> _Planned:
        if self._next is not None and self._next[0] == step and self._next[1].target == target:
            planned, self._next = self._next[1], None
            return planned
        # Prepared from another layout (a request came in between), or not at all: again.
        return self._prepare(ctx, target)

    def _prepare(self, ctx: PluginContext, target) -> _Planned:
        budget = self.cfg.memory_budget_mb
        if _changes_world(ctx, target):
            # heavy: torch/megatron, when a worker uses the plugin (not when the launcher builds it)
            from megatron_ext.reshard.pool import prepare_resize

            return _Planned(target, prepare_resize(ctx, target, budget, self.cfg.prebuild))
        # heavy: torch/megatron, when a worker uses the plugin (not when the launcher builds it)
        from megatron_ext.reshard.live import prepare

        return _Planned(target, prepare(ctx, target, budget, self.cfg.prebuild))

    def _poll(self, ctx: PluginContext, step: int) -> None:
        """Take the request file's layout, if there is one. Nothing in the file may stop the
        job: a request that cannot be taken is refused in one line and renamed aside."""
        request = self._requested()
        if request is None:
            return
        layout, problem = request
        path = self.cfg.request_file
        if problem is None:
            try:
                target = target_config(ctx.cfg.parallel, layout)
                if _same_layout(ctx, target):
                    ctx.note(f"step {step}: reshard request for {layout} in {path}: already there, "
                             f"no move{self._consume('done')}")
                    return
                # prepare checks the target (the config rules, every plugin's check_layout) first
                self._requested_move = self._prepare(ctx, target)
            except ValueError as e:
                problem = " ".join(str(e).split())  # a ConfigError names each rule on a line
        if problem is not None:
            ctx.note(f"step {step}: reshard request refused: {path}: {problem}{self._consume('rejected')}")
            return
        ctx.note(f"step {step}: reshard request to {layout} accepted; planning{self._consume('done')}")

    def _apply(self, ctx: PluginContext, step: int, planned: _Planned) -> None:
        # heavy: torch/megatron, when a worker uses the plugin (not when the launcher builds it)
        from megatron_ext.reshard.live import ReshardFailed, reshard
        from megatron_ext.reshard.pool import resize

        budget = self.cfg.memory_budget_mb
        self._discard_prepared()  # from the layout this move leaves: of no use after it
        try:
            if _changes_world(ctx, planned.target):
                report = resize(ctx, planned.target, budget, planned.prepared, self.cfg.shared_memory)
            else:
                report = reshard(ctx, planned.target, budget, planned.prepared, self.cfg.shared_memory)
        except ReshardFailed as e:
            ctx.note(f"step {step}: {e}; training goes on")
            return
        except ValueError as e:  # refused before anything moved (e.g. a budget below one element)
            planned.prepared.discard()
            ctx.note(f"step {step}: reshard refused: {e}")
            return
        self.reports.append(report)
        ctx.note(f"step {step}: {report}")
        self._record(ctx, step, report)

    def _discard_prepared(self) -> None:
        """Drop the moves prepared but not applied, freeing what they built (after waiting for
        them: no group creation may run beside a switch)."""
        for planned in (self._next[1] if self._next else None, self._requested_move):
            if planned is not None:
                planned.prepared.discard()
        self._next = self._requested_move = None

    def on_train_end(self, ctx: PluginContext) -> None:
        self._discard_prepared()

    def _record(self, ctx: PluginContext, step: int, report) -> None:
        # heavy: torch/megatron, when a worker uses the plugin (not when the launcher builds it)
        import torch.distributed as dist

        # Rank 0 is in every world; a rank that just left the world has no rank.
        if self.cfg.report_file and ctx.layout is not None and dist.get_rank() == 0:
            with open(self.cfg.report_file, "a") as f:
                f.write(json.dumps({"step": step, **dataclasses.asdict(report)}) + "\n")

    def _requested(self) -> Optional[tuple[Optional[dict], Optional[str]]]:
        """(the layout, None) or (None, what is wrong with it) for the request file, read on
        rank 0 and shared with every rank; None when there is no request."""
        if not self.cfg.request_file:
            return None
        # heavy: torch/megatron, when a worker uses the plugin (not when the launcher builds it)
        import torch.distributed as dist

        message: list = [None]
        if dist.get_rank() == 0 and self._pending(self.cfg.request_file):
            try:
                message[0] = (read_request(self.cfg.request_file), None)
            except RequestError as e:
                message[0] = (None, f"{e}")
        dist.broadcast_object_list(message, src=0)
        return message[0]

    def _pending(self, path: str) -> bool:
        """Whether `path` holds a request not seen yet (one that could not be renamed aside is
        seen once, until it changes)."""
        return os.path.isfile(path) and _identity(path) != self._stuck

    def _consume(self, outcome: str) -> str:
        """Rename the request file (on rank 0) to `<file>.<outcome>`; the log's words for it."""
        # heavy: torch/megatron, when a worker uses the plugin (not when the launcher builds it)
        import torch.distributed as dist

        if dist.get_rank() != 0:
            return ""
        path = self.cfg.request_file
        renamed = retire(path, outcome)
        if renamed is None:
            self._stuck = _identity(path)
            return f"; {path} cannot be renamed: it is ignored until it changes"
        return f"; renamed to {renamed}" if outcome != "done" else ""


def reshard_to(trainer, layout: dict, budget_mb: float = 64.0):
    """Move `trainer` to `layout` (the sizes that change) now, between two steps: within the
    same workers (live.py) or to another number of them (pool.py). `trainer`: a Trainer, or the
    PluginContext a plugin's `on_step_begin` receives. Returns the ReshardReport."""
    target = target_config(trainer.cfg.parallel, layout)
    if _changes_world(trainer, target):
        # heavy: torch/megatron, when a worker uses the plugin (not when the launcher builds it)
        from megatron_ext.reshard.pool import resize

        return resize(trainer, target, budget_mb)
    # heavy: torch/megatron, when a worker uses the plugin (not when the launcher builds it)
    from megatron_ext.reshard.live import reshard

    return reshard(trainer, target, budget_mb)


def _changes_world(trainer, target) -> bool:
    """Whether `target` needs another number of workers than the current world has."""
    p = target
    return p.dp is not None and p.tp * p.pp * p.dp * p.cp != trainer.layout.world


def _same_layout(trainer, target) -> bool:
    """Whether `target` is the layout the trainer runs now (dp derived where not named)."""
    try:
        layout = ParallelLayout.from_config(target, trainer.layout.world)
    except ValueError:  # not the current world's: another layout
        return False
    return dataclasses.replace(target, dp=layout.dp) == dataclasses.replace(trainer.cfg.parallel, dp=trainer.layout.dp)


def _identity(path: str) -> Optional[tuple]:
    """What tells one version of a file from another (None: no file)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def _everywhere(flag: bool) -> bool:
    """True when `flag` is true on every rank."""
    import torch  # heavy: torch/megatron, when a worker uses the plugin (not when the launcher builds it)
    import torch.distributed as dist

    t = torch.tensor([int(flag)])
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())
