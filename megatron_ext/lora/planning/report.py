"""A sweep schedule for people: a text table of packs and jobs, and a Gantt chart PNG."""

from __future__ import annotations

from megatron_ext.lora.planning.simulate import Schedule


def _duration(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:.2f} h"
    return f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.2f} s"


def table(schedule: Schedule) -> str:
    rows = [("pack", "devices", "tp", "dp", "slots", "start", "end", "peak GiB/dev", "jobs (start-end)")]
    for i, (pack, run) in enumerate(zip(schedule.plan.packs, schedule.packs)):
        jobs = sorted((r for r in schedule.jobs if r.pack == i), key=lambda r: r.start)
        rows.append(
            (
                str(i),
                _devices(pack.devices),
                str(pack.tp),
                str(pack.dp),
                str(pack.slots),
                _duration(run.start),
                _duration(run.end),
                f"{run.peak_bytes / 2**30:.1f}",
                ", ".join(f"{r.job} ({_duration(r.start)}-{_duration(r.end)})" for r in jobs),
            )
        )
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]) - 1)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)) + "  " + r[-1] for r in rows]
    lines.append(f"strategy {schedule.plan.strategy}: makespan {_duration(schedule.makespan)}")
    return "\n".join(lines)


def _devices(devices: tuple[int, ...]) -> str:
    if list(devices) == list(range(devices[0], devices[-1] + 1)) and len(devices) > 1:
        return f"{devices[0]}-{devices[-1]}"
    return ",".join(map(str, devices))


def gantt(schedule: Schedule, path: str, title: str = "") -> None:
    """One row per device; a pack's slots split its rows, each job a bar in its slot."""
    import matplotlib  # optional: matplotlib (the bench extra)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after choosing the backend

    devices = len(schedule.peak_bytes)
    fig, ax = plt.subplots(figsize=(12, 0.5 + 0.6 * devices))
    colours = plt.get_cmap("tab20")
    for index, run in enumerate(schedule.jobs):
        pack = schedule.plan.packs[run.pack]
        height = 0.9 / pack.slots
        for device in pack.devices:
            y = device + 0.05 + run.slot * height
            ax.broken_barh([(run.start, run.end - run.start)], (y, height), color=colours(index % 20), edgecolor="black", linewidth=0.3)
            if device == pack.devices[0] and pack.slots <= 8:
                ax.text(run.start, y + height / 2, f" {run.job}", va="center", fontsize=6, clip_on=True)
    ax.set_yticks([d + 0.5 for d in range(devices)], [f"dev {d}" for d in range(devices)])
    ax.set_ylim(0, devices)
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    ax.set_title(title or f"{schedule.plan.strategy}: makespan {_duration(schedule.makespan)}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
