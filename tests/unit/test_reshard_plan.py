"""Reshard plans between named layouts, checked element by element (brute force).

For each pair: every destination element is received exactly once; an op reads only what its
source rank holds in layout A; network bytes equal the elements a destination rank lacks; and
the plan, a pure function, hashes the same in another process.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import random
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from megatron_ext.config.store import MODEL_PRESETS
from megatron_ext.config.validate import ConfigError
from megatron_ext.reshard.boxes import contains, numel
from megatron_ext.parallel.layout import ParallelLayout as L
from megatron_ext.reshard.plan import _plan, plan
from megatron_ext.reshard.vps import layout_pieces, model_key

ROOT = Path(__file__).resolve().parents[2]
# The run's padded vocabulary, fixed for the run (divisible by every tp used with the model).
TINY = dataclasses.replace(MODEL_PRESETS["llama_tiny"], vocab_size=256)
GQA_UNTIED = dataclasses.replace(MODEL_PRESETS["llama_tiny_gqa"], vocab_size=256)
MOE = dataclasses.replace(MODEL_PRESETS["llama_moe_tiny"], vocab_size=256)
SIX_HEADS = dataclasses.replace(
    TINY,
    name="six_heads",
    num_attention_heads=6,
    hidden_size=192,
    ffn_hidden_size=384,
    vocab_size=384,
)

# name -> (model, layout A, layout B)
PAIRS = {
    "tp1->tp2": (TINY, L(dp=4), L(tp=2, dp=2)),
    "tp2->pp2": (TINY, L(tp=2), L(pp=2)),
    "tp2pp2->pp2dp2": (TINY, L(tp=2, pp=2), L(pp=2, dp=2)),
    "dp2->dp4 (world grows)": (TINY, L(dp=2), L(dp=4)),
    "tp2dp2->tp2 (world shrinks, gqa, untied)": (GQA_UNTIED, L(tp=2, dp=2), L(tp=2)),
    "tp3->tp2 (6 heads)": (SIX_HEADS, L(tp=3, dp=2), L(tp=2, dp=3)),
    "ep2->ep1 (moe)": (MOE, L(dp=2, ep=2), L(dp=2)),
    "pp2->pp2vpp2": (TINY, L(pp=2), L(pp=2, vpp=2)),
    # Same sizes, layers moved between stages: 4 = 2 + 2 -> 1 + 3 -> 1 + 2 + 1 (world grows).
    "pp2->pp2 first1 (uneven)": (TINY, L(pp=2), L(pp=2, first_stage_layers=1)),
    "pp2 first1->pp3 first1 last1 (uneven)": (
        TINY, L(pp=2, first_stage_layers=1), L(pp=3, first_stage_layers=1, last_stage_layers=1)
    ),
}


def _slices(box) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in box)


def _held(pieces) -> dict:
    """(rank, name, state) -> how many of the rank's pieces hold each element."""
    held = {}
    for p in pieces:
        key = (p.rank, p.name, p.state)
        if key not in held:
            held[key] = torch.zeros(p.shape, dtype=torch.int32)
        held[key][_slices(p.box)] += 1
    return held


@pytest.fixture(scope="module", params=list(PAIRS))
def case(request):
    model, a, b = PAIRS[request.param]
    return request.param, model, a, b, plan(model, a, b)


def test_layout_pieces_cover_each_state_and_never_overlap_on_a_rank(case):
    _, model, a, b, _ = case
    for layout in (a, b):
        held = _held(layout_pieces(model, layout))
        assert all(int(h.max()) == 1 for h in held.values())  # a rank's pieces are disjoint
        union = defaultdict(lambda: 0)
        for (_, name, state), h in held.items():
            union[(name, state)] = union[(name, state)] + h
        assert all(bool((u > 0).all()) for u in union.values())  # every element is somewhere


