"""Core attention over a DPP chunk: packed sequences and slices of split sequences.

A chunk is one micro-batch of several segments laid end to end along the token axis (batch
size 1). Each segment attends causally to itself only (a block-diagonal causal mask). A segment
that is a later slice of a split sequence also attends to the K/V of the earlier slices of its
sequence, which earlier chunks computed on this stage: those live in a `PrefixKVCache`, one
entry per (sequence, layer). The query of token i of the slice sees prefix + i + 1 keys (causal
aligned to the bottom right).

Autograd: every segment's attention saves only its q/k/v and recomputes the attention in
backward (as flash attention does), so saved bytes are linear in tokens. A slice's K/V reach the slices after it only through the cache, as detached copies.
The gradient a later slice computes for them is added to the cache's dK/dV buffers; slices run
backward in reverse order, so when slice j runs backward every later slice has already handed
its share down, and slice j adds it to the dK/dV of its own k/v before they flow back into its
QKV projection.

`ChunkCoreAttention` goes into megatron's layer spec in place of `DotProductAttention`;
`PositionedRotaryEmbedding` wraps the GPT model's RoPE so positions continue across slices and
restart in every packed sequence. Both read the chunk being run from a shared `ChunkContext`,
which the runtime sets before each forward and each backward (block recompute re-runs forwards
during backward). With no chunk set, they are plain causal attention and plain RoPE.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from torch import Tensor

from megatron_ext.dpp.planning.plan import Segment

Key = tuple[int, int]  # (sequence, global layer number)


class PrefixKVCache:
    """K/V of the slices of split sequences, and the dK/dV later slices hand back.

    The K/V kept are the very tensors the slice's attention saves for its own backward, so a
    layer that is not recomputed holds them once; a recomputed layer holds only these.
    `hold`, when set (by the memory meter), is given each tensor the cache keeps and returns a
    handle whose release marks the tensor as freed."""

    def __init__(self) -> None:
        self._kv: dict[Key, dict[int, tuple]] = {}
        self._grads: dict[Key, dict[int, tuple]] = {}
        self.hold: Optional[Callable[[Tensor], object]] = None

    def _entry(self, k: Tensor, v: Tensor) -> tuple:
        return (k, v, (self.hold(k), self.hold(v)) if self.hold is not None else ())

    @property
    def nbytes(self) -> int:
        entries = [e for d in (*self._kv.values(), *self._grads.values()) for e in d.values()]
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v, _ in entries)

    def put(self, key: Key, start: int, k: Tensor, v: Tensor) -> None:
        """Keep a slice's K/V for later slices. A recomputed forward stores the same slice again."""
        slices = self._kv.setdefault(key, {})
        if start not in slices:
            slices[start] = self._entry(k.detach(), v.detach())

    def prefix(self, key: Key, start: int) -> tuple[Tensor, Tensor]:
        """K/V of tokens [0, start) of the sequence, from its cached slices."""
        slices = self._kv.get(key, {})
        starts = sorted(s for s in slices if s < start)
        covered = 0
        for s in starts:
            if s != covered:
                break
            covered += slices[s][0].shape[0]
        if covered != start:
            raise RuntimeError(
                f"sequence {key[0]}, layer {key[1]}: a slice at token {start} needs the K/V of "
                f"tokens [0, {start}) but the earlier slices on this stage cover [0, {covered}) "
                "(slices must run forward in order)"
            )
        return torch.cat([slices[s][0] for s in starts]), torch.cat([slices[s][1] for s in starts])

    def add_prefix_grads(self, key: Key, dk: Tensor, dv: Tensor) -> None:
        """Hand dK/dV of tokens [0, len(dk)) down to the slices that hold them."""
        grads = self._grads.setdefault(key, {})
        for s, (k, _, _) in self._kv[key].items():
            if s >= dk.shape[0]:
                continue
            part = slice(s, s + k.shape[0])
            if s in grads:
                grads[s][0].add_(dk[part])
                grads[s][1].add_(dv[part])
            else:
                grads[s] = self._entry(dk[part].clone(), dv[part].clone())

    def take_grads(self, key: Key, start: int) -> Optional[tuple[Tensor, Tensor]]:
        """The dK/dV later slices handed to the slice at `start` (None if there were none)."""
        got = self._grads.get(key, {}).pop(start, None)
        return None if got is None else got[:2]

    def done(self, key: Key, start: int) -> None:
        """The slice at `start` has run backward at this layer; the later slices, which read its
        K/V, already had: its K/V is not needed any more (nor anything, after the first slice)."""
        slices = self._kv.get(key, {})
        slices.pop(start, None)
        if not slices:
            self._kv.pop(key, None)
            self._grads.pop(key, None)

    def __len__(self) -> int:
        return len(self._kv) + len(self._grads)


