"""The Triton multi-adapter LoRA kernels (lora/runtime/kernels/triton_segmm.py) against the torch
reference: forward values and every gradient (dX, dA, dB, and dS through expand).

Skipped when triton is not installed (it is the optional extra `triton`, not a test dependency).
With CUDA the kernels run natively on the GPU. Without, they run in Triton's interpreter on CPU
tensors, which needs TRITON_INTERPRET=1 before triton is first imported, and megatron.core
(imported by conftest) already imports it: `test_kernels_in_the_interpreter` then runs this file
as a script (`main()`, every check) in a subprocess with the variable set; the direct kernel tests
skip in this process. The script imports torch and the kernels only, not megatron, so it starts
fast; shapes are tiny because the interpreter executes every program instance in numpy.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_ext.lora.runtime.kernels import reference

CUDA = torch.cuda.is_available()
INTERPRETED = not CUDA and os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = torch.device("cuda" if CUDA else "cpu")
# Segment rows and ranks: an empty segment, odd sizes, a segment and widths spanning two
# 32-blocks (rows 37, in 40, out 35), so masks, the K loop and the row loop are all exercised.
ROWS, RANKS, SCALES = [5, 0, 37, 3], [2, 8, 3, 17], [0.5, 2.0, 1 / 3, 1.25]
IN, OUT = 40, 35
DTYPES = [(torch.float32, 1e-5), (torch.float64, 1e-12)]


def _segmm():
    from megatron_ext.lora.runtime.kernels import triton_segmm

    assert triton_segmm.interpreted() == INTERPRETED, "TRITON_INTERPRET must be set before triton is imported"
    return triton_segmm


def _leaves(dtype, rows, ranks):
    g = torch.Generator().manual_seed(0)
    make = lambda *shape: torch.randn(*shape, generator=g, dtype=dtype).to(DEVICE).requires_grad_()  # noqa: E731
    return [make(r, IN) for r in rows], [make(r, IN) for r in ranks], [make(OUT, r) for r in ranks]


def _step(module, dtype, rows, ranks, scales):
    """Forward through shrink and expand, and a loss that sends gradients into both S and Y."""
    xs, a, b = _leaves(dtype, rows, ranks)
    ss = module.shrink(xs, a)
    ys = module.expand(ss, b, scales)
    g = torch.Generator().manual_seed(1)
    dy = torch.randn(sum(rows), OUT, generator=g, dtype=dtype).to(DEVICE)
    ds = [torch.randn(r, k, generator=g, dtype=dtype).to(DEVICE) for r, k in zip(rows, ranks)]
    loss = (torch.cat(ys) * dy).sum() + sum((s * d).sum() for s, d in zip(ss, ds))
    loss.backward()
    return [t.detach() for t in ss + ys], [t.grad for t in xs + a + b]


def check_forward_and_gradients(module, dtype, tol):
    ref_out, ref_grads = _step(reference, dtype, ROWS, RANKS, SCALES)
    out, grads = _step(module, dtype, ROWS, RANKS, SCALES)
    names = [f"{p}{i}" for p in ("S", "Y", "dX", "dA", "dB") for i in range(len(ROWS))]
    for name, got, want in zip(names, out + grads, ref_out + ref_grads, strict=True):
        assert got is not None and got.shape == want.shape, name
        scale = max([1.0, *want.abs().flatten().tolist()])
        torch.testing.assert_close(got, want, rtol=tol, atol=tol * scale, msg=lambda m: f"{name} ({dtype}): {m}")  # noqa: B023 (called here)


def check_all_segments_empty(module):
    """No rows at all: empty outputs, and zero (not garbage) weight gradients."""
    out, grads = _step(module, torch.float32, [0, 0], [4, 2], [1.0, 3.0])
    assert all(t.numel() == 0 for t in out)
    assert all(torch.equal(g, torch.zeros_like(g)) for g in grads[2:]), "weight gradients of empty segments"


def main():
    module = _segmm()
    for dtype, tol in DTYPES:
        check_forward_and_gradients(module, dtype, tol)
    check_all_segments_empty(module)
    print("triton kernels match the reference")


if __name__ == "__main__":
    main()
else:
    pytest.importorskip("triton", reason="triton is not installed (optional extra: pip install megatron_ext[triton])")

kernel_test = pytest.mark.skipif(not (CUDA or INTERPRETED), reason="no CUDA: run by test_kernels_in_the_interpreter")


@pytest.mark.skipif(CUDA or INTERPRETED, reason="CUDA present (kernels run natively) or already in the interpreter")
def test_kernels_in_the_interpreter():
    root = Path(__file__).parents[2]
    path = os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    done = subprocess.run([sys.executable, __file__], env=env, cwd=root, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "match the reference" in done.stdout


@kernel_test
@pytest.mark.parametrize("dtype,tol", DTYPES, ids=["fp32", "fp64"])
def test_forward_and_gradients_match_reference(dtype, tol):
    check_forward_and_gradients(_segmm(), dtype, tol)


@kernel_test
def test_all_segments_empty():
    check_all_segments_empty(_segmm())


def test_select():
    from megatron_ext.lora.runtime import kernels
    from megatron_ext.lora.runtime.kernels import grouped, triton_segmm

    cuda = torch.device("cuda")  # select() only reads the device type: no GPU needed
    assert kernels.select(torch.device("cpu"), torch.float32) is reference
    # "auto" never picks the triton kernels: they have not run on a GPU yet.
    assert kernels.select(cuda, torch.float32) is reference
    assert kernels.select(cuda, torch.bfloat16) is (grouped if grouped.available() else reference)
    assert kernels.select(cuda, torch.float32, "triton") is triton_segmm
    if INTERPRETED:
        assert kernels.select(DEVICE, torch.float32, "triton") is triton_segmm
    elif not CUDA:
        with pytest.raises(RuntimeError, match="CUDA tensors only"):
            kernels.select(DEVICE, torch.float32, "triton")
    with pytest.raises(ValueError, match="unknown kernel 'fused'"):
        kernels.select(DEVICE, torch.float32, "fused")
