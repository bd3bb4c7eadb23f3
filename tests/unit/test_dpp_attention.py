"""DPP chunk attention against megatron's own DotProductAttention on whole sequences.

Each case lays sequences out in chunks (split slices, packed sequences, a hybrid chunk of a
tail slice plus short sequences), runs the chunks forward in order and backward in reverse,
and compares outputs and the gradients of every query/key/value with full causal attention of
each whole sequence, one at a time.
"""

from __future__ import annotations

import pytest
import torch
import torch.utils.checkpoint
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

from megatron_ext.dpp.planning.plan import Segment as S
from megatron_ext.dpp.runtime.attention import ChunkContext, ChunkCoreAttention, PositionedRotaryEmbedding

HEAD_DIM = 8
# name: (sequence lengths, chunks as segment lists, heads, query groups)
CASES = {
    "split_uneven_slices": ((23,), [[S(0, 0, 10)], [S(0, 10, 7)], [S(0, 17, 6)]], 4, 4),
    "packed_block_diagonal": ((5, 7, 4), [[S(0, 0, 5), S(1, 0, 7), S(2, 0, 4)]], 4, 4),
    "hybrid_tail_and_short": (
        (20, 6, 3),
        [[S(0, 0, 12)], [S(0, 12, 8), S(1, 0, 6), S(2, 0, 3)]],
        4,
        4,
    ),
    "two_split_sequences_interleaved_gqa": (
        (11, 9, 4),
        [[S(0, 0, 5)], [S(1, 0, 3), S(2, 0, 4)], [S(0, 5, 4)], [S(1, 3, 6)], [S(0, 9, 2)]],
        4,
        2,
    ),
    "single_token_slices_gqa": ((6,), [[S(0, 0, 1)], [S(0, 1, 1)], [S(0, 2, 4)]], 4, 1),
}


def config(heads: int, groups: int) -> TransformerConfig:
    return TransformerConfig(
        num_layers=1,
        hidden_size=heads * HEAD_DIM,
        num_attention_heads=heads,
        num_query_groups=groups,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        masked_softmax_fusion=False,
    )


def random_qkv(lengths, heads, groups):
    g = torch.Generator().manual_seed(7)

    def leaf(n, h):
        return torch.randn(n, 1, h, HEAD_DIM, generator=g).requires_grad_()

    return [(leaf(n, heads), leaf(n, groups), leaf(n, groups), torch.randn(n, 1, heads * HEAD_DIM, generator=g)) for n in lengths]


def reference(cfg, seqs):
    dpa = DotProductAttention(cfg, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    outs = []
    for q, k, v, w in seqs:
        out = dpa(q, k, v, None)
        (out * w).sum().backward()
        outs.append(out.detach())
    return outs, [[t.grad.clone() for t in (q, k, v)] for q, k, v, _ in seqs]


def run_chunks(cfg, lengths, chunks, seqs, recompute: bool, padding: int = 0):
    """Each chunk's segments, then `padding` rows of random q/k/v (whose output must be zero and
    whose gradient, through the padding's random loss weights, must not reach any sequence)."""
    context = ChunkContext()
    attention = ChunkCoreAttention(cfg, layer_number=3, context=context)
    g = torch.Generator().manual_seed(3)
    pieces = []
    for segments in chunks:
        context.enter(segments, lengths, padding)
        q, k, v = (torch.cat([seqs[s.seq][i][s.start : s.start + s.length] for s in segments]
                             + [torch.randn(padding, 1, seqs[0][i].shape[2], HEAD_DIM, generator=g)]) for i in range(3))
        w = torch.cat([seqs[s.seq][3][s.start : s.start + s.length] for s in segments]
                      + [torch.randn(padding, 1, cfg.num_attention_heads * HEAD_DIM, generator=g)])
        if recompute:  # forward again inside backward, as megatron's block recompute does
            out = torch.utils.checkpoint.checkpoint(attention, q, k, v, None, use_reentrant=True)
        else:
            out = attention(q, k, v, None)
        assert not out[out.shape[0] - padding :].any(), "padding must attend to nothing"
        pieces.append((segments, out, (out * w).sum()))
    for segments, _, loss in reversed(pieces):
        context.enter(segments, lengths, padding)
        loss.backward()
    context.leave()
    assert len(context.cache) == 0 and context.cache.nbytes == 0, "the prefix cache was not emptied"
    outs = [torch.zeros(n, 1, cfg.num_attention_heads * HEAD_DIM) for n in lengths]
    for segments, out, _ in pieces:
        offset = 0
        for s in segments:
            outs[s.seq][s.start : s.start + s.length] = out[offset : offset + s.length].detach()
            offset += s.length
    return outs, [[t.grad.clone() for t in (q, k, v)] for q, k, v, _ in seqs]


@pytest.mark.parametrize("padding", [0, 3], ids=["unpadded", "padded"])
@pytest.mark.parametrize("recompute", [False, True], ids=["stored", "recomputed"])
@pytest.mark.parametrize("name", list(CASES))
def test_chunk_attention_equals_whole_sequences(one_rank_world, name, recompute, padding):
    lengths, chunks, heads, groups = CASES[name]
    cfg = config(heads, groups)
    ref_out, ref_grads = reference(cfg, random_qkv(lengths, heads, groups))
    out, grads = run_chunks(cfg, lengths, chunks, random_qkv(lengths, heads, groups), recompute, padding)
    for i in range(len(lengths)):
        torch.testing.assert_close(out[i], ref_out[i], rtol=1e-5, atol=1e-6)
        for which, got, want in zip("qkv", grads[i], ref_grads[i]):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=f"d{which} of sequence {i}")


def test_slice_before_its_prefix_is_refused(one_rank_world):
    cfg = config(4, 4)
    context = ChunkContext()
    attention = ChunkCoreAttention(cfg, layer_number=1, context=context)
    context.enter((S(0, 5, 5),), (10,))
    q, k, v = torch.randn(5, 1, 4, HEAD_DIM), torch.randn(5, 1, 4, HEAD_DIM), torch.randn(5, 1, 4, HEAD_DIM)
    with pytest.raises(RuntimeError, match=r"needs the K/V of tokens \[0, 5\)"):
        attention(q, k, v, None)


class _Rope(torch.nn.Module):
    """Megatron's RotaryEmbedding contract: get_emb(n) is positions 0..n-1."""

    def get_emb(self, n: int) -> torch.Tensor:
        return torch.arange(n, dtype=torch.float32)[:, None, None, None] * torch.tensor([1.0, 0.5])

    def forward(self, n, offset=0, packed_seq=False, cp_group=None):
        return self.get_emb(n)


def test_rope_positions_continue_across_slices_and_restart_per_packed_sequence():
    context = ChunkContext()
    rope = PositionedRotaryEmbedding(_Rope(), context)
    context.enter((S(0, 12, 3), S(1, 0, 2)), (15, 2))
    got = rope(5)[:, 0, 0, 0]
    assert got.tolist() == [12.0, 13.0, 14.0, 0.0, 1.0]
    context.leave()
    assert rope(4)[:, 0, 0, 0].tolist() == [0.0, 1.0, 2.0, 3.0]
