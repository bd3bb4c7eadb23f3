"""DPP chunking (Alg. 1): every token of the batch lands in exactly one chunk, chunk kinds are
what their segments say, the equal-time mesh is equal in time, and packing keeps the token
target. Checked against independent recounts, not against the chunker's own bookkeeping."""

from __future__ import annotations

import pytest

from megatron_ext.dpp.planning.chunking import blended_mesh, chunk_batch, equal_time_mesh
from megatron_ext.dpp.planning.costmodel import CostModel
from megatron_ext.dpp.planning.plan import Chunk, Segment

COST = CostModel(alpha=1e-6, beta=2e-9, gamma=1e-4, t0=64.0)

# name -> (lengths, k, balanced)
CASES = {
    "one long + shorts, k=4": ([4096, 100, 200, 50, 700, 30, 1000], 4, True),
    "two long of different length": ([3000, 5000, 64, 64, 128], 3, True),
    "all short, k=1 (pure packing)": ([10, 20, 30, 40, 500, 7], 1, True),
    "long sequence exactly on the mesh": ([2048, 2048, 100], 2, True),
    "every length equal": ([256] * 9, 3, True),
    "ablation: even mesh, no time target": ([4096, 100, 200, 50, 700, 30, 1000], 4, False),
    "k larger than the shortest long": ([900, 9000, 5, 6], 8, True),
    "mesh halfway between even and equal-time": ([4096, 100, 200, 50, 700, 30, 1000], 4, 0.5),
}


def _check_kind(c: Chunk, lengths: list[int]) -> None:
    partial = [s for s in c.segments if s.start > 0 or s.length < lengths[s.seq]]
    whole = [s for s in c.segments if s not in partial]
    if c.kind == "packed":
        assert not partial and whole
    elif c.kind == "split":
        assert len(c.segments) == 1 and partial
    else:
        assert c.kind == "hybrid" and len(partial) == 1 and whole
        # the partial segment of a hybrid chunk is a tail: it ends its sequence
        assert partial[0].start + partial[0].length == lengths[partial[0].seq]


@pytest.mark.parametrize("name", CASES)
def test_chunking_covers_every_token_once_with_right_kinds(name):
    lengths, k, balanced = CASES[name]
    chunks = chunk_batch(lengths, COST, k, balanced)
    assert [c.id for c in chunks] == list(range(len(chunks)))
    seen = {s: [0] * n for s, n in enumerate(lengths)}
    for c in chunks:
        for seg in c.segments:
            for t in range(seg.start, seg.start + seg.length):
                seen[seg.seq][t] += 1
        _check_kind(c, lengths)
    assert all(v == 1 for counts in seen.values() for v in counts)
    # token target: no chunk holds more tokens than the first (largest) slice of the longest
    cap = max(c.tokens for c in chunks if any(s.seq == lengths.index(max(lengths)) for s in c.segments))
    assert all(c.tokens <= cap for c in chunks)
    # slices of one sequence are created in order (the schedule relies on it)
    for s in range(len(lengths)):
        starts = [seg.start for c in chunks for seg in c.segments if seg.seq == s]
        assert starts == sorted(starts)


@pytest.mark.parametrize("longest,k", [(4096, 4), (10000, 7), (131072, 16), (500, 3)])
def test_mesh_slices_take_equal_time(longest, k):
    mesh = equal_time_mesh(longest, k, COST)
    assert mesh[0] == 0 and mesh[-1] == longest and len(mesh) == k + 1
    times = [COST.layer_forward_s(Chunk(0, "split", (Segment(0, a, b - a),))) for a, b in zip(mesh, mesh[1:])]
    # all but the last slice at the same time (integer tokens), the last no longer than them
    assert max(times[:-1]) - min(times[:-1]) <= 2 * COST.segment_work(1, longest) + 1e-12
    assert times[-1] <= max(times[:-1]) + 2 * COST.segment_work(1, longest)
    lengths = [b - a for a, b in zip(mesh, mesh[1:])]
    assert lengths[:-1] == sorted(lengths[:-1], reverse=True)  # later slices are shorter


@pytest.mark.parametrize("share", [0.0, 0.25, 0.5, 1.0])
def test_blended_mesh_lies_its_share_of_the_way_from_even_to_equal_time(share):
    longest, k = 10000, 5
    even = [round(i * longest / k) for i in range(k + 1)]  # recounted, not the chunker's own
    timed = equal_time_mesh(longest, k, COST)
    mesh = blended_mesh(longest, k, COST, share)
    assert mesh[0] == 0 and mesh[-1] == longest and len(mesh) == k + 1
    assert all(abs(m - (e + share * (t - e))) <= 0.5 for m, e, t in zip(mesh, even, timed))


@pytest.mark.parametrize("prefix,time_s", [(0, 1e-3), (1000, 5e-3), (50000, 0.2), (0, 1e-5)])
def test_slice_tokens_is_the_longest_slice_within_time(prefix, time_s):
    q = COST.slice_tokens(time_s, prefix)
    t = lambda n: COST.layer_forward_s(Chunk(0, "split", (Segment(0, prefix, n),)))  # noqa: E731
    if q > 0:
        assert t(q) <= time_s * (1 + 1e-12)
    assert t(q + 1) > time_s
