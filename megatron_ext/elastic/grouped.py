"""One micro-batch whose samples train different budgets: the student runs once per budget group.

Every sample of a micro-batch draws its own budget (`distill.py`). The samples of one budget form
a group; each group runs the elastic forward at its budget's sizes on its rows of the batch, which
is exactly the computation of the sliced submodel on those samples (the layers never mix samples).
The groups' outputs are put back in the micro-batch's row order, so the loss, the teacher's logits
and the loss mask see one [b, ...] micro-batch as before. A micro-batch of packed conversations
gives each group its rows of the attention mask too, so each conversation attends to itself only.

Under pipeline parallelism a stage sends the next one tensor per micro-batch, [s, b, h], while
each group's hidden size h is its budget's. The groups' activations are zero-padded along the
hidden dimension to the widest group's and concatenated; the next stage, which draws the same
budgets and router sizes, cuts each group's rows and its own width back out of what it received
(the padding gets no gradient). A micro-batch of one budget sends its activations unpadded,
except under virtual pipeline stages: there every chunk sends the full hidden size (`send_width`),
so megatron's p2p needs no shapes. (Its shape exchange, `_communicate_shapes`, posts the sends and
receives in one order on the PP group: at pp=2 the previous and the next stage are one rank, and a
step of the interleaved schedule that sends an activation and a gradient at once receives each
one's shape as the other's; two budgets' hidden sizes then cross, e.g. 64 sent into a buffer of
48: gloo aborts.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from megatron.core.utils import get_attr_wrapped_model
from torch import nn

from megatron_ext.elastic.router import Choice, apply_choice
from megatron_ext.elastic.space import ElasticSpace


@dataclass
class BudgetGroup:
    budget: int
    choice: Choice
    rows: torch.Tensor  # the micro-batch rows (samples) of this budget, ascending

    def of(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """This group's rows of a micro-batch tensor (the tensor itself if they are all of it)."""
        return tensor if len(self.rows) == tensor.shape[dim] else tensor.index_select(dim, self.rows)


def group_by_budget(budgets: list[int], choice: Callable[[int], Choice]) -> list[BudgetGroup]:
    """The micro-batch's samples grouped by budget (in budget order), `choice(budget)` each."""
    return [
        BudgetGroup(b, choice(b), torch.tensor([i for i, x in enumerate(budgets) if x == b]))
        for b in sorted(set(budgets))
    ]


def _received(model: nn.Module):
    """What the previous pipeline stage sent ([s, b, h_max]), or None on a stage that embeds."""
    if get_attr_wrapped_model(model, "pre_process"):
        return None
    return get_attr_wrapped_model(model, "decoder").input_tensor


def run_groups(
    model: nn.Module,
    space: ElasticSpace,
    groups: list[BudgetGroup],
    tokens: torch.Tensor,
    positions: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    finish: Callable[[BudgetGroup, torch.Tensor], torch.Tensor],
    last_stage: bool,
    send_width: Optional[int] = None,
) -> torch.Tensor:
    """Run the student on each group at its sizes and `finish(group, output)` (e.g. its per-token
    loss, [b_g, s]); the results in row order: per-token losses [b, s] on the last pipeline
    stage, else the activations to send, [s, b, send_width] (None: the widest group's, h_max;
    what a stage receives is that wide too). `attention_mask`: the micro-batch's ([b, 1, s, s],
    packed conversations', `data.sft.attention_mask_of`), or None (causal)."""
    if len(groups) == 1 and send_width is None:  # one budget, unpadded: nothing to cut or pad
        apply_choice(space, groups[0].choice)
        return finish(groups[0], model(tokens, positions, attention_mask))
    received = _received(model)
    set_input = get_attr_wrapped_model(model, "set_input_tensor")
    widths = [space.check(g.choice.sizes)["hidden"] for g in groups]
    outs = []
    try:
        for g, width in zip(groups, widths):
            apply_choice(space, g.choice)
            if received is not None:
                set_input(g.of(received, 1)[..., :width])
            mask = None if attention_mask is None else g.of(attention_mask)
            outs.append(finish(g, model(g.of(tokens), g.of(positions), mask)))
    finally:
        if received is not None:
            set_input(received)
    order = torch.cat([g.rows for g in groups]).argsort()
    if last_stage:
        return torch.cat(outs, 0).index_select(0, order)
    padded = [F.pad(o, (0, (send_width or max(widths)) - o.shape[-1])) for o in outs]
    return torch.cat(padded, 1).index_select(1, order)