def assert_exact_coverage(p) -> None:
    """Every element of every destination piece is written by exactly one op."""
    received = {t: torch.zeros([b - a for a, b in t.box], dtype=torch.int32) for t in p.targets}
    for op in p.ops:
        target = op.target
        assert (op.dst, op.name, op.state) == (target.rank, target.name, target.state)
        assert contains(target.box, op.box)
        corner = [a for a, _ in target.box]
        received[target][tuple(slice(a - c, b - c) for (a, b), c in zip(op.box, corner))] += 1
    assert len(received) == len(p.targets)  # each target piece once
    assert all(bool((r == 1).all()) for r in received.values())


def assert_sources_held(model, a, p) -> None:
    """Every op reads only what its source rank holds in layout A."""
    held = _held(layout_pieces(model, a))
    sources = set(p.sources)
    for op in p.ops:
        assert bool((held[(op.src, op.name, op.state)][_slices(op.box)] > 0).all())
        source = op.source
        assert source in sources and source.rank == op.src and contains(source.box, op.box)


def assert_minimal(model, a, p) -> None:
    """Network bytes = the destination elements whose rank lacks them in A, counted one by one;
    and nothing a destination already holds crosses the network."""
    held = _held(layout_pieces(model, a))
    missing = 0
    for t in p.targets:
        have = held.get((t.rank, t.name, t.state))
        lacking = numel(t.box) if have is None else int((have[_slices(t.box)] == 0).sum())
        missing += lacking * (t.nbytes // numel(t.box))
    assert p.network_bytes == p.min_bytes == missing
    for op in p.ops:
        have = held.get((op.dst, op.name, op.state))
        assert op.local or have is None or not bool(have[_slices(op.box)].any())


def test_every_destination_element_is_received_exactly_once(case):
    assert_exact_coverage(case[-1])


def test_every_op_reads_what_its_source_rank_holds_in_layout_a(case):
    _, model, a, _, p = case
    assert_sources_held(model, a, p)


def test_network_bytes_are_the_minimum(case):
    _, model, a, _, p = case
    assert_minimal(model, a, p)


def test_plan_is_cached_recomputes_identically_and_is_summarised(case):
    name, model, a, b, p = case
    assert plan(dataclasses.replace(model), a, b) is p
    assert _plan.__wrapped__(model_key(model), a, b).digest == p.digest
    text = p.summary()
    assert "ratio 1.00" in text and f"{a} -> {b}" in text
    assert len(text.splitlines()) == 3 + p.world


def test_plan_hash_is_the_same_in_another_process():
    script = (
        "import json, sys; sys.path.insert(0, 'tests/unit'); import test_reshard_plan as t;"
        "print(json.dumps({n: t.plan(*c).digest for n, c in t.PAIRS.items()}))"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "PYTHONHASHSEED": "123"}
    command = [sys.executable, "-c", script]
    out = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    other = json.loads(out.stdout.strip().splitlines()[-1])
    assert other == {n: plan(*c).digest for n, c in PAIRS.items()}


def test_invalid_layouts_are_refused_before_planning():
    with pytest.raises(ConfigError, match="num_attention_heads"):
        plan(TINY, L(tp=2), L(tp=8))


def random_case(rng: random.Random, model=None):
    """A small random model (or `model`) and two layouts valid for it (the runtime's rules
    decide)."""
    heads = rng.choice([2, 3, 4, 6])
    model = model or dataclasses.replace(
        TINY,
        name="random",
        num_layers=rng.choice([2, 4]),
        num_attention_heads=heads,
        num_query_groups=rng.choice([None, heads]),
        hidden_size=heads * 16,
        ffn_hidden_size=96,
        vocab_size=384,
        tie_embeddings=rng.random() < 0.5,
        num_experts=rng.choice([None, 4]),
        moe_ffn_hidden_size=48,
    )
    layouts = []
    for world in rng.sample([2, 3, 4, 6], 2):
        sizes = itertools.product([1, 2, 3], [1, 2], [1, 2], [1, 2, 4], [None, 2])
        candidates = [
            L(tp=tp, pp=pp, dp=world // (tp * pp * cp), cp=cp, ep=ep, vpp=vpp)
            for tp, pp, cp, ep, vpp in sizes
            if world % (tp * pp * cp) == 0
        ]
        valid = [layout for layout in candidates if not layout.violations(model, "cpu")]
        layouts.append(rng.choice(valid))
    return model, *layouts


@pytest.mark.parametrize("seed", range(6))
def test_random_models_and_layouts(seed):
    model, a, b = random_case(random.Random(seed))
    p = plan(model, a, b)
    assert_exact_coverage(p)
    assert_sources_held(model, a, p)
    assert_minimal(model, a, p)


# --- a rank's own plan -------------------------------------------------------------------------

RANDOM_MODELS = 3
LAYOUTS_PER_MODEL = 4


def random_moves() -> list:
    """Every move between LAYOUTS_PER_MODEL random layouts of each of RANDOM_MODELS random
    models: about 50 moves and three hundred ranks, at the cost of one skeleton per
    (model, layout, stage)."""
    rng = random.Random(27)
    moves = []
    for _ in range(RANDOM_MODELS):
        model = random_case(rng)[0]
        layouts = {layout for _ in range(LAYOUTS_PER_MODEL) for layout in random_case(rng, model)[1:]}
        layouts = sorted(layouts, key=str)[:LAYOUTS_PER_MODEL]
        moves += [(model, a, b) for a in layouts for b in layouts]
    return moves


def test_each_rank_plans_exactly_its_part_of_the_world_plan():
    """For about fifty random moves: rank_plan(r) is the world plan's ops of rank r, op for op
    and in order (same pieces, boxes and bytes), and the ranks' ops together are the world's."""
    from megatron_ext.reshard.plan import rank_plan
    from megatron_ext.reshard.skeleton import standalone_world

    with standalone_world():  # one for every skeleton of every move
        check_rank_plans(random_moves(), rank_plan)


def check_rank_plans(moves, rank_plan) -> None:
    for model, a, b in moves:
        p = plan(model, a, b)
        union = set()
        for rank in range(p.world):
            mine = rank_plan(model, a, b, rank)
            assert mine.ops == p.restricted(rank).ops, (model.name, str(a), str(b), rank)
            assert mine.digest == p.digest
            union.update(mine.ops)
        assert union == set(p.ops) and len(p.ops) == len(set(p.ops))


@pytest.mark.parametrize("name", ["tp2->pp2", "tp3->tp2 (6 heads)", "ep2->ep1 (moe)", "pp2->pp2vpp2"])
def test_positions_derived_from_one_skeleton_per_stage_are_their_own_skeletons(name):
    from megatron_ext.reshard.vps import built_position_shards, model_key, position_shards

    model, a, b = PAIRS[name]
    for layout in (a, b, L(tp=2, pp=2, dp=2, ep=2) if model.num_experts else L(tp=2, pp=2, vpp=2)):
        built = built_position_shards(model, layout)
        assert {p: position_shards(model_key(model), layout, p) for p in built} == built


@pytest.mark.parametrize("name", ["tp2pp2->pp2dp2", "dp2->dp4 (world grows)", "ep2->ep1 (moe)"])
def test_bytes_and_balance_at_scale_without_the_world_plan_are_the_world_plans(name):
    from megatron_ext.reshard.plan_scale import measure_rank_plan, moved_bytes, send_balance

    model, a, b = PAIRS[name]
    p = plan(model, a, b)
    assert moved_bytes(model, a, b) == {"network_bytes": p.network_bytes, "min_bytes": p.min_bytes}
    sent = [p.sent(r) for r in range(p.world)]
    assert send_balance(model, a, b)["max_sent_bytes"] == max(sent)
    measured = measure_rank_plan(model, a, b, ranks=[0, 1])
    assert measured["network_bytes_of_rank"] == p.sent(measured["slowest_rank"]) + p.received(measured["slowest_rank"])
