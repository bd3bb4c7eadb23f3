"""Fit the DPP cost model to real megatron-core layers on this machine.

    python -m megatron_ext.dpp.tools.calibrate --out costmodel_cpu.json [--model llama_tiny]

Times (CPU time of the process) one TransformerLayer as the DPP runtime builds it (the local
spec with `ChunkCoreAttention`, fp32, CPU) forward and backward on a grid of (q new tokens, p
prefix tokens), `--repeats` rounds over the grid, each point's median kept (`--statistic`: a
step runs each op once, and one point's time varies by a third between rounds): each point is the last slice of a sequence, its prefix's K/V in the chunk
context's cache as earlier chunks leave them, RoPE at the slice's positions. Saved activation
bytes are counted with saved-tensor hooks on the same runs. The output layer (hidden to the
padded vocabulary) and the cross entropy are timed on their own over the grid's token counts.
Fits alpha, beta, beta_self, the per-prefix-token term, gamma (and the backward's own, and the
backward ratio) by relative least squares on alternate grid points and reports the relative
error on the held-out others; the head's fixed and per-token forward and backward likewise. Then (unless
`--no-overhead`) `dpp/tools/overhead.py` adds what a real PP=2 step spends beyond those layers.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.transformer.spec_utils import build_module

from megatron_ext.config.schema import ParallelConfig
from megatron_ext.config.store import MODEL_PRESETS
from megatron_ext.data.tokenizers import ByteTokenizer
from megatron_ext.dpp.config import layer_shape
from megatron_ext.dpp.planning.costmodel import CostModel
from megatron_ext.dpp.planning.plan import Chunk, Segment
from megatron_ext.dpp.runtime.attention import ChunkContext, PrefixKVCache, dpp_layer_spec
from megatron_ext.models.gpt import layer_spec, padded_vocab_size, transformer_config
from megatron_ext.platform.device import wall_clock
from megatron_ext.platform.launch import free_port, join_world, launch_local
from megatron_ext.platform.launch_env import detect_launch


@dataclass(frozen=True)
class Sample:
    q: int
    prefix: int
    fwd_s: float
    bwd_s: float
    act_bytes: float


@dataclass(frozen=True)
class HeadSample:
    tokens: int
    fwd_s: float
    bwd_s: float


def time_features(q: int, prefix: int) -> list[float]:
    return [1.0, q, q * prefix, q * q, prefix]


def _fit(samples: Sequence[Sample], y: np.ndarray) -> tuple[float, float, float, float, float]:
    """(gamma, alpha, beta, beta_self, prefix_s_token) by least squares relative to each
    sample's size, so small chunks count as much as large ones."""
    X = np.array([time_features(s.q, s.prefix) for s in samples])
    gamma, alpha, beta, beta_self, per_prefix = np.linalg.lstsq(X / y[:, None], np.ones_like(y), rcond=None)[0]
    return float(gamma), float(alpha), float(beta), float(beta_self), float(per_prefix)


def fit_time(samples: Sequence[Sample]) -> tuple[float, float, float, float, float, float]:
    """(gamma, alpha, beta, beta_self, prefix_s_token, bwd_ratio) of the forward; the ratio is
    the relative least-squares backward/forward factor."""
    y = np.array([s.fwd_s for s in samples])
    b = np.array([s.bwd_s for s in samples])
    ratio = float(np.mean(b / y))
    return (*_fit(samples, y), ratio)


def fit_backward(samples: Sequence[Sample]) -> tuple[float, float, float, float, float]:
    """(gamma, alpha, beta, beta_self, prefix_s_token) of the backward, fitted on its own."""
    return _fit(samples, np.array([s.bwd_s for s in samples]))


def fit_head(samples: Sequence[HeadSample]) -> tuple[float, float, float, float]:
    """(forward fixed s, forward s per token, backward fixed s, backward s per token) of the
    output layer and loss, by relative least squares."""
    X = np.array([[1.0, s.tokens] for s in samples])

    def fit(y: np.ndarray) -> tuple[float, float]:
        fixed, per_token = np.linalg.lstsq(X / y[:, None], np.ones_like(y), rcond=None)[0]
        return float(fixed), float(per_token)

    return (*fit(np.array([s.fwd_s for s in samples])), *fit(np.array([s.bwd_s for s in samples])))


