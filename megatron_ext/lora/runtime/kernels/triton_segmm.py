"""Triton kernels for the multi-adapter LoRA shrink and expand: one launch per phase for all
adapter segments ("segment matmul", in the spirit of SGMV), forward and backward.

Layout. The rows of all segments are concatenated ([N, width], segment s owns rows
starts[s]:starts[s+1]); the per-adapter matrices, whose shapes differ with the rank, are
flattened into one buffer (segment s at offset woffs[s], row-major in its own shape). S, whose
width is the adapter's rank, lives in a [N, r_max] buffer; segment s uses its first r_s columns.

Two kernels serve all six products (K = reduced dim, N = output columns of a segment):
  _segment_matmul:  out[rows_s, :N_s] = scale_s * X[rows_s, :K_s] @ W_s      (one program per
                    row block x column block x segment; W_s stored [K_s, N_s] or, TRANS_W, [N_s, K_s])
  _segment_wgrad:   G_s = scale_s * P[rows_s, :M_s]^T @ Q[rows_s, :N_s]      (stored [M_s, N_s];
                    one program per output block x segment, looping over the segment's rows)

Shrink (S = X A^T) and expand (Y = c S B^T) are the same product, Y_s = c_s X_s W_s^T with W_s
stored [N_s, K_s], so one autograd.Function (_SegmentLinear) serves both, three launches a step:
  forward  Y  = matmul(X, W, TRANS_W, c)     backward  dX = matmul(dY, W, c),  dW = wgrad(dY, X, c)
(for expand, dX is the gradient w.r.t. S).

Accumulation is fp32 (fp64 for fp64 inputs); fp32 inputs use IEEE products unless torch allows
TF32 matmuls (torch.backends.cuda.matmul.allow_tf32). Block sizes are fixed, not autotuned.
Tested in Triton's interpreter (TRITON_INTERPRET=1 set before this module is imported) on CPU;
not yet run or timed on a GPU.
"""

from __future__ import annotations

from itertools import accumulate
from typing import Sequence

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

BLOCK_M, BLOCK_N, BLOCK_K = 32, 32, 32  # tl.dot wants every block dim >= 16


