"""The stall simulator's round model against times worked out by hand, and its adapter against a
real plan's bytes."""

from __future__ import annotations

import dataclasses
import math

import pytest

from megatron_ext.config.store import MODEL_PRESETS
from megatron_ext.reshard import simulate as sim
from megatron_ext.reshard.execute import rounds
from megatron_ext.parallel.layout import ParallelLayout as L
from megatron_ext.reshard.plan import plan
from megatron_ext.reshard.simulate import Transfer as T
from megatron_ext.reshard.vps import layout_pieces

TINY = dataclasses.replace(MODEL_PRESETS["llama_tiny"], vocab_size=256)

# Round numbers so that every expected time below is exact arithmetic.
CLUSTER = sim.Cluster(
    name="hand",
    gpus_per_node=1,  # two ranks: two nodes, the inter-node link
    intra=sim.Link(bandwidth=1000.0, latency_s=0.01),
    inter=sim.Link(bandwidth=100.0, latency_s=0.5),
    copy_bandwidth=50.0,
    copy_overhead_s=0.1,
    collective_step_s=0.2,
    switch_s=1.0,
    build_fixed_s=3.0,
    build_bandwidth=10.0,
    storage=sim.Storage(
        write_per_node=20.0, read_per_node=40.0, serialize_bandwidth=5.0, save_fixed_s=1.0, load_fixed_s=2.0
    ),
)

# Rank 0 sends 300 bytes to rank 1 in 2 ops, rank 1 sends 100 bytes to rank 0 in 1 op, and rank
# 0 copies 100 bytes locally in 1 op.
HAND_ROUND = (T(0, 1, 300, copies=2), T(1, 0, 100), T(0, 0, 100))


def test_two_ranks_hand_worked():
    # Rank 0: copies 2 packs + 1 unpack + 1 local = 4 -> 4 * 0.1 = 0.4 s;
    #   inter link: 2 messages (to 1, from 1) * 0.5 = 1.0 s, duplex max(300, 100) / 100 = 3.0 s;
    #   local 100 / 50 = 2.0 s; work 0.4 + 4.0 + 2.0 = 6.4 s.
    # Rank 1: copies 2 unpacks + 1 pack = 3 -> 0.3 s; inter 1.0 + max(100, 300) / 100 = 4.0 s;
    #   no local; work 4.3 s.
    # The round ends with the slowest rank: 6.4 s (no barriers per round in this cluster).
    # Transfer: no setup, 6.4 s, then the success report: a collective over 2 ranks,
    #   ceil(log2 2) = 1 step of 0.2 s -> 6.6 s.
    # Stall: agree = three collectives (no round cutting given), 0.6 s; switch = 1.0 + 0.2 =
    #   1.2 s; total 0.6 + 1.2 + 6.6 = 8.4 s.
    work = sim.rank_work(HAND_ROUND, CLUSTER)
    assert work == pytest.approx({0: 6.4, 1: 4.3})
    assert sim.round_seconds(HAND_ROUND, CLUSTER, world=2) == pytest.approx(6.4)
    s = sim.stall([HAND_ROUND], CLUSTER, world=2)
    assert (s.agree, s.switch, s.transfer) == pytest.approx((0.6, 1.2, 6.6))
    assert s.total == pytest.approx(8.4)


# name -> (cluster changes, world, each rank's round cutting, expected agree seconds).
AGREE_CASES = {
    # Two ranks on two nodes: 3 collectives of 1 step (0.6 s), then the slower cut, 0.5 s.
    "own cores": ({}, 2, {0: 0.3, 1: 0.5}, 0.6 + 0.5),
    # Four ranks on one node sharing 2 cores: 3 collectives of 2 steps (1.2 s); the node's
    # 0.3 + 0.5 + 0.4 + 0.4 = 1.6 s of cutting over 2 cores, 0.8 s, is longer than any rank's.
    "shared cores": ({"gpus_per_node": 4, "cores_per_node": 2}, 4, {0: 0.3, 1: 0.5, 2: 0.4, 3: 0.4}, 1.2 + 0.8),
    # The memory cap counts copied bytes; cutting copies none, so it does not apply.
    "memory cap ignored": ({"gpus_per_node": 2, "node_copy_bandwidth": 1.0}, 2, {0: 0.3, 1: 0.5}, 0.6 + 0.5),
}


@pytest.mark.parametrize("name", list(AGREE_CASES))
def test_agree_table(name):
    changes, world, cut, expected = AGREE_CASES[name]
    cluster = dataclasses.replace(CLUSTER, **changes)
    assert sim.stall([], cluster, world, cut=cut).agree == pytest.approx(expected)


