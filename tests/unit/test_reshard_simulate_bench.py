"""scripts/bench/reshard_simulate.py's description of the machine from its micro-benchmark,
against numbers worked out by hand, and its timing of each rank's round cutting."""

from __future__ import annotations

import dataclasses
import math

import pytest

from megatron_ext.config.store import MODEL_PRESETS
from megatron_ext.parallel.layout import ParallelLayout as L
from tests.unit._bench_scripts import bench_script

SIZES = (1 << 20, 1 << 22, 1 << 24)


@pytest.fixture(scope="module")
def bench():
    # imported by name from its folder, so that a spawned process finds it too
    with bench_script("reshard_simulate") as module:
        yield module


def line(fixed: float, bandwidth: float) -> dict:
    """Micro-benchmark points (bytes as the JSON keys them -> seconds) on an exact line."""
    return {str(n): fixed + n / bandwidth for n in SIZES}


# Four workers on two cores. One worker alone copies 1 GB/s; two at once 0.8 GB/s each, so the
# node's memory 1.6 GB/s; four at once 0.4 GB/s each (the two cores' copies spread over four).
# The ring exchange's fixed part 10 ms less two barriers (a collective of 2 ms each) and two
# copies of 0.5 ms, halved: a latency of 2.5 ms. The setup: 5 ms + 2 GB/s. The agreement's three
# collectives take 9 ms: 3 ms each, 1.5 ms a step of two. The ring's first round on fresh arenas
# takes 2.5 ns a byte, its later rounds 2 ns: 0.5 ns more for 2 bytes touched, 4 GB/s.
RAW = {
    "cores": 2,
    "collective": 0.002,
    "agree": 0.009,
    "first_round_2": line(0.012, 0.4e9),
    "copy_1": line(1e-4, 1e9),
    "copy_2": line(1e-4, 0.8e9),
    "copy_4": line(1e-4, 0.4e9),
    "exchange_2": line(0.01, 0.5e9),
    "exchange_4": line(0.02, 0.25e9),
    "setup": line(0.005, 2e9),
    "copy_overhead": 0.0005,
    "switch": 0.007,
}


def test_machine_described_from_the_micro_benchmark(bench):
    m = bench.describe_machine(RAW, world=4)
    expected = {
        "copy_bandwidth": 1e9,
        "node_copy_bandwidth": 1.6e9,
        "cores_seen_by_copies": 2.0,
        "link_bandwidth": 1e9,  # a pack and an unpack are copies
        "exchange_bandwidth_per_worker": 1e9,  # 2 bytes copied per byte of the ring at 0.5 GB/s
        "link_latency_s": 0.0025,
        "collective_step_s": 0.0015,
        "loop_collective_step_s": 0.001,
        "touch_bandwidth": 4e9,
        "switch_s": 0.007,
        "setup_s": 0.005,
        "setup_bandwidth": 2e9,
    }
    assert {k: m[k] for k in expected} == pytest.approx(expected)
    cluster = bench.machine_cluster(m, 4, {"build_fixed_s": 1.0, "build_bandwidth": 1e9, "serialize_bandwidth": 1e9,
                                           "save_fixed_s": 1.0, "load_fixed_s": 1.0})
    assert (cluster.node_copy_bandwidth, cluster.cores_per_node, cluster.switch_s, cluster.touch_bandwidth) == \
        pytest.approx((1.6e9, 2, 0.007, 4e9))


def test_round_cutting_is_timed_for_every_rank(bench):
    model = dataclasses.replace(MODEL_PRESETS["llama_tiny"], vocab_size=256)
    cut = bench.cut_seconds(model, L(tp=2, dp=2), L(dp=4), 1 << 16, repeats=1)
    assert sorted(cut) == [0, 1, 2, 3]
    assert all(0 < s < 10 and math.isfinite(s) for s in cut.values())