@triton.jit
def _segment_matmul(x_ptr, w_ptr, out_ptr, starts, kdims, ndims, woffs, scales, stride_x, stride_out,
                    TRANS_W: tl.constexpr, HAS_SCALE: tl.constexpr, ACC: tl.constexpr, PRECISION: tl.constexpr,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid_m, pid_n, seg = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start, stop = tl.load(starts + seg), tl.load(starts + seg + 1)
    kdim, ndim = tl.load(kdims + seg), tl.load(ndims + seg)
    if start + pid_m * BM >= stop or pid_n * BN >= ndim:
        return
    rows = (start + pid_m * BM + tl.arange(0, BM)).to(tl.int64)
    cols = pid_n * BN + tl.arange(0, BN)
    row_ok, col_ok = rows < stop, cols < ndim
    w_base = w_ptr + tl.load(woffs + seg)
    acc = tl.zeros((BM, BN), dtype=ACC)
    for k0 in range(0, kdim, BK):
        ks = k0 + tl.arange(0, BK)
        k_ok = ks < kdim
        x = tl.load(x_ptr + rows[:, None] * stride_x + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if TRANS_W:  # W_s stored [N_s, K_s]: element (k, n) at n * K_s + k
            w_off = cols[None, :] * kdim + ks[:, None]
        else:  # stored [K_s, N_s]
            w_off = ks[:, None] * ndim + cols[None, :]
        w = tl.load(w_base + w_off, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = tl.dot(x, w, acc, input_precision=PRECISION, out_dtype=ACC)
    if HAS_SCALE:
        acc = acc * tl.load(scales + seg).to(ACC)
    out = out_ptr + rows[:, None] * stride_out + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _segment_wgrad(p_ptr, q_ptr, out_ptr, starts, mdims, ndims, woffs, scales, stride_p, stride_q,
                   HAS_SCALE: tl.constexpr, ACC: tl.constexpr, PRECISION: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr, BR: tl.constexpr):
    pid_m, pid_n, seg = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start, stop = tl.load(starts + seg), tl.load(starts + seg + 1)
    mdim, ndim = tl.load(mdims + seg), tl.load(ndims + seg)
    if pid_m * BM >= mdim or pid_n * BN >= ndim:
        return
    ms = pid_m * BM + tl.arange(0, BM)
    ns = pid_n * BN + tl.arange(0, BN)
    m_ok, n_ok = ms < mdim, ns < ndim
    acc = tl.zeros((BM, BN), dtype=ACC)
    for r0 in range(start, stop, BR):  # an empty segment leaves acc at zero: its gradient is 0
        rows = (r0 + tl.arange(0, BR)).to(tl.int64)
        r_ok = rows < stop
        p = tl.load(p_ptr + rows[:, None] * stride_p + ms[None, :], mask=r_ok[:, None] & m_ok[None, :], other=0.0)
        q = tl.load(q_ptr + rows[:, None] * stride_q + ns[None, :], mask=r_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(tl.trans(p), q, acc, input_precision=PRECISION, out_dtype=ACC)
    if HAS_SCALE:
        acc = acc * tl.load(scales + seg).to(ACC)
    out = out_ptr + tl.load(woffs + seg) + ms[:, None] * ndim + ns[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def interpreted() -> bool:
    """True when the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1 at import)."""
    from triton.runtime.interpreter import InterpretedFunction  # optional: only under TRITON_INTERPRET=1

    return isinstance(_segment_matmul, InterpretedFunction)


class _Meta:
    """Per-segment integers and scales on the device, and their maxima on the host (grid sizes)."""

    def __init__(self, rows: Sequence[int], shapes: Sequence[tuple[int, int]], scales, device):
        self.rows = list(rows)
        self.max_rows = max(self.rows, default=0)
        self.shapes = list(shapes)
        sizes = [r * c for r, c in self.shapes]
        as_tensor = lambda v, dt: torch.tensor(v, dtype=dt, device=device)  # noqa: E731
        self.starts = as_tensor(list(accumulate(self.rows, initial=0)), torch.int64)
        self.woffs = as_tensor(list(accumulate(sizes[:-1], initial=0)), torch.int64)
        self.dim0 = as_tensor([r for r, _ in self.shapes], torch.int32)
        self.dim1 = as_tensor([c for _, c in self.shapes], torch.int32)
        self.scales = None if scales is None else as_tensor(list(scales), torch.float64)


def _flags(dtype: torch.dtype) -> dict:
    acc = tl.float64 if dtype == torch.float64 else tl.float32
    tf32 = dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32
    return dict(ACC=acc, PRECISION="tf32" if tf32 else "ieee")


def _matmul(x, w_flat, meta: _Meta, kdims, ndims, width: int, trans_w: bool):
    """[N, width] output of _segment_matmul (width = the largest N_s; the rest stays zero)."""
    out = x.new_zeros(x.shape[0], width)
    if meta.max_rows:
        scaled = meta.scales is not None
        grid = (triton.cdiv(meta.max_rows, BLOCK_M), triton.cdiv(width, BLOCK_N), len(meta.rows))
        _segment_matmul[grid](x, w_flat, out, meta.starts, kdims, ndims, meta.woffs, meta.scales if scaled else meta.starts,
                              x.stride(0), out.stride(0), TRANS_W=trans_w, HAS_SCALE=scaled, BM=BLOCK_M, BN=BLOCK_N,
                              BK=BLOCK_K, **_flags(x.dtype))
    return out


def _wgrad(p, q, meta: _Meta):
    """The flat per-segment gradient buffer of _segment_wgrad, laid out like the weights."""
    out = p.new_empty(sum(r * c for r, c in meta.shapes))
    scaled = meta.scales is not None
    grid = (triton.cdiv(max(r for r, _ in meta.shapes), BLOCK_M), triton.cdiv(max(c for _, c in meta.shapes), BLOCK_N), len(meta.rows))
    _segment_wgrad[grid](p, q, out, meta.starts, meta.dim0, meta.dim1, meta.woffs, meta.scales if scaled else meta.starts,
                         p.stride(0), q.stride(0), HAS_SCALE=scaled, BM=BLOCK_M, BN=BLOCK_N, BR=BLOCK_K, **_flags(p.dtype))
    return out


class _SegmentLinear(torch.autograd.Function):
    """Per segment s: Y_s = c_s X_s W_s^T, W_s [N_s, K_s] flattened in w_flat (c_s = 1 without
    scales). x [N, >= max K_s] (segment s reads its first K_s columns) -> y [N, max N_s]
    (columns past N_s are zero). Shrink is (X, A), expand is (S, B, scales)."""

    @staticmethod
    def forward(ctx, x, w_flat, meta: _Meta):
        x, w_flat = x.contiguous(), w_flat.contiguous()
        ctx.save_for_backward(x, w_flat)
        ctx.meta = meta
        return _matmul(x, w_flat, meta, meta.dim1, meta.dim0, max(n for n, _ in meta.shapes), trans_w=True)

    @staticmethod
    def backward(ctx, dy):
        x, w_flat = ctx.saved_tensors
        meta, dy = ctx.meta, dy.contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0]:  # dX_s = c_s dY_s W_s, W_s read as [K=N_s, N=K_s]
            dx = _matmul(dy, w_flat, meta, meta.dim0, meta.dim1, x.shape[1], trans_w=False)
        if ctx.needs_input_grad[1]:  # dW_s = c_s dY_s^T X_s  [N_s, K_s]
            dw = _wgrad(dy, x, meta)
        return dx, dw, None


def shrink(xs: Sequence[torch.Tensor], a: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Per segment i: xs[i] [rows_i, in] @ a[i]^T ([r_i, in]) -> [rows_i, r_i]; one launch."""
    rows = [x.shape[0] for x in xs]
    meta = _Meta(rows, [tuple(w.shape) for w in a], None, a[0].device)
    padded = _SegmentLinear.apply(torch.cat(list(xs)), torch.cat([w.reshape(-1) for w in a]), meta)
    return [s[:, : w.shape[0]] for s, w in zip(padded.split(rows), a)]


def expand(ss: Sequence[torch.Tensor], b: Sequence[torch.Tensor], scales: Sequence[float]) -> list[torch.Tensor]:
    """Per segment i: scales[i] * ss[i] [rows_i, r_i] @ b[i]^T ([out, r_i]) -> [rows_i, out]; one launch."""
    rows = [s.shape[0] for s in ss]
    r_max = max(w.shape[1] for w in b)
    meta = _Meta(rows, [tuple(w.shape) for w in b], scales, b[0].device)
    padded = torch.cat([F.pad(s, (0, r_max - s.shape[1])) for s in ss])
    return list(_SegmentLinear.apply(padded, torch.cat([w.reshape(-1) for w in b]), meta).split(rows))
