"""Fit the DPP cost model to real megatron-core layers on this machine.

    python -m megatron_ext.dpp.calibrate --out costmodel_cpu.json [--model llama_tiny]

Times (CPU time of the process) one TransformerLayer of the local spec (fp32, CPU) forward and
backward on a grid of (q new tokens, p prefix tokens). A prefix is timed through the core
attention alone: time(q, p) = layer(q) + attention(q queries, p + q keys) - attention(q, q),
with an explicit bottom-right causal mask. Saved activation bytes are counted with saved-tensor
hooks the same way. Fits alpha, beta, gamma (and the backward ratio) by least squares on
alternate grid points and reports the relative error on the held-out others.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from megatron_ext.dpp.costmodel import CostModel


@dataclass(frozen=True)
class Sample:
    q: int
    prefix: int
    fwd_s: float
    bwd_s: float
    act_bytes: float


def time_features(q: int, prefix: int) -> list[float]:
    return [1.0, q, q * (prefix + q / 2)]


def _fit(samples: Sequence[Sample], y: np.ndarray) -> tuple[float, float, float]:
    """(gamma, alpha, beta) by least squares relative to each sample's size, so small chunks
    count as much as large ones."""
    X = np.array([time_features(s.q, s.prefix) for s in samples])
    gamma, alpha, beta = np.linalg.lstsq(X / y[:, None], np.ones_like(y), rcond=None)[0]
    return float(gamma), float(alpha), float(beta)


def fit_time(samples: Sequence[Sample]) -> tuple[float, float, float, float]:
    """(gamma, alpha, beta, bwd_ratio) of the forward; the ratio is the relative least-squares
    backward/forward factor."""
    y = np.array([s.fwd_s for s in samples])
    b = np.array([s.bwd_s for s in samples])
    ratio = float(np.mean(b / y))
    return (*_fit(samples, y), ratio)


def fit_backward(samples: Sequence[Sample]) -> tuple[float, float, float]:
    """(gamma, alpha, beta) of the backward, fitted on its own."""
    return _fit(samples, np.array([s.bwd_s for s in samples]))


def fit_memory(samples: Sequence[Sample]) -> tuple[float, float, float]:
    """(bytes per token, per query-key pair, per prefix key) of one layer's saved activations."""
    X = np.array([[s.q, s.q * (s.q + s.prefix), s.prefix] for s in samples], dtype=float)
    y = np.array([s.act_bytes for s in samples])
    per_token, per_pair, per_key = np.linalg.lstsq(X, y, rcond=None)[0]
    return float(per_token), float(per_pair), float(per_key)


def relative_errors(model: CostModel, samples: Sequence[Sample]) -> dict[str, float]:
    from megatron_ext.dpp.plan import Chunk, Segment

    fwd, bwd, mem = [], [], []
    for s in samples:
        c = Chunk(0, "split", (Segment(0, s.prefix, s.q),))
        fwd.append(abs(model.layer_forward_s(c) / s.fwd_s - 1))
        bwd.append(abs(model.layer_backward_s(c) / s.bwd_s - 1))
        mem.append(abs(model.layer_act_bytes(c) / s.act_bytes - 1))
    return {f"{k}_{agg.__name__}": float(agg(v)) for k, v in (("fwd", fwd), ("bwd", bwd), ("act_bytes", mem)) for agg in (np.mean, np.max)}


# --- measuring a real layer ------------------------------------------------------------------

def _saved_bytes(fn, params: set[int]) -> tuple[object, int]:
    import torch

    total = 0

    def pack(t):
        nonlocal total
        if t.data_ptr() not in params:  # weights are model state, not activations
            total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, total


def _timed_once(fn) -> tuple[float, float, int]:
    """(forward s, backward s, saved bytes) of fn() -> (output, saved). CPU time of this
    process: on a CPU shared with other jobs, waiting for a core is not the layer's cost."""
    t = time.process_time()
    out, saved = fn()
    f = time.process_time() - t
    t = time.process_time()
    out.sum().backward()
    return f, time.process_time() - t, saved


def _best_of_rounds(runs: dict, rounds: int) -> dict:
    """Each run timed once per round, rounds over the whole grid, the best kept: a burst of
    load from other processes spoils one round of a point, not all of its repeats."""
    best = {k: (float("inf"), float("inf"), 0) for k in runs}
    for _ in range(rounds):
        for k, fn in runs.items():
            f, b, m = _timed_once(fn)
            best[k] = (min(best[k][0], f), min(best[k][1], b), m)
    return best