# name -> (cluster changes, rounds, world, expected transfer seconds), each worked by hand.
CASES = {
    # Both ranks on one node: the intra link. Rank 0: 0.4 + (2 * 0.01 + 300 / 1000) + 2.0 = 2.72;
    # rank 1: 0.3 + 0.02 + 0.3 = 0.62. Transfer 2.72 + 0.2.
    "intra-node": ({"gpus_per_node": 2}, [HAND_ROUND], 2, 2.72 + 0.2),
    # Not duplex: sends then receives. Rank 0: 0.4 + 1.0 + (300 + 100) / 100 + 2.0 = 7.4;
    # rank 1: 0.3 + 1.0 + 4.0 = 5.3. Transfer 7.4 + 0.2.
    "inter-node, not duplex": (
        {"inter": sim.Link(bandwidth=100.0, latency_s=0.5, duplex=False)}, [HAND_ROUND], 2, 7.4 + 0.2
    ),
    # Phased (a barrier between packing and unpacking). Send phase: rank 0 packs 2 and copies 1
    # (0.3) + 1 peer 0.5 + 300 / 100 + local 2.0 = 5.8; rank 1 0.1 + 0.5 + 1.0 = 1.6. Receive
    # phase: rank 0 0.1 + 0.5 + 1.0 = 1.6; rank 1 unpacks 2: 0.2 + 0.5 + 3.0 = 3.7.
    # Round 5.8 + 3.7 = 9.5; transfer 9.5 + 0.2.
    "phased": ({"phased": True}, [HAND_ROUND], 2, 9.5 + 0.2),
    # Three rounds: 6.4, then rank 1 -> 0 200 bytes (each rank 0.1 + 0.5 + 2.0 = 2.6), then a
    # local-only round on rank 1 (0.1 + 50 / 50 = 1.1); two barriers of 0.2 s per round:
    # 3 * 0.4 + 6.4 + 2.6 + 1.1 + the report 0.2.
    "three rounds, two barriers each": (
        {"round_collectives": 2}, [HAND_ROUND, (T(1, 0, 200),), (T(1, 1, 50),)], 2,
        3 * 0.4 + 6.4 + 2.6 + 1.1 + 0.2,
    ),
    # Local copies only, 4 ranks: no network, no setup; the slowest rank copies 200 bytes in 3
    # ops: 0.3 + 4.0. The report: ceil(log2 4) = 2 steps, 0.4 s.
    "local only": ({}, [(T(0, 0, 100), T(3, 3, 200, copies=3), T(2, 2, 50))], 4, 4.3 + 0.4),
    # Four ranks on one node sharing 2 cores, each copying 100 bytes in 1 op (2.1 s of work):
    # the node's 8.4 s over 2 cores, 4.2 s, is longer than any rank's 2.1 s.
    "shared cores": (
        {"gpus_per_node": 4, "cores_per_node": 2}, [tuple(T(r, r, 100) for r in range(4))], 4, 4.2 + 0.4
    ),
    # Four ranks on one node sharing a memory that copies 100 B/s: each copies 100 bytes
    # locally (2.1 s of work), the node's 400 bytes take 4.0 s, longer than any rank's work.
    "shared memory bus": (
        {"gpus_per_node": 4, "node_copy_bandwidth": 100.0}, [tuple(T(r, r, 100) for r in range(4))], 4, 4.0 + 0.4
    ),
    # Phased on one node with a memory of 80 B/s. Send phase: rank 0 packs 300 and copies 100
    # locally, rank 1 packs 100: 500 bytes, 6.25 s, over rank 0's 0.3 + (0.01 + 0.3) + 2.0 =
    # 2.61 s. Receive phase: 400 bytes unpacked, 5.0 s, over rank 1's 0.2 + 0.01 + 0.3 = 0.51 s.
    "phased, shared memory bus": (
        {"gpus_per_node": 2, "phased": True, "node_copy_bandwidth": 80.0}, [HAND_ROUND], 2, 6.25 + 5.0 + 0.2
    ),
    # The transport's setup: 0.5 s + the largest round of sends, rank 0's 300 bytes, at 600 B/s.
    "setup": ({"setup_s": 0.5, "setup_bandwidth": 600.0}, [HAND_ROUND], 2, 0.5 + 0.5 + 6.4 + 0.2),
    # First touches at 100 B/s: rank 0 packs 300 bytes (its largest round) and reads rank 1's
    # 100: 4.0 s; rank 1 packs 100 and reads 300: 4.0 s.
    "first touch": ({"touch_bandwidth": 100.0}, [HAND_ROUND], 2, 4.0 + 6.4 + 0.2),
    # First touches over two rounds on three ranks, each on its own node and core, at 100 B/s.
    # Round 1: 0 -> 1 300 bytes, 0 -> 2 100, 2 -> 1 50; round 2: 0 -> 1 200, 1 -> 2 400.
    # Rank 0 packs at most 400 (round 1), reads nothing: 4.0 s. Rank 1 packs 400 (round 2),
    # reads rank 0's largest 300 and rank 2's 50: 7.5 s. Rank 2 packs 50, reads rank 0's 100
    # and rank 1's 400: 5.5 s. The touch: the slowest rank, 7.5 s.
    # Rounds: round 1 rank 0 copies 2 (0.2) + 2 messages (1.0) + 400 / 100 = 5.2 (the slowest:
    # rank 1 0.2 + 1.0 + 350 / 100 = 4.7, rank 2 0.2 + 1.0 + 1.5 = 2.7); round 2 rank 1 0.2 +
    # 1.0 + 600 / 100 = 7.2 (not duplex). Report: ceil(log2 3) = 2 steps, 0.4 s.
    "first touch, two rounds, three ranks": (
        {"touch_bandwidth": 100.0, "inter": sim.Link(bandwidth=100.0, latency_s=0.5, duplex=False)},
        [(T(0, 1, 300), T(0, 2, 100), T(2, 1, 50)), (T(0, 1, 200), T(1, 2, 400))], 3,
        7.5 + 5.2 + 7.2 + 0.4,
    ),
    # First touches of four ranks on one node sharing 2 cores, at 100 B/s: a ring of 100-byte
    # messages, each rank touching 200 bytes (2.0 s); the node's 8.0 s over 2 cores: 4.0 s.
    # The round: each rank copies 2 (0.2) + 2 messages * 0.01 + duplex max(100, 100) / 1000 =
    # 0.32 s; the node's 1.28 s over 2 cores: 0.64 s. Report: 2 steps, 0.4 s.
    "first touch, shared cores": (
        {"touch_bandwidth": 100.0, "gpus_per_node": 4, "cores_per_node": 2},
        [tuple(T(r, (r + 1) % 4, 100) for r in range(4))], 4, 4.0 + 0.64 + 0.4,
    ),
}


