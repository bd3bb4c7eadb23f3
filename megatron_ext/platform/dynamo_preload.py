"""TorchDynamo imported ahead of time, off a path that waits on it.

torch's optimizers import `torch._dynamo` the first time one is built (about 1 s on these CPUs).
A process that will build one at a moment where time counts (a worker on standby joining a
reshard) imports it before then. `torch._dynamo` is private: checked with the torch of
`versions.CHECKED["dynamo_preload"]`.
"""

from __future__ import annotations

import importlib


def preload_dynamo() -> None:
    """Import TorchDynamo now (a no-op once imported)."""
    importlib.import_module("torch._dynamo")
