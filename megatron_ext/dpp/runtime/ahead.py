"""Plan global batch i + 1 in a background thread while step i trains.

The plan of a batch has two halves (plugin.StepPlanner): `solve`, which reads nothing but
values and runs the planner (chunking, grouping, the recompute ILP) on the replica's first
pipeline stage, and `agree`, which hands that plan to the other stages and checks that the
data-parallel replicas are on the same batch. Only `solve` (and reading the batch's documents)
runs in the background thread: the collectives of `agree` run in the training thread at the
step boundary, so they never interleave with the step's own p2p traffic. Batches are read and
solved one at a time in stream order, so the plans are the ones planning each batch at its step
would give.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Iterator, Optional

from megatron_ext.dpp.runtime.batch import StreamPosition


class PlanAhead:
    """Planned batches of `batches` ((documents, stream position after them) pairs) by
    `planner`. With `ahead`, the next batch is read and solved in a background thread as soon
    as the previous one is handed out; without it, when it is asked for."""

    def __init__(self, batches: Iterator[tuple[list, StreamPosition]], planner: Any, ahead: bool = True) -> None:
        self._batches = batches
        self._planner = planner
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dpp-plan") if ahead else None
        self._pending: Optional[Future] = None
        self.number = 0  # global batches handed out
        # Of the last batch handed out: where the stream continues, and its real tokens.
        self.position: Optional[StreamPosition] = None
        self.tokens = 0
        self.waited_s = 0.0  # time the training thread waited for a plan
        self.planning_s = 0.0  # time spent reading and solving, in whichever thread
        self._submit()

    def _submit(self) -> None:
        if self._pool is not None:
            self._pending = self._pool.submit(self._read_and_solve)

    def _read_and_solve(self) -> tuple[list, StreamPosition, Any, float]:
        began = time.perf_counter()
        batch, position = next(self._batches)
        solved = self._planner.solve(batch)
        return batch, position, solved, time.perf_counter() - began

    def ready(self) -> bool:
        """Whether the next batch is already read and solved (planning ahead only)."""
        return self._pending is not None and self._pending.done()

    def __iter__(self) -> "PlanAhead":
        return self

    def __next__(self):
        self.number += 1
        began = time.perf_counter()
        if self._pending is None:
            batch, position, solved, planning_s = self._read_and_solve()
        else:
            try:
                batch, position, solved, planning_s = self._pending.result()
            except ValueError:  # bad data or config, already worded for the user
                raise
            except Exception as failed:
                raise RuntimeError(
                    f"dpp: the planner thread failed while preparing global batch {self.number}: "
                    f"{type(failed).__name__}: {failed}"
                ) from failed
        self.waited_s += time.perf_counter() - began
        self.planning_s += planning_s
        planned = self._planner.agree(batch, solved)
        self.position, self.tokens = position, sum(len(d) - 1 for d in batch)
        self._submit()
        return planned

    def close(self) -> None:
        """Stop planning ahead (a plan being solved is finished and dropped)."""
        if self._pool is not None:
            if self._pending is not None:
                self._pending.cancel()
            self._pool.shutdown(wait=False)
            self._pool = self._pending = None
