"""Without CUDA, importing megatron_ext before megatron leaves megatron's fusions eager and
TorchDynamo unloaded; importing megatron first keeps megatron's own choice (torch.compile)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the hook acts only without CUDA")

PROBE = """
import json, sys
{first}
import megatron.core
from megatron.core import jit
from megatron.core.activations import squared_relu
print(json.dumps({{"noop": jit.jit_fuser is jit.noop_decorator, "dynamo": "torch._dynamo" in sys.modules,
                  "wrapped": hasattr(squared_relu, "__wrapped__")}}))
"""


def probe(first: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", PROBE.format(first=first)], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_megatron_ext_first_keeps_fusions_eager():
    assert probe("import megatron_ext") == {"noop": True, "dynamo": False, "wrapped": False}


def test_megatron_first_keeps_torch_compile():
    assert probe("") == {"noop": False, "dynamo": True, "wrapped": True}