def head_errors(model: CostModel, samples: Sequence[HeadSample]) -> dict[str, float]:
    """Relative errors of the head's forward, its backward, and of `bwd_ratio` times the
    forward as a backward estimate (what a model without the head_bwd_* terms predicts)."""
    fwd = [abs(model.head_forward_s(s.tokens) / s.fwd_s - 1) for s in samples]
    bwd = [abs(model.head_backward_s(s.tokens) / s.bwd_s - 1) for s in samples]
    by_ratio = [abs(model.bwd_ratio * model.head_forward_s(s.tokens) / s.bwd_s - 1) for s in samples]
    return {f"{k}_{agg.__name__}": float(agg(v))
            for k, v in (("fwd", fwd), ("bwd", bwd), ("bwd_by_ratio", by_ratio)) for agg in (np.mean, np.max)}


def fit_memory(samples: Sequence[Sample]) -> tuple[float, float, float]:
    """(bytes per token, per query-key pair, per prefix key) of one layer's saved activations."""
    X = np.array([[s.q, s.q * (s.q + s.prefix), s.prefix] for s in samples], dtype=float)
    y = np.array([s.act_bytes for s in samples])
    per_token, per_pair, per_key = np.linalg.lstsq(X, y, rcond=None)[0]
    return float(per_token), float(per_pair), float(per_key)


def relative_errors(model: CostModel, samples: Sequence[Sample]) -> dict[str, float]:
    fwd, bwd, mem = [], [], []
    for s in samples:
        c = Chunk(0, "split", (Segment(0, s.prefix, s.q),))
        fwd.append(abs(model.layer_forward_s(c) / s.fwd_s - 1))
        bwd.append(abs(model.layer_backward_s(c) / s.bwd_s - 1))
        mem.append(abs(model.layer_act_bytes(c) / s.act_bytes - 1))
    return {f"{k}_{agg.__name__}": float(agg(v)) for k, v in (("fwd", fwd), ("bwd", bwd), ("act_bytes", mem)) for agg in (np.mean, np.max)}


# --- measuring a real layer ------------------------------------------------------------------

def _saved_bytes(fn, params: set[int]) -> tuple[object, int]:
    total = 0

    def pack(t):
        nonlocal total
        if t.data_ptr() not in params:  # weights are model state, not activations
            total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, total


def device_clock(device, tp: int = 1) -> Callable[[], float]:
    """The clock a layer is timed with: in one CPU process its CPU time (on a CPU shared with
    other jobs, waiting for a core is not the layer's cost); across tensor-parallel ranks, whose
    waits for each other are, and on a GPU, the wall clock (after the device's queued kernels
    are done)."""
    return time.process_time if device.type == "cpu" and tp == 1 else wall_clock(device)


def _timed_once(fn, clock: Callable[[], float] = time.process_time) -> tuple[float, float, int]:
    """(forward s, backward s, saved bytes) of fn() -> (output, saved), timed by `clock`."""
    t = clock()
    out, saved = fn()
    f = clock() - t
    t = clock()
    out.sum().backward()
    return f, clock() - t, saved


STATISTICS = {"min": min, "median": statistics.median}


def _rounds(runs: dict, rounds: int, clock: Callable[[], float] = time.process_time) -> dict:
    """Each run timed once per round, rounds over the whole grid (a burst of load from other
    processes spoils one round of a point, not all of its repeats): per run, its forward
    seconds, backward seconds (one per round) and saved bytes."""
    out: dict = {k: ([], [], 0) for k in runs}
    for _ in range(rounds):
        for k, fn in runs.items():
            f, b, m = _timed_once(fn, clock)
            out[k] = (out[k][0] + [f], out[k][1] + [b], m)
    return out


