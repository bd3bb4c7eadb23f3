"""A sweep whose packs train on separate ranks at the same time, stopped (`lora.stop_after`) and
resumed several times, ends bitwise like the same sweep run without a stop: every job's losses,
eval losses, tokens, megatron checkpoint and PEFT adapter.

Two gloo ranks: pack 0 (jobs a, b, two slots) on rank 0 while pack 1 (job c) trains on rank 1,
then pack 2 (job d) data-parallel over both. Each pack checkpoints over its own ranks. The
launches stop: pack 0 inside a's gradient accumulation (with dropout) while rank 1 has finished
pack 1; then with unequal steps left on the two ranks when pack 2 starts (they agree on the
fewer); then inside pack 2's accumulation. Checkpoints written over the wrong ranks hang or
fail; state missing from them changes the numbers.

This file is also the worker script torchrun starts.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_lora_concurrent import TINY, assert_same_outcomes, outcome  # noqa: E402

from megatron_ext.lora.job import LoraJob  # noqa: E402
from megatron_ext.lora.planning.plan import Pack, Plan  # noqa: E402

JOBS = [
    LoraJob("a", rank=4, lr=1e-2, steps=2, micro_batch_size=1, global_batch_size=2, seq_length=16, dropout=0.1),
    LoraJob("b", rank=8, lr=3e-2, steps=1, micro_batch_size=1, global_batch_size=2, seq_length=12, seed=5),
    LoraJob("c", rank=2, lr=2e-2, steps=1, micro_batch_size=1, global_batch_size=2, seq_length=16, seed=9),
    LoraJob("d", rank=4, lr=5e-3, steps=2, micro_batch_size=1, global_batch_size=4, seq_length=8, seed=3,
            target_modules=("linear_qkv", "linear_fc2")),
]
PLAN = Plan("test", (
    Pack(("a", "b"), 1, 1, 2, (0,)),  # 4 packed steps (b leaves after 2)
    Pack(("c",), 1, 1, 1, (1,)),  # 2 packed steps
    Pack(("d",), 1, 2, 1, (0, 1)),  # 4 packed steps
))
# lora.stop_after of each launch of the stopped sweep (None: to the end).
LAUNCHES = (3, 3, 1, None)


def worker(out: str) -> None:
    import torch.distributed as dist

    from megatron_ext.config import compose_config
    from megatron_ext.lora.runtime.batching import SyntheticData
    from megatron_ext.lora.runtime.execute import execute
    from megatron_ext.models.convert.world import model_parallel_world
    from megatron_ext.platform.launch import join_world

    join_world("cpu")
    cfg = compose_config(TINY)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=257))
    with model_parallel_world(tp=1):
        runs = [("whole", None)] + [(f"launch{i}", stop) for i, stop in enumerate(LAUNCHES)]
        for name, stop in runs:
            folder = "whole" if name == "whole" else "stopped"
            run_cfg = dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, output_dir=f"{out}/{folder}", stop_after=stop))
            results = execute(run_cfg, JOBS, PLAN, lambda job: SyntheticData(job, 257))
            if dist.get_rank() == 0:
                (Path(out) / f"{name}.json").write_text(json.dumps({n: dataclasses.asdict(r) for n, r in results.items()}))


if __name__ == "__main__":
    worker(*sys.argv[1:])


@pytest.mark.slow  # five sweeps on two ranks: two minutes of wall time on a busy two-core machine
@pytest.mark.distributed
def test_concurrent_packs_stopped_and_resumed_equal_an_uninterrupted_sweep(tmp_path):
    from _torchrun import torchrun

    from megatron_ext.models.convert.world import model_parallel_world

    torchrun(__file__, 2, str(tmp_path), timeout=300)
    statuses = [{n: r["status"] for n, r in json.loads((tmp_path / f"launch{i}.json").read_text()).items()}
                for i in range(len(LAUNCHES))]
    # Where each launch stopped (so that the stops are where the docstring says).
    assert statuses[0] == {"a": "running", "b": "done", "c": "done", "d": "queued"}
    assert statuses[1] == {"a": "done", "b": "done", "c": "done", "d": "running"}
    assert statuses[2]["d"] == "running" and all(s == "done" for s in statuses[3].values())
    (tmp_path / "stopped.json").write_text((tmp_path / f"launch{len(LAUNCHES) - 1}.json").read_text())
    with model_parallel_world():
        whole, stopped = outcome(tmp_path, "whole"), outcome(tmp_path, "stopped")
    assert_same_outcomes(stopped, whole, JOBS)