def measure(model_name: str, qs: Sequence[int], prefixes: Sequence[int], repeats: int) -> tuple[list[Sample], dict]:
    import torch
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module

    from megatron_ext.config.schema import ParallelConfig
    from megatron_ext.config.store import MODEL_PRESETS
    from megatron_ext.models.gpt import transformer_config

    mc = MODEL_PRESETS[model_name]
    config = transformer_config(mc, ParallelConfig(), on_cpu=True)
    layer = build_module(get_gpt_layer_local_spec(normalization="RMSNorm"), config=config, layer_number=1)
    params = {p.data_ptr() for p in layer.parameters()}
    attn = layer.self_attention.core_attention
    heads, groups = config.num_attention_heads, config.num_query_groups or config.num_attention_heads
    dim = config.kv_channels

    def causal(q: int, k: int):  # True = masked; query i sees keys up to k - q + i
        return torch.ones(q, k, dtype=torch.bool).triu(k - q + 1)[None, None]

    def layer_run(q: int):
        x = torch.randn(q, 1, config.hidden_size, requires_grad=True)
        return lambda: _saved_bytes(lambda: layer(x, attention_mask=causal(q, q))[0], params)

    def attn_run(q: int, k: int):
        qt = torch.randn(q, 1, heads, dim, requires_grad=True)
        kt, vt = (torch.randn(k, 1, groups, dim, requires_grad=True) for _ in range(2))
        return lambda: _saved_bytes(lambda: attn(qt, kt, vt, causal(q, k)), params)

    runs = {("layer", q, 0): layer_run(q) for q in qs}
    runs.update({("attn", q, p): attn_run(q, p + q) for q in qs for p in {0, *prefixes}})
    best = _best_of_rounds(runs, repeats)
    samples = []
    for q in qs:
        for p in prefixes:
            f, b, m = (best[("layer", q, 0)][i] + best[("attn", q, p)][i] - best[("attn", q, 0)][i] for i in range(3))
            samples.append(Sample(q, p, f, b, float(m)))
    shape = dict(hidden=config.hidden_size, ffn=config.ffn_hidden_size, heads=heads, kv_heads=groups,
                 layer_params=sum(p.numel() for p in layer.parameters()), num_layers=mc.num_layers,
                 vocab=mc.vocab_size)
    return samples, shape


def calibrate(samples: Sequence[Sample], shape: dict, bytes_per_value: int = 4) -> tuple[CostModel, dict]:
    train, held = samples[0::2], samples[1::2]
    gamma, alpha, beta, ratio = fit_time(train)
    bwd_gamma, bwd_alpha, bwd_beta = fit_backward(train)
    per_token, per_pair, per_key = fit_memory(train)
    kv_dim = shape["hidden"] // shape["heads"] * shape["kv_heads"]
    model = CostModel(
        alpha=alpha, beta=beta, gamma=gamma, bwd_ratio=ratio, bwd_alpha=bwd_alpha, bwd_beta=bwd_beta, bwd_gamma=bwd_gamma,
        act_bytes_token=per_token, act_bytes_attn=per_pair, act_bytes_key=per_key,
        ckpt_bytes_token=bytes_per_value * shape["hidden"],
        kv_bytes_token=bytes_per_value * 2 * kv_dim,
        # fp32 params, grads and two Adam moments
        state_bytes_param=4.0 * bytes_per_value,
        layer_params=shape["layer_params"], num_layers=shape["num_layers"],
    )
    return model, {"train": relative_errors(model, train), "held_out": relative_errors(model, held)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="llama_tiny", help="a model preset of megatron_ext.config.store")
    ap.add_argument("--q", type=int, nargs="+", default=[64, 128, 256, 384, 512, 768, 1024])
    ap.add_argument("--prefix", type=int, nargs="+", default=[0, 256, 512, 1024, 2048])
    ap.add_argument("--repeats", type=int, default=5, help="rounds over the grid; the best of each point is kept")
    args = ap.parse_args()

    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_ext.platform.launch import join_world

    join_world("cpu")
    parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(1234)
    t = time.perf_counter()
    samples, shape = measure(args.model, args.q, args.prefix, args.repeats)
    model, errors = calibrate(samples, shape)
    model.to_json(args.out, model=args.model, shape=shape, errors=errors, samples=[dataclasses.asdict(s) for s in samples],
                  measure_s=time.perf_counter() - t)
    print(json.dumps({"alpha": model.alpha, "beta": model.beta, "gamma": model.gamma, "bwd_ratio": model.bwd_ratio,
                      "act_bytes_token": model.act_bytes_token, "act_bytes_attn": model.act_bytes_attn}, indent=1))
    print("held-out relative error:", json.dumps(errors["held_out"], indent=1))
    print(f"measured in {time.perf_counter() - t:.1f}s; wrote {args.out}")


if __name__ == "__main__":
    main()
