"""One two-rank torchrun launch for the default suite's LoRA distributed tests:
test_lora_concurrent (one pack per rank), test_lora_dp (data-parallel over the two ranks) and
test_lora_tp_packs (packs at TP=1 and TP=2 in one plan).

A launch costs seconds of fixed startup (torchrun, then two ranks importing torch and megatron,
then dist_checkpointing's first save), several times the training either test does, and both
need the same two gloo ranks. So the first of the tests to ask runs every worker in one
launch, in one world (the concurrent worker joins it; the others then use it as it is), and
the others read its outputs. Each test keeps its own worker, outputs and assertions; a worker
that fails fails the launch, so it fails every test (the output tells which).

This file is also the worker script torchrun starts.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
_launched: dict = {}


def outputs(tmp_path_factory) -> Path:
    """The launch's folder (run once per session): concurrent/ from test_lora_concurrent's
    worker ("packs" on two ranks), dp/ from test_lora_dp's, tp_packs/ from test_lora_tp_packs'."""
    if "out" not in _launched:
        from _torchrun import torchrun

        out = tmp_path_factory.mktemp("lora_two_ranks")
        (out / "concurrent").mkdir()
        (out / "dp").mkdir()
        (out / "tp_packs").mkdir()
        torchrun(__file__, 2, str(out), timeout=300)
        _launched["out"] = out
    return _launched["out"]


def worker(out: str) -> None:
    sys.path.insert(0, str(HERE))
    import test_lora_concurrent
    import test_lora_dp
    import test_lora_tp_packs

    test_lora_concurrent.worker(f"{out}/concurrent", "packs")
    test_lora_dp.worker(f"{out}/dp")
    test_lora_tp_packs.worker(f"{out}/tp_packs")


if __name__ == "__main__":
    worker(*sys.argv[1:])