def _slowest_rank(timed: dict, device) -> dict:
    """Each round's times as the slowest rank of the world measured them (the ranks of a
    tensor-parallel layer wait for each other); one rank: as they are."""
    if dist.get_world_size() == 1:
        return timed
    keys = sorted(timed)
    times = torch.tensor([timed[k][0] + timed[k][1] for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    rounds = len(timed[keys[0]][0])
    return {k: (row[:rounds], row[rounds:], timed[k][2]) for k, row in zip(keys, times.tolist())}


def reduce_rounds(timed: dict, statistic: str) -> dict:
    """Per run (forward s, backward s, saved bytes) with `statistic` ("min": the best round, the
    layer's own cost; "median": a typical round, as a step runs each op once) of its rounds."""
    if statistic not in STATISTICS:
        raise ValueError(f"dpp: unknown statistic {statistic!r}; known: {sorted(STATISTICS)}")
    agg = STATISTICS[statistic]
    return {k: (agg(f), agg(b), m) for k, (f, b, m) in timed.items()}


def default_vocab(model_name: str) -> int:
    """The vocabulary the trainer gives the preset: its own size, else the byte tokenizer's
    (the default tokenizer, which scripts/bench/dpp_measured.py trains with)."""
    return MODEL_PRESETS[model_name].vocab_size or ByteTokenizer().vocab_size


def measure(model_name: str, qs: Sequence[int], prefixes: Sequence[int], repeats: int,
            vocab: int, statistic: str = "median", device=None, tp: int = 1,
            sequence_parallel: bool = False) -> tuple[list[Sample], list[HeadSample], dict, dict]:
    """Samples of the layer and of the head (`statistic` of each point's rounds) on `device`
    (default: the CPU), the model's shape, and every round's times per point ("layer q p" /
    "head q": [forward], [backward]). With `tp` > 1 (collective: the ranks of megatron's
    tensor-parallel group, initialised for it) each rank runs its shard of the layer and the
    head, and a point's time is the slowest rank's; under `sequence_parallel` a chunk's tokens
    enter split over the ranks."""
    device = device or torch.device("cpu")
    on_cpu = device.type == "cpu"
    mc = MODEL_PRESETS[model_name]
    split = tp if sequence_parallel else 1
    if any(q % split for q in qs):
        raise ValueError(f"dpp calibrate: under sequence parallelism every --q must be a multiple of tp={tp}, got {list(qs)}")
    config = transformer_config(mc, ParallelConfig(tp=tp, sequence_parallel=sequence_parallel), on_cpu=on_cpu)
    context = ChunkContext()
    layer = build_module(dpp_layer_spec(layer_spec(mc, use_te=False), context), config=config, layer_number=1).to(device)
    params = {p.data_ptr() for p in layer.parameters()}
    groups = (config.num_query_groups or config.num_attention_heads) // tp  # this rank's K/V groups
    dim = config.kv_channels
    rope = RotaryEmbedding(kv_channels=dim, rotary_percent=1.0, rotary_base=int(mc.rotary_base),
                           use_cpu_initialization=True, cp_group=parallel_state.get_context_parallel_group())
    rope.inv_freq = rope.inv_freq.to(device)  # a plain attribute, which .to() would not move
    padded = padded_vocab_size(vocab, mc, tp=tp)
    output_layer = tensor_parallel.ColumnParallelLinear(
        config.hidden_size, padded, config=config, init_method=config.init_method, bias=False, skip_bias_add=False,
        gather_output=False).to(device)

    def layer_run(q: int, p: int):
        x = torch.randn(q // split, 1, config.hidden_size, device=device, requires_grad=True)
        emb = rope(p + q)[p:]
        prefix_kv = [torch.randn(p, 1, groups, dim, device=device) for _ in range(2)]
        segments = (Segment(0, p, q),)

        def run():
            # A fresh cache per run: only the prefix's K/V, as the earlier slices left them, so
            # the dK/dV handed down start from nothing every time.
            context.cache = PrefixKVCache()
            if p:
                context.cache.put((0, layer.layer_number), 0, *prefix_kv)
            context.enter(segments, (p + q,))
            return _saved_bytes(lambda: layer(x, attention_mask=None, rotary_pos_emb=emb)[0], params)

        return run

    def head_run(n: int):
        x = torch.randn(n // split, 1, config.hidden_size, device=device, requires_grad=True)
        labels = torch.randint(padded, (n, 1), device=device)

        def loss():  # GPTModel's output layer and its unfused compute_language_model_loss
            logits, _ = output_layer(x)
            return tensor_parallel.vocab_parallel_cross_entropy(logits.float(), labels)

        return lambda: (loss(), 0)

    runs = {("layer", q, p): layer_run(q, p) for q in qs for p in prefixes}
    runs.update({("head", q, 0): head_run(q) for q in qs})
    timed = _slowest_rank(_rounds(runs, repeats, device_clock(device, tp)), device)
    best = reduce_rounds(timed, statistic)
    context.leave()
    samples = [Sample(q, p, *best[("layer", q, p)][:2], float(best[("layer", q, p)][2])) for q in qs for p in prefixes]
    head = [HeadSample(q, *best[("head", q, 0)][:2]) for q in qs]
    shape = dict(layer_shape(mc), layer_params=sum(p.numel() for p in layer.parameters()), num_layers=mc.num_layers,
                 vocab=mc.vocab_size, padded_vocab=padded, tp=tp, sequence_parallel=sequence_parallel)
    rounds = {f"{kind} {q}" + (f" {p}" if kind == "layer" else ""): [f, b] for (kind, q, p), (f, b, _) in timed.items()}
    return samples, head, shape, rounds


def calibrate(samples: Sequence[Sample], head: Sequence[HeadSample], shape: dict,
              bytes_per_value: int = 4) -> tuple[CostModel, dict]:
    train, held = samples[0::2], samples[1::2]
    gamma, alpha, beta, beta_self, per_prefix, ratio = fit_time(train)
    bwd_gamma, bwd_alpha, bwd_beta, bwd_beta_self, bwd_per_prefix = fit_backward(train)
    head_gamma, head_fwd, head_bwd_gamma, head_bwd = fit_head(head[0::2])
    per_token, per_pair, per_key = fit_memory(train)
    tp = shape.get("tp", 1)  # a rank's share: its K/V groups, and under SP its part of the tokens
    kv_dim = shape["hidden"] // shape["heads"] * shape["kv_heads"] // tp
    hidden = shape["hidden"] // (tp if shape.get("sequence_parallel") else 1)
    model = CostModel(
        alpha=alpha, beta=beta, gamma=gamma, bwd_ratio=ratio, bwd_alpha=bwd_alpha, bwd_beta=bwd_beta, bwd_gamma=bwd_gamma,
        beta_self=beta_self, bwd_beta_self=bwd_beta_self, prefix_s_token=per_prefix, bwd_prefix_s_token=bwd_per_prefix,
        head_gamma=head_gamma, head_s_token=head_fwd, head_bwd_gamma=head_bwd_gamma, head_bwd_s_token=head_bwd,
        act_bytes_token=per_token, act_bytes_attn=per_pair, act_bytes_key=per_key,
        ckpt_bytes_token=bytes_per_value * hidden,
        kv_bytes_token=bytes_per_value * 2 * kv_dim,
        # fp32 params, grads and two Adam moments
        state_bytes_param=4.0 * bytes_per_value,
        layer_params=shape["layer_params"], num_layers=shape["num_layers"],
    )
    return model, {"train": relative_errors(model, train), "held_out": relative_errors(model, held),
                   "head_train": head_errors(model, head[0::2]), "head_held_out": head_errors(model, head[1::2])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="llama_tiny", help="a model preset of megatron_ext.config.store")
    ap.add_argument("--q", type=int, nargs="+", default=[64, 128, 256, 384, 512, 768, 1024])
    ap.add_argument("--prefix", type=int, nargs="+", default=[0, 256, 512, 1024, 2048])
    ap.add_argument("--repeats", type=int, default=15, help="rounds over the grid")
    ap.add_argument("--statistic", choices=sorted(STATISTICS), default="median",
                    help="of each point's rounds (earlier calibrations kept the min)")
    ap.add_argument("--overhead", action=argparse.BooleanOptionalAction, default=True,
                    help="then measure what a PP=2 step adds to the layers (2 processes, dpp/tools/overhead.py)")
    ap.add_argument("--overhead-seq-len", type=int, default=4096, help="the longest sequence of the overhead's plans")
    ap.add_argument("--overhead-rounds", type=int, default=2, help="steps of each of the overhead's plans")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                    help="where the layers are timed (auto: CUDA when available)")
    ap.add_argument("--tp", type=int, default=1, help="time each rank's shard of a tensor-parallel layer (tp processes)")
    ap.add_argument("--sequence-parallel", action="store_true", help="with --tp: tokens enter split over the ranks")
    ap.add_argument("--vocab", type=int, default=None,
                    help="the tokenizer's vocabulary, padded as the trainer pads it; default: the preset's, else "
                         "the byte tokenizer's")
    args = ap.parse_args()
    if args.tp < 1 or (args.sequence_parallel and args.tp == 1):
        sys.exit("dpp calibrate: --tp must be >= 1, and --sequence-parallel needs --tp > 1")
    if args.overhead and args.tp > 1:
        # Its PP=2 run is at TP=1: its terms would not be this layout's.
        sys.exit("dpp calibrate: the overhead run (--overhead) times PP=2 steps at TP=1 only; with --tp pass --no-overhead")

    if args.tp > 1 and detect_launch() is None:
        launch_local(args.tp, calibrate_on_this_rank, (args,), "127.0.0.1", free_port())
    else:
        calibrate_on_this_rank(args)


def calibrate_on_this_rank(args: argparse.Namespace) -> None:
    """One rank of the calibration (of `args.tp` ranks); the first writes the cost model."""
    _, device = join_world(args.device)
    if args.overhead and device.type != "cpu":
        # Its PP=2 run is a gloo world on the CPU: its terms would not be this device's.
        sys.exit("dpp calibrate: the overhead run (--overhead) times PP=2 steps on the CPU only; on a GPU pass --no-overhead")
    if dist.get_world_size() != args.tp:
        sys.exit(f"dpp calibrate: --tp {args.tp} needs a world of {args.tp} processes, not {dist.get_world_size()}")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=args.tp)
    model_parallel_cuda_manual_seed(1234)
    t = time.perf_counter()
    samples, head, shape, rounds = measure(args.model, args.q, args.prefix, args.repeats, args.vocab or default_vocab(args.model),
                                           args.statistic, device, args.tp, args.sequence_parallel)
    first = dist.get_rank() == 0
    dist.destroy_process_group()
    if first:
        write(args, samples, head, shape, rounds, time.perf_counter() - t)


def write(args: argparse.Namespace, samples: list[Sample], head: list[HeadSample], shape: dict, rounds: dict,
          measure_s: float) -> None:
    """Fit, write and report the cost model; then its overhead terms (unless --no-overhead)."""
    t = time.perf_counter() - measure_s
    model, errors = calibrate(samples, head, shape)
    model.to_json(args.out, model=args.model, shape=shape, errors=errors, samples=[dataclasses.asdict(s) for s in samples],
                  head_samples=[dataclasses.asdict(s) for s in head], measure_s=time.perf_counter() - t,
                  statistic=args.statistic, rounds=rounds)
    print(json.dumps({k: getattr(model, k) for k in ("alpha", "beta", "beta_self", "prefix_s_token", "gamma", "bwd_ratio",
                                                     "head_gamma", "head_s_token",
                                                     "head_bwd_gamma", "head_bwd_s_token", "act_bytes_token",
                                                     "act_bytes_attn")}, indent=1))
    print("held-out relative error:", json.dumps(errors["held_out"], indent=1))
    print("head held-out relative error:", json.dumps(errors["head_held_out"], indent=1))
    print(f"measured in {time.perf_counter() - t:.1f}s; wrote {args.out}")
    if args.overhead:
        run_overhead(args.out, args.model, args.overhead_seq_len, args.overhead_rounds)


def run_overhead(path: str, model: str, seq_len: int, rounds: int = 2) -> None:
    """Add the runtime's terms to the cost model at `path` (a PP=2 run on this machine)."""
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    subprocess.run([sys.executable, "-W", "ignore", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                    "-m", "megatron_ext.dpp.tools.overhead", "--cost", path, "--model", model, "--seq-len", str(seq_len),
                    "--rounds", str(rounds)],
                   check=True, env=env)


if __name__ == "__main__":
    main()