@dataclasses.dataclass
class ChunkContext:
    """The chunk being run on this stage, shared by every attention and RoPE module of a model."""

    cache: PrefixKVCache = dataclasses.field(default_factory=PrefixKVCache)
    segments: Optional[tuple[Segment, ...]] = None
    seq_lengths: tuple[int, ...] = ()
    padding: int = 0  # tokens after the segments that belong to no sequence

    def enter(self, segments: tuple[Segment, ...], seq_lengths: tuple[int, ...], padding: int = 0) -> None:
        self.segments = tuple(segments)
        self.seq_lengths = tuple(seq_lengths)
        self.padding = padding

    def leave(self) -> None:
        self.segments = None

    def positions(self) -> Optional[Tensor]:
        """Position ids of the chunk's tokens: a slice continues its sequence (start + offset)."""
        if self.segments is None:
            return None
        return torch.cat([torch.arange(s.start, s.start + s.length) for s in self.segments] + [torch.arange(self.padding)])


def attend(q: Tensor, k: Tensor, v: Tensor, prefix: int, scale: float) -> Tensor:
    """Causal attention of q ([sq, b, np, hn]) over k/v ([prefix + sq, b, ng, hn]) whose first
    `prefix` rows precede q; GQA when ng < np. Returns [sq, b, np * hn]."""
    sq, heads = q.shape[0], q.shape[2]
    groups = k.shape[2]
    if heads != groups:
        k = k.repeat_interleave(heads // groups, dim=2)
        v = v.repeat_interleave(heads // groups, dim=2)
    mask = torch.arange(k.shape[0], device=q.device)[None, :] <= torch.arange(sq, device=q.device)[:, None] + prefix
    out = F.scaled_dot_product_attention(
        q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3), attn_mask=mask, scale=scale
    )
    return out.permute(2, 0, 1, 3).reshape(sq, q.shape[1], -1)


class _SliceAttention(torch.autograd.Function):
    """Attention of one slice over its cached prefix; see the module docstring for the backward."""

    @staticmethod
    def forward(ctx, q, k, v, cache: PrefixKVCache, key: Key, start: int, keep: bool, scale: float):
        # Own copies: k/v arrive as views of the fused QKV output, which would otherwise stay
        # alive whole (queries included) for as long as they are saved or cached.
        k, v = k.clone(), v.clone()
        if keep:
            cache.put(key, start, k, v)
        ctx.save_for_backward(q, k, v)
        ctx.cache, ctx.key, ctx.start, ctx.scale = cache, key, start, scale
        if not start:
            return attend(q, k, v, 0, scale)
        pk, pv = cache.prefix(key, start)
        return attend(q, torch.cat([pk, k]), torch.cat([pv, v]), start, scale)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v = ctx.saved_tensors
        cache, key, start = ctx.cache, ctx.key, ctx.start
        pk, pv = cache.prefix(key, start) if start else (k[:0], v[:0])
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_() for t in (q, k, v, pk, pv)]
            lq, lk, lv, lpk, lpv = leaves
            out = attend(lq, torch.cat([lpk, lk]), torch.cat([lpv, lv]), start, ctx.scale)
            dq, dk, dv, dpk, dpv = torch.autograd.grad(out, leaves, grad_out, allow_unused=True)
        handed = cache.take_grads(key, start)
        if handed is not None:
            dk, dv = dk + handed[0], dv + handed[1]
        if start:
            cache.add_prefix_grads(key, dpk, dpv)
        cache.done(key, start)
        return dq, dk, dv, None, None, None, None, None


