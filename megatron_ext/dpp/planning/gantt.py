"""Gantt chart of a step: stages x time, forward/backward boxes coloured by chunk kind, the
recompute part of a backward hatched. Works from the simulator's events or from measured
(stage, op, start, end) records of a real run."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

from megatron_ext.dpp.planning.plan import StepPlan
from megatron_ext.dpp.planning.simulate import Event

COLOURS = {"split": "#4c72b0", "packed": "#55a868", "hybrid": "#dd8452"}


@dataclass(frozen=True)
class TimedOp:
    """One op of a real run: `op` is "F" or "B"; times in seconds from any common origin."""

    stage: int
    op: str
    chunk: int
    start: float
    end: float
    recompute_s: float = 0.0


def from_events(events: Iterable[Event]) -> list[TimedOp]:
    return [TimedOp(e.stage, e.kind, e.chunk, e.start, e.end, e.recompute_s) for e in events]


def draw(ax, ops: Sequence[TimedOp], plan: StepPlan, title: str = "") -> None:
    """Draw on a matplotlib axes; stage 0 at the top."""
    t0 = min(o.start for o in ops)
    for o in ops:
        kind = plan.chunks[o.chunk].kind
        y = plan.pp - 1 - o.stage
        colour = COLOURS[kind]
        alpha = 0.55 if o.op == "F" else 1.0
        ax.broken_barh([(o.start - t0, o.end - o.start)], (y - 0.4, 0.8), facecolors=colour, alpha=alpha,
                       edgecolor="white", linewidth=0.3)
        if o.recompute_s > 0:  # the recompute runs first in a backward
            ax.broken_barh([(o.start - t0, o.recompute_s)], (y - 0.4, 0.8), facecolors="none", edgecolor="black",
                           hatch="////", linewidth=0.0)
    ax.set_yticks(range(plan.pp), [f"stage {plan.pp - 1 - i}" for i in range(plan.pp)])
    ax.set_xlabel("time (s)")
    ax.set_title(title, fontsize=9)


def save(path: str | Path, panels: Sequence[tuple[Sequence[TimedOp], StepPlan, str]]) -> None:
    """One PNG with a Gantt panel per (ops, plan, title), sharing a legend."""
    import matplotlib  # optional: matplotlib (the bench extra)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after choosing the backend
    from matplotlib.patches import Patch

    fig, axes = plt.subplots(len(panels), 1, figsize=(12, 1.0 + 0.45 * sum(p[1].pp for p in panels) + 0.8 * len(panels)),
                             squeeze=False)
    for ax, (ops, plan, title) in zip(axes[:, 0], panels):
        draw(ax, ops, plan, title)
    legend = [Patch(facecolor=c, label=k) for k, c in COLOURS.items()]
    legend += [Patch(facecolor="grey", alpha=0.55, label="forward (light)"), Patch(facecolor="grey", label="backward"),
               Patch(facecolor="none", edgecolor="black", hatch="////", label="recompute")]
    fig.legend(handles=legend, loc="upper center", ncol=len(legend), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(path, dpi=120)
    plt.close(fig)
