"""Mamba2's selective state-space scan in pure PyTorch: the recurrence and the chunked SSD form.

Per head h the state S (head_dim x d_state) evolves as

    S_t = exp(dt_t * A_h) * S_{t-1} + dt_t * x_t B_t^T        y_t = S_t C_t

with B and C shared by the heads of a group. `ssd_step` is one token of it (the decode step),
`ssd_recurrence` runs it token by token (the reference), and `ssd_chunked` computes the same
thing with the state-space-dual chunked algorithm: within a chunk the scan is a masked
attention-like matmul whose mask is the cumulative decay; between chunks only the state is
carried. That is L / chunk_size Python steps instead of L, and matmuls instead of outer products.

Shapes: x [b, l, heads, head_dim], dt [b, l, heads] (after softplus), A [heads] (negative),
B and C [b, l, groups, d_state], state [b, heads, head_dim, d_state]. The D skip term, the gate
and the norm are the mixer's business, not the scan's.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def _per_head(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Group-shared B or C ([..., groups, d_state]) repeated for the heads of each group."""
    return t.repeat_interleave(heads // t.shape[-2], dim=-2)


def _zero_state(x: torch.Tensor, d_state: int) -> torch.Tensor:
    b, _, h, p = x.shape
    return x.new_zeros(b, h, p, d_state)


def ssd_step(
    state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token: x [b, heads, head_dim], dt [b, heads], B/C [b, groups, d_state].
    Returns (y [b, heads, head_dim], new state)."""
    heads = x.shape[1]
    decay = torch.exp(dt * A)[..., None, None]
    inflow = (dt[..., None] * x)[..., None] * _per_head(B, heads)[:, :, None, :]
    state = state * decay + inflow
    y = torch.einsum("bhpn,bhn->bhp", state, _per_head(C, heads))
    return y, state


def ssd_recurrence(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    initial_state: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The scan token by token: (y [b, l, heads, head_dim], final state)."""
    state = _zero_state(x, B.shape[-1]) if initial_state is None else initial_state
    ys = []
    for t in range(x.shape[1]):
        y, state = ssd_step(state, x[:, t], dt[:, t], A, B[:, t], C[:, t])
        ys.append(y)
    return torch.stack(ys, dim=1), state


def ssd_chunked(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int,
    initial_state: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same scan, chunk by chunk: (y [b, l, heads, head_dim], final state)."""
    b, length, h, p = x.shape
    n = B.shape[-1]
    # Padding with dt = 0 adds nothing to the state and does not decay it, so the final state
    # is that of the unpadded sequence.
    pad = (-length) % chunk_size
    if pad:
        x, B, C = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (x, B, C))
        dt = F.pad(dt, (0, 0, 0, pad))
    chunks = (length + pad) // chunk_size
    x = x.reshape(b, chunks, chunk_size, h, p)
    dt = dt.reshape(b, chunks, chunk_size, h)
    B = _per_head(B, h).reshape(b, chunks, chunk_size, h, n)
    C = _per_head(C, h).reshape(b, chunks, chunk_size, h, n)

    log_decay = torch.cumsum(dt * A, dim=2)  # [b, c, T, h]: log of the decay since chunk start
    inflow = x * dt[..., None]

    # Inside a chunk: y_i = sum_{j <= i} (C_i . B_j) exp(log_decay_i - log_decay_j) dt_j x_j.
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=x.device).tril()
    between = log_decay[:, :, :, None, :] - log_decay[:, :, None, :, :]  # [b, c, i, j, h]
    mask = torch.exp(between.masked_fill(~causal[:, :, None], float("-inf")))
    scores = torch.einsum("bcihn,bcjhn->bcijh", C, B) * mask
    y = torch.einsum("bcijh,bcjhp->bcihp", scores, inflow)

    # What each chunk adds to the state by its end, and how much the state decays across it.
    to_end = torch.exp(log_decay[:, :, -1:, :] - log_decay)
    added = torch.einsum("bcjhn,bcjh,bcjhp->bchpn", B, to_end, inflow)
    across = torch.exp(log_decay[:, :, -1, :])[..., None, None]  # [b, c, h, 1, 1]

    state = _zero_state(x.reshape(b, -1, h, p), n) if initial_state is None else initial_state
    entering = []
    for c in range(chunks):
        entering.append(state)
        state = state * across[:, c] + added[:, c]
    entering = torch.stack(entering, dim=1)  # [b, c, h, p, n]: the state before each chunk

    # Between chunks: the state entering the chunk, decayed to position i, read out by C_i.
    y = y + torch.einsum("bcihn,bchpn->bcihp", C, entering) * torch.exp(log_decay)[..., None]
    return y.reshape(b, chunks * chunk_size, h, p)[:, :length], state
