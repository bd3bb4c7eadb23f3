"""What a rank's own plan costs at cluster scale, and what the move sends, without the world's
plan: for benchmarks (scripts/bench/rank_plan.py, scripts/bench/scale.py).

    measure_rank_plan(model, a, b)   # the slowest of a sample of ranks: seconds, CPU seconds, peak RSS
    moved_bytes(model, a, b)         # network bytes = the minimum, summed over every rank
    send_balance(model, a, b)        # max / mean bytes sent per rank

Each rank is timed from empty caches, as a fresh process would plan it, except that the
skeleton of its own stage in the running layout A is built first and not timed (a running job
builds it once, at start-up); every other skeleton it needs, the destination's included, is
timed. Each rank has its wall-clock and CPU seconds (this process's, one core): on a shared
machine the wall clock counts the other processes' load, the CPU time does not. Memory, per
rank: the RSS just before planning (after its start-up skeleton) and the high-water mark while
planning (/proc's VmHWM, reset before each rank); what the planner adds is their difference.
The baseline after importing torch and megatron is beside them: the first skeleton a process
builds also loads the code megatron imports lazily, which a training process has loaded anyway.
"""

from __future__ import annotations

import resource
import time
from pathlib import Path
from typing import Optional

from megatron_ext.config.schema import ModelConfig
from megatron_ext.reshard import plan as planner
from megatron_ext.reshard import vps
from megatron_ext.parallel.layout import ParallelLayout
from megatron_ext.reshard.skeleton import standalone_world

_CACHES = (
    vps._stage, vps.position_shards, vps.name_positions, vps.is_expert,
    vps.stage_layers, vps._rank_pieces, planner._rank_plan, planner._plan,
)


def clear_caches() -> None:
    for cache in _CACHES:
        cache.cache_clear()


def sample_ranks(a: ParallelLayout, b: ParallelLayout) -> list[int]:
    """The first and last rank of each destination stage, and of each source stage: they hold
    the embedding, the output layer and the stage boundaries."""
    ranks = set()
    for layout in (a, b):
        per_stage = layout.active // layout.pp
        for pp in range(layout.pp):
            ranks.update((pp * per_stage, (pp + 1) * per_stage - 1))
    return sorted(ranks)


def measure_rank_plan(
    model: ModelConfig, a: ParallelLayout, b: ParallelLayout, ranks: Optional[list[int]] = None
) -> dict:
    """Plan each of `ranks` (default `sample_ranks`) from empty caches; the slowest one's time
    (by wall clock, and by CPU time), the peak memory, and every rank's."""
    a.check(model)
    b.check(model)
    key = vps.model_key(model)
    per_rank = {}
    with standalone_world():
        for rank in ranks if ranks is not None else sample_ranks(a, b):
            clear_caches()
            if rank < a.active:
                vps._stage(key, a, a.rank_coords(rank)["pp"])  # the running layout's, built at start-up
            rss_before = _rss_mb()
            _reset_peak_rss()
            start, cpu = time.perf_counter(), time.process_time()
            mine = planner._rank_plan(key, a, b, rank)
            seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu
            per_rank[rank] = {
                "seconds": seconds,
                "cpu_seconds": cpu_seconds,
                "rss_before_mb": rss_before,
                "peak_rss_mb": _peak_rss_mb(),
                "ops": len(mine.ops),
                "sent_bytes": mine.sent(rank),
                "received_bytes": mine.received(rank),
                "skeletons_built": vps._stage.cache_info().currsize - (rank < a.active),
            }
    clear_caches()
    slowest = max(per_rank, key=lambda r: per_rank[r]["seconds"])
    slowest_cpu = max(per_rank, key=lambda r: per_rank[r]["cpu_seconds"])
    return {
        "slowest_rank": slowest,
        "seconds": per_rank[slowest]["seconds"],
        "slowest_rank_cpu": slowest_cpu,
        "cpu_seconds": per_rank[slowest_cpu]["cpu_seconds"],
        "peak_rss_mb": max(r["peak_rss_mb"] for r in per_rank.values()),
        "import_rss_mb": _IMPORT_RSS_MB,
        "planner_added_mb": max(r["peak_rss_mb"] - r["rss_before_mb"] for r in per_rank.values()),
        "network_bytes_of_rank": per_rank[slowest]["received_bytes"] + per_rank[slowest]["sent_bytes"],
        "ranks": per_rank,
    }


def moved_bytes(model: ModelConfig, a: ParallelLayout, b: ParallelLayout) -> dict:
    """Network bytes of the move and their minimum (the destination elements each rank lacks
    in A), summed over every destination rank's fills: no rank's sends, no world plan."""
    a.check(model)
    b.check(model)
    fills = planner._Fills(vps.model_key(model), a, b)
    network = 0
    with standalone_world():
        for rank in range(b.active):
            network += sum(op.nbytes for op in fills.receives(rank) if not op.local)
    return {"network_bytes": network, "min_bytes": fills.missing}


def send_balance(model: ModelConfig, a: ParallelLayout, b: ParallelLayout) -> dict:
    """Bytes each rank sends, from every rank's own plan: max, mean over the ranks that send."""
    a.check(model)
    b.check(model)
    key = vps.model_key(model)
    fills = planner._Fills(key, a, b)
    with standalone_world():
        sent = [sum(op.nbytes for op in fills.sends(r)) for r in range(a.active)]
    senders = [s for s in sent if s]
    mean = sum(senders) / len(senders) if senders else 0.0
    most = max(sent, default=0)
    return {"max_sent_bytes": most, "mean_sent_bytes": mean, "max_over_mean": most / mean if mean else 1.0}


def _reset_peak_rss() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM
    except OSError:
        pass


def _status_mb(field: str) -> float | None:
    """A memory figure of /proc/self/status, in MB; None where there is no /proc."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def _peak_rss_mb() -> float:
    peak = _status_mb("VmHWM")
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 if peak is None else peak


def _rss_mb() -> float:
    rss = _status_mb("VmRSS")
    return _peak_rss_mb() if rss is None else rss


_IMPORT_RSS_MB = _peak_rss_mb()