class ChunkCoreAttention(MegatronModule):
    """Drop-in for megatron's `DotProductAttention` (same constructor and forward) that runs the
    chunk set in `context`: block-diagonal causal attention over its segments, each slice of a
    split sequence also over the cached K/V of the earlier slices."""

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type=None,
        attention_type: str = "self",
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection=None,
        context: Optional[ChunkContext] = None,
    ) -> None:
        super().__init__(config=config)
        if context is None:
            raise ValueError("ChunkCoreAttention needs the model's ChunkContext (see dpp_layer_spec)")
        if config.context_parallel_size > 1:
            raise ValueError("dpp: context parallelism is not supported (parallel.cp must be 1)")
        if (attention_dropout if attention_dropout is not None else config.attention_dropout) > 0:
            raise ValueError("dpp: attention dropout is not supported (model attention_dropout must be 0)")
        self.layer_number = layer_number
        self.context = context
        self.scale = softmax_scale if softmax_scale is not None else config.kv_channels**-0.5

    def forward(
        self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None
    ):
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("dpp attention takes the chunk layout from its ChunkContext, not packed_seq_params")
        segments, padding = self.context.segments, self.context.padding
        if segments is None:
            return attend(query, key, value, 0, self.scale)
        tokens = sum(s.length for s in segments) + padding
        if query.shape[1] != 1 or query.shape[0] != tokens:
            raise ValueError(
                f"dpp attention: got q of shape {tuple(query.shape)} for a chunk of {tokens} tokens (batch size must be 1)"
            )
        outputs, offset = [], 0
        for seg in segments:
            part = slice(offset, offset + seg.length)
            offset += seg.length
            q, k, v = query[part], key[part], value[part]
            # Whole sequences take the same path: it saves only q/k/v (no attention scores),
            # like flash attention, so a chunk's saved bytes are linear in its tokens.
            keep = seg.start + seg.length < self.context.seq_lengths[seg.seq]  # a later slice reads its K/V
            cache_key = (seg.seq, self.layer_number)
            outputs.append(
                _SliceAttention.apply(q, k, v, self.context.cache, cache_key, seg.start, keep, self.scale)
            )
        if padding:  # attends to nothing: its output is zero (and its loss is masked out)
            outputs.append(query.new_zeros(padding, 1, query.shape[2] * value.shape[3]))
        return torch.cat(outputs)


class PositionedRotaryEmbedding(torch.nn.Module):
    """The GPT model's RoPE, at the chunk's position ids instead of 0..T-1. It holds no state of
    its own (RoPE's inverse frequencies are not saved), so checkpoints are unchanged."""

    def __init__(self, rope: torch.nn.Module, context: ChunkContext) -> None:
        super().__init__()
        self.rope = rope
        self.context = context

    def get_rotary_seq_len(self, *args, **kwargs) -> int:
        return self.rope.get_rotary_seq_len(*args, **kwargs)

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group=None) -> Tensor:
        positions = self.context.positions()
        if positions is None:
            return self.rope(max_seq_len, offset, packed_seq, cp_group)
        if positions.numel() != max_seq_len:
            raise ValueError(f"dpp RoPE: {max_seq_len} tokens in the model but {positions.numel()} in the chunk")
        emb = self.rope.get_emb(int(positions.max()) + 1)
        return emb[positions.to(emb.device)]


def dpp_layer_spec(spec: ModuleSpec, context: ChunkContext) -> ModuleSpec:
    """The GPT layer spec with `ChunkCoreAttention` as core attention (local spec only: the
    Transformer Engine spec's fused attention takes its layout from packed_seq_params)."""
    attention = spec.submodules.self_attention
    core = functools.partial(ChunkCoreAttention, context=context)
    submodules = dataclasses.replace(attention.submodules, core_attention=core)
    self_attention = dataclasses.replace(attention, submodules=submodules)
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, self_attention=self_attention))


def use_chunk_positions(gpt_model: torch.nn.Module, context: ChunkContext) -> None:
    """Give a GPT model RoPE at the chunk's positions (idempotent)."""
    if not isinstance(gpt_model.rotary_pos_emb, PositionedRotaryEmbedding):
        gpt_model.rotary_pos_emb = PositionedRotaryEmbedding(gpt_model.rotary_pos_emb, context)
