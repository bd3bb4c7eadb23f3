"""The layout controller: the one way a running job changes its parallel layout.

    controller = trainer.layout_controller         # a plugin's hooks: ctx.layout_controller
    prepared = controller.prepare(target, device)  # beside the running layout, e.g. in a thread
    controller.install(prepared)                   # between two steps (install(layout): built now)
    ...                                            # the caller fills the new weights and states
    controller.commit()                            # or, where filling failed: controller.rollback()

Each Trainer owns one. What moves the training state from one layout to the next is the
caller's (a plugin that moves the job, a re-packing planner): the controller builds, enters and
leaves layouts, and keeps the scheduler, counters and data position across them. A worker pool
whose number of workers changes drives it too: `join` sets a Trainer up on a rank that joins a
running job, `catch_up` brings one built ahead up to date, and `release` leaves the layout on a
rank that the job leaves behind.

Building ahead. Megatron keeps its parallel state (every process group, rank list and cached
size) in the globals of `megatron.core.parallel_state`, and the running layout reads them at
every step. A prepared layout's state is made in a private copy of that module instead: its own
`initialize_model_parallel` creates the layout's process groups (collective over the world, in
the same order on every rank: e.g. in each rank's background thread) and leaves the running
layout's globals alone. The model, DDP and optimizer are then built on those groups, passed
explicitly (megatron's `pg_collection`), with memory allocated and values left as they are: the
caller fills every one of them. The one collective of megatron's builders over the default
group (the optimizer factory agreeing on param groups) goes over a private copy of the world
group instead, so that it cannot pair up with the running layout's collectives. Installing it
copies the private module's state into megatron's: a few dictionary writes.

Memory: a prepared layout is allocated from the moment it is built, beside the running one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import types
from typing import TYPE_CHECKING, Any, Iterator, Optional, Union

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.num_microbatches_calculator import destroy_num_microbatches_calculator

from megatron_ext.config.capabilities import Capability
from megatron_ext.config.schema import ParallelConfig
from megatron_ext.parallel.groups import destroy_groups, parallel_state_sizes
from megatron_ext.parallel.layout import ParallelLayout
from megatron_ext.parallel.release import built_or_failure, release_in_background, unlink_optimizer
from megatron_ext.platform.adam_initial_state import materialise_initial_adam_state
from megatron_ext.platform.megatron_parallel_state import created_groups, install, private_parallel_state, process_groups
from megatron_ext.platform.torch_worlds import live_groups, thread_gathers_over

if TYPE_CHECKING:
    from megatron_ext.training.trainer import Trainer

# What a plugin whose hooks rewrite each model built declares (each overridden hook implies its own).
_REWRITES_MODEL = frozenset({Capability.REWRITES_LAYER_SPECS, Capability.EDITS_BUILT_MODEL})


@dataclasses.dataclass
class PreparedLayout:
    """A layout built beside the running one (`LayoutController.prepare`): megatron's state
    for it (in a private module, its process groups included), the model chunks, megatron
    config and optimizer (every optimizer state allocated), and the datasets where it was built
    in a torch world not yet entered."""

    layout: ParallelLayout
    state: types.ModuleType
    model: list
    model_config: Any  # megatron's TransformerConfig
    optimizer: Any
    datasets: Optional[tuple] = None  # (training, validation), opened in a world not yet entered
    installed: bool = False

    def enter(self) -> None:
        """Make this layout's state megatron's current one. Only once the running layout was
        left (megatron's state is empty then)."""
        release_in_background(install(self.state))
        self.installed = True

    def discard(self) -> None:
        """Free a layout that will not be installed: its groups, and (once unreferenced) its
        model and optimizer."""
        if self.installed:
            return  # the running layout now: `LayoutController.release` leaves it
        unlink_optimizer(self.model_config)
        destroy_groups(created_groups(self.state))
        self.model = self.optimizer = None


class LayoutController:
    """Prepares, installs, releases and rolls back the parallel layouts of one Trainer."""

    __slots__ = ("__trainer", "__settled", "__world")

    def __init__(self, trainer: Trainer) -> None:
        # Class-private (name-mangled): a plugin given the controller reaches no more of the Trainer.
        self.__trainer = trainer
        # The layout whose state the run holds: where `rollback` returns.
        self.__settled: Optional[ParallelLayout] = trainer.layout
        self.__world = dist.group.WORLD  # the torch world the layout's groups are in

    # --- building ahead -----------------------------------------------------------------------

    @property
    def can_prepare_ahead(self) -> bool:
        """Whether a layout may be built beside the running one. Plugins that rewrite the model
        (`layer_spec`, `after_model_built`) may read megatron's global state, which describes
        the running layout until the switch; with them a layout is built when installed."""
        return not any(p.capabilities & _REWRITES_MODEL for p in self.__trainer.plugins)

    def prepare(self, target: ParallelConfig, device: torch.device, future_world: bool = False) -> PreparedLayout:
        """`target`'s groups, model, DDP and optimizer on `device` (the rank's, read in its main
        thread: a thread's current CUDA device is its own), built without touching the running layout.
        Safe in a background thread of every rank while the main thread trains: the running
        layout's groups are not used, and the new ones are created in the same order everywhere.
        `future_world`: this thread builds in a torch world not yet entered (parallel/world.py),
        whose default group only the building threads use; the datasets are opened there too
        (collective, as for the ranks that join it)."""
        if device.type == "cuda":
            torch.cuda.set_device(device)
        trainer = self.__trainer
        state = private_parallel_state()
        state.initialize_model_parallel(**parallel_state_sizes(target))
        with contextlib.nullcontext() if future_world else _own_world_group():
            groups = process_groups(state)
            model, config = trainer.build_model(target, groups=groups, initialise=False)
            optimizer = trainer.build_optimizer(model, config, target, groups=groups)
        for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
            materialise_initial_adam_state(opt.optimizer)  # torch makes them lazily: filled before any step
        _fault_in(model, optimizer)
        layout = ParallelLayout.from_config(target, dist.get_world_size())
        datasets = trainer.open_datasets(layout.dp) if future_world else None
        return PreparedLayout(layout, state, model, config, optimizer, datasets)

    def prepare_or_failure(
        self, target: ParallelConfig, device: torch.device
    ) -> tuple[Optional[PreparedLayout], Optional[str]]:
        """(`prepare(target, device)`, None) in the running world, or (None, what failed), the
        failed build's process groups destroyed at once (`built_or_failure`): the other ranks'
        collectives in them fail too rather than wait for this rank until the timeout."""
        before = set(live_groups())

        def destroy_new_groups() -> None:
            destroy_groups([g for g in live_groups() if g not in before])

        return built_or_failure(lambda: self.prepare(target, device), destroy_new_groups)

    # --- changing the layout (between two steps) ----------------------------------------------

    def install(self, target: Union[ParallelLayout, PreparedLayout]) -> None:
        """Leave the running layout and enter `target`: process groups, model, DDP, optimizer;
        the scheduler, counters and data position carry over. A PreparedLayout is entered as
        built; a ParallelLayout is built now. The new model's weights (left uninitialised) and
        optimizer states are placeholders until the caller fills them (from the old layout's
        objects, which it holds on to). Only at a step boundary: the grad buffers are built
        anew, so no gradient may be mid-accumulation. When torch's world was formed anew
        meanwhile (a worker pool changed the number of workers), the datasets are opened in it.
        Step losses not read yet are dropped: they lie on the old layout's last stage (the
        Trainer's loop reads every step's when a plugin moves the layout, `Plugin.needs_step_loss`)."""
        t = self.__trainer
        prepared = target if isinstance(target, PreparedLayout) else None
        t._finalize_saves()  # in the world and groups that started them
        t.pending_losses.clear()
        scheduler_state = t.scheduler.state_dict()
        parallel = (prepared.layout if prepared else target).to_config(t.cfg.parallel)
        t.cfg = dataclasses.replace(t.cfg, parallel=parallel)
        self.release(in_background=True)
        t.layout = ParallelLayout.from_config(parallel, dist.get_world_size())  # its ranks in this world
        if prepared is not None:
            prepared.enter()
            t._seed_and_batches()
            t.model, t.model_config, t.optimizer = prepared.model, prepared.model_config, prepared.optimizer
        else:
            t._init_layout()
            t.model, t.model_config = t.build_model(parallel, initialise=False)
            t.optimizer = t.build_optimizer(t.model, t.model_config, parallel)
        t.scheduler = t._build_scheduler()
        t.scheduler.load_state_dict(scheduler_state)
        if prepared is not None and prepared.datasets is not None:  # opened in the world entered
            t.train_ds, t.valid_ds = prepared.datasets
        elif dist.group.WORLD is not self.__world:  # opening them is collective: with the ranks that join
            t.train_ds, t.valid_ds = t.open_datasets()
        self.__world = dist.group.WORLD
        t.train_iter = t._iterator(t.train_ds, t.state.consumed_samples)

    def release(self, in_background: bool = False) -> None:
        """Leave the running layout without entering another: megatron's globals and the process
        groups it created (their objects dropped by a background thread with `in_background`, see
        destroy_groups); `layout` becomes None and the loop ends on this rank, unless `install`
        follows."""
        t = self.__trainer
        groups = created_groups()
        if t.model_config is not None:
            unlink_optimizer(t.model_config)
        destroy_num_microbatches_calculator()
        parallel_state.destroy_model_parallel()
        destroy_groups(groups, in_background)
        t.layout = None

    def commit(self) -> None:
        """The running layout holds the run's state now (the caller filled it): a later
        `rollback` returns to it."""
        self.__settled = self.__trainer.layout

    def rollback(self) -> None:
        """Back to the layout of the last `commit` (or the Trainer's first), after a change that
        failed: leave whatever the change entered, if anything, and enter that layout again, built anew. Its
        weights and optimizer states are placeholders, which the caller fills from the objects it
        kept of it; the scheduler, counters and data position are the run's, as they were."""
        self.install(self.__settled)  # it leaves what is running first

    # --- a worker pool's entry points ---------------------------------------------------------

    def common_state(self) -> dict:
        """What a rank that joins the job starts from: the run's state besides tensors
        (`Trainer.common_state`: counters, scheduler, plugin states, config)."""
        return self.__trainer.common_state()

    def join(self, common: dict) -> None:
        """Set the Trainer up on a rank that joins a running job in `common` state
        (`common_state()` of that job) instead of from checkpoint.load: its weights and optimizer
        states are placeholders until the caller fills them. Collective over the world joined."""
        self.__trainer._setup(from_state=common)

    def catch_up(self, common: dict) -> None:
        """Bring the counters, lr schedule, plugin states and data position of a Trainer that
        joined (built ahead) to `common` (`common_state()` of the running job now)."""
        t = self.__trainer
        t.scheduler = t._build_scheduler()  # megatron's load_state_dict adds the steps loaded
        t._restore_common(common)
        t.train_iter = t._iterator(t.train_ds, t.state.consumed_samples)


@contextlib.contextmanager
def _own_world_group() -> Iterator[None]:
    """Within the block, this thread's `all_gather_object` calls without a group go over a
    private copy of the world group. Megatron's optimizer factory agrees on its param groups by
    an `all_gather_object` over the default group, which the running layout uses in the main
    thread meanwhile; two threads' collectives on one group may pair up differently on each
    rank. Other threads keep calling torch's function unchanged.

    Entering it ends the build's group creation on every rank: a rank whose build fails later
    destroys its groups, and a peer still connecting one of them (torch does not wait for all
    ranks at `new_group`) would retry the connection until the group timeout."""
    world = dist.new_group(list(range(dist.get_world_size())))  # collective: in the same order
    dist.barrier(group=world)
    try:
        with thread_gathers_over(world):
            yield
    finally:
        dist.destroy_process_group(world)


def _fault_in(model: list, optimizer: Any) -> None:
    """Write every tensor of a prepared layout once, while it is built. Host memory is mapped on
    first write: left for the transfer into it, the page faults doubled its time (100M model,
    CPU). The values are placeholders, which the caller overwrites."""
    tensors = [p for chunk in model for p in chunk.parameters()]
    tensors += [b.grad_data for chunk in model for b in chunk.buffers + chunk.expert_parallel_buffers]
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        tensors += [p for group in opt.optimizer.param_groups for p in group["params"]]
        tensors += [v for state in opt.optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
    with torch.no_grad():
        for tensor in tensors:
            tensor.zero_()
