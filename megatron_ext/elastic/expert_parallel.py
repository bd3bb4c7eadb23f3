"""Elastic distillation under expert parallelism: the ranks of an EP group draw together.

Under expert parallelism (`parallel.ep`) the ranks of an EP group are data-parallel replicas with
micro-batches of their own, and an MoE layer sends every token to the EP rank that holds its
expert: an expert runs the tokens of every peer at its own rank's sizes (its FFN width, and the
dispatcher exchanges hidden states of one width). Drawn per replica, a peer's tokens would run at
another budget's sizes, or the exchange would fail on mismatched widths. So the peers' concurrent
micro-batches must train at one budget and one router sample (with budget_draw=sample: the same
budgets row by row, so they run the same budget groups at the same sizes, one dispatcher call per
group on every peer).

`elastic.budget_share` consecutive global micro-batches draw together (`distill.draw_key`).
Megatron's sampler deals replica r the global micro-batches m * dp + r, and megatron's EP group
is ep consecutive data-parallel ranks, so with budget_share a multiple of ep the peers' m-th
micro-batches share one window; `check_peers_share` verifies it on the real groups before the
first step. A one-process run with the same budget_share draws the same budgets and router samples
for the same micro-batches: its exact reference.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_ext.elastic.distill import draw_key


def check_budget_share_for_ep(share: int, ep: int) -> None:
    """Refused before anything is built: a window that does not hold whole EP groups."""
    if ep > 1 and share % ep:
        raise ValueError(
            f"elastic.budget_share={share} must be a multiple of parallel.ep={ep}: the EP ranks run each "
            f"other's tokens through their experts at their own sizes, so an EP group's micro-batches must "
            f"draw one budget and router sample together; set elastic.budget_share={ep} (or a multiple), "
            f"and give a one-process reference run the same value"
        )


def peers_share_windows(share: int, dp: int, peer_dp_ranks: list[int]) -> bool:
    """Whether every micro-batch slot m of the peers (data-parallel ranks `peer_dp_ranks`) falls in
    one window of `share` global micro-batches. (m * dp + r) // share repeats with period
    `share` in m (up to a shift), so the first `share` slots tell."""
    return all(len({draw_key(m * dp + r, share) for r in peer_dp_ranks}) == 1 for m in range(share))


def check_peers_share(share: int, dp_rank: int, dp: int, ep_group) -> None:
    """Collective over the EP group: refuse a layout whose EP peers would draw apart."""
    ep = dist.get_world_size(ep_group)
    if ep == 1:
        return
    ranks = [torch.zeros(1, dtype=torch.long) for _ in range(ep)]
    dist.all_gather(ranks, torch.tensor([dp_rank]), group=ep_group)
    peers = [int(r) for r in ranks]
    if not peers_share_windows(share, dp, peers):
        raise ValueError(
            f"elastic: the expert-parallel peers (data-parallel ranks {peers} of {dp}) do not hold micro-batches "
            f"of one window of elastic.budget_share={share} global micro-batches, so they would draw different "
            f"budgets while running each other's tokens"
        )