def test_touched_bytes_hand_worked():
    # The two-round case above: rank 0 packs 400, rank 1 packs 400 and reads 300 + 50, rank 2
    # packs 50 and reads 100 + 400; a local copy touches no staging.
    traffic = [(T(0, 1, 300), T(0, 2, 100), T(2, 1, 50), T(2, 2, 999)), (T(0, 1, 200), T(1, 2, 400))]
    assert sim.touched_bytes(traffic) == {0: 400, 1: 750, 2: 550}


@pytest.mark.parametrize("name", list(CASES))
def test_transfer_table(name):
    changes, traffic, world, expected = CASES[name]
    cluster = dataclasses.replace(CLUSTER, **changes)
    assert sim.transfer_seconds(traffic, cluster, world) == pytest.approx(expected)


def test_built_at_the_switch_adds_the_build():
    # build = 3.0 + the most any rank holds in B, 40 bytes, at 10 B/s = 7.0 s on top of the
    # switch's 1.2 s.
    s = sim.stall([HAND_ROUND], CLUSTER, world=2, held_b={0: 40, 1: 20}, built_ahead=False)
    assert s.switch == pytest.approx(1.2 + 7.0)
    with pytest.raises(ValueError, match="held_b"):
        sim.stall([HAND_ROUND], CLUSTER, world=2, built_ahead=False)


def test_checkpoint_route_hand_worked():
    # Ranks 0 and 1 on two nodes hold 30 and 10 bytes in A, 40 and 40 in B; the state is 40 bytes.
    # save = 1.0 + max(30 / 5 = 6.0, 40 / (2 nodes * 20) = 1.0) = 7.0
    # build = 3.0 + 40 / 10 = 7.0
    # load = 2.0 + max(40 / 5 = 8.0, 80 / (2 * 40) = 1.0) = 10.0
    route = sim.checkpoint_route({0: 30, 1: 10}, {0: 40, 1: 40}, 40, CLUSTER)
    assert (route.save, route.build, route.load) == pytest.approx((7.0, 7.0, 10.0))
    # A file system capped at 4 B/s writes the 40 bytes in 10 s: the save's longer term.
    capped = dataclasses.replace(CLUSTER, storage=dataclasses.replace(CLUSTER.storage, write_aggregate=4.0))
    assert sim.checkpoint_route({0: 30, 1: 10}, {0: 40, 1: 40}, 40, capped).save == pytest.approx(11.0)


def test_adapter_keeps_a_real_plans_bytes_and_ops():
    p = plan(TINY, L(tp=2), L(dp=2))
    steps = rounds(p, 1 << 16)  # a small budget: several rounds
    traffic = sim.traffic_from_rounds(steps)
    assert len(traffic) == len(steps) > 1
    network = [t for r in traffic for t in r if not t.local]
    local = [t for r in traffic for t in r if t.local]
    assert sum(t.nbytes for t in network) == p.network_bytes
    assert sum(t.nbytes for t in local) == sum(p.local_bytes(r) for r in range(p.world))
    assert sum(t.copies for r in traffic for t in r) == sum(len(s.ops) for s in steps)
    for rank in range(p.world):
        assert sum(t.nbytes for t in network if t.src == rank) == p.sent(rank)
        assert sum(t.nbytes for t in network if t.dst == rank) == p.received(rank)


def test_held_and_state_bytes_from_pieces():
    # TP2 splits every state in two; DP2 replicates params and shards optimizer states, so each
    # rank holds more in DP2 while the state itself is the same size.
    a, b = layout_pieces(TINY, L(tp=2)), layout_pieces(TINY, L(dp=2))
    held_a, held_b = sim.held_bytes(a), sim.held_bytes(b)
    assert sim.state_bytes(a) == sim.state_bytes(b)
    assert sum(held_a.values()) < sum(held_b.values())
    assert math.isclose(sum(held_a.values()), sim.state_bytes(a), rel_tol=0.01)  # only the step is on both
