"""Where a Piece lives in a running megatron job: the executor's read_local / write_local.

    source = MegatronState(trainer_a.model, trainer_a.optimizer)
    target = MegatronState(trainer_b.model, trainer_b.optimizer)
    execute(p, steps, source.read, target.write)

A Piece names a contiguous run of a local tensor (vps.py): for `param`, model chunk `chunk`'s
parameter `param` (its TP shard, flattened); for `main_param`, `exp_avg`, `exp_avg_sq`, the
distributed optimizer's DP shard of that parameter's state; for `step`, the optimizer's step
counter, which torch's Adam keeps once per parameter. The tensors are megatron's own, found
through megatron's `_get_main_param_and_optimizer_states`, so writing a box updates the live
optimizer in place.
"""

from __future__ import annotations

import torch
from megatron.core.utils import unwrap_model

from megatron_ext.platform.adam_initial_state import materialise_initial_adam_state
from megatron_ext.platform.distributed_optimizer_internals import main_param_and_states
from megatron_ext.reshard.boxes import Box, box_shape, numel
from megatron_ext.reshard.vps import Piece

# Piece state -> megatron's key in `_get_main_param_and_optimizer_states`.
OPTIMIZER_KEYS = {"main_param": "param", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}


class MegatronState:
    """The training state of one rank: model chunks (DDP-wrapped) and their optimizer."""

    def __init__(self, model_chunks: list, optimizer) -> None:
        self.optimizers = getattr(optimizer, "chained_optimizers", [optimizer])
        for opt in self.optimizers:
            if not hasattr(opt, "model_param_gbuf_map"):
                raise TypeError("reshard: optimizer states are placed only for DistributedOptimizer")
        self.tensors = {}
        for i, chunk in enumerate(model_chunks):
            module = unwrap_model(chunk)
            for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
                self.tensors[(i, name)] = tensor

    def read(self, piece: Piece, box: Box) -> torch.Tensor:
        """A view of `box` (⊆ piece.box) of this rank's piece."""
        return _sub_box(self._run(piece), piece.box, box)

    def write(self, piece: Piece, box: Box, values: torch.Tensor) -> None:
        if piece.state == "step":
            for step in self._steps():
                step.copy_(values.view(()))
            return
        _sub_box(self._run(piece), piece.box, box).copy_(values)

    def _run(self, piece: Piece) -> torch.Tensor:
        """The piece's contiguous run, shaped like its box."""
        if piece.state == "step":
            return self._steps()[0].view(1)
        tensor = self.tensors[(piece.chunk, piece.param)]
        if piece.state != "param":
            tensor = self._optimizer_state(tensor, OPTIMIZER_KEYS[piece.state])
        flat = tensor.detach().view(-1)
        return flat[piece.offset : piece.offset + numel(piece.box)].view(box_shape(piece.box))

    def _optimizer_state(self, param: torch.Tensor, key: str) -> torch.Tensor:
        for opt in self.optimizers:
            if param in opt.model_param_gbuf_map:
                return main_param_and_states(opt, param)[key]
        raise KeyError("reshard: no optimizer of this rank updates the parameter of a piece")

    def _steps(self) -> list[torch.Tensor]:
        """Every `step` tensor of this rank's optimizers (one per parameter shard)."""
        states = [state for opt in self.optimizers for state in opt.optimizer.state.values()]
        steps = [state["step"] for state in states if "step" in state]
        if not steps:
            raise RuntimeError("reshard: the optimizer has no state yet (see ensure_optimizer_states)")
        return steps


def ensure_optimizer_states(optimizer) -> None:
    """Create the Adam states torch creates lazily at the first step (step 0, zero moments),
    so that a reshard can read them from an optimizer that has not stepped yet and write them
    into a fresh one. Unlike megatron's dummy step this changes no parameter."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        materialise_initial_adam_state(opt.optimizer)


def _sub_box(run: torch.Tensor, outer: Box, box: Box) -> torch.Tensor:
    return run[tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(box, outer))]
