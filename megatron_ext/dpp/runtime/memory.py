"""What a stage really holds for backward, counted exactly, and when each op ran.

`ActivationMeter` counts the bytes autograd saves for backward through
`torch.autograd.graph.saved_tensors_hooks`, by storage (a tensor saved by several ops, or views
of one buffer, count once) and without parameters (they are model state, not activations),
plus the K/V prefix cache of split sequences (`hold`). A saved tensor is released when autograd drops
it (after its backward), so the running total is the stage's activation memory at every
moment, and its maximum is the peak. On CPU there is no allocator to ask; this count is the
analogue of the CUDA allocator's peak for activations.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.utils import get_attr_wrapped_model, get_model_config

from megatron_ext.dpp.planning.plan import Chunk, Segment
from megatron_ext.dpp.runtime.attention import PrefixKVCache, _SliceAttention
from megatron_ext.dpp.runtime.batch import chunk_inputs
from megatron_ext.platform.device import current_device
from megatron_ext.platform.moe_aux_loss_scale import aux_loss_scale, set_aux_loss_scale
from megatron_ext.training.step import forward_step


class _Saved:
    """A saved tensor's stand-in in the autograd graph; its death releases the storage count."""

    __slots__ = ("tensor", "key", "meter")

    def __init__(self, tensor: torch.Tensor, key: int, meter: "ActivationMeter") -> None:
        self.tensor, self.key, self.meter = tensor, key, meter

    def __del__(self) -> None:
        self.meter._release(self.key)


class ActivationMeter:
    def __init__(self, model_chunks: list) -> None:
        self._params = {
            p.untyped_storage().data_ptr() for chunk in model_chunks for p in chunk.parameters()
        }
        self._live: dict[int, list] = {}  # storage -> [bytes, references, chunk]
        self.live_bytes = 0
        self.peak_bytes = 0
        self.by_chunk: dict[int, int] = {}  # bytes each chunk holds now
        self.peak_by_chunk: dict[int, int] = {}  # the most each chunk ever held at once
        self._chunk = -1

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes
        self.peak_by_chunk = dict(self.by_chunk)

    def _add(self, chunk: int, nbytes: int) -> None:
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        held = self.by_chunk.get(chunk, 0) + nbytes
        self.by_chunk[chunk] = held
        self.peak_by_chunk[chunk] = max(self.peak_by_chunk.get(chunk, 0), held)

    def hold(self, tensor: torch.Tensor):
        """Count a tensor kept outside autograd (the K/V prefix cache) until the returned
        handle is dropped; a storage autograd also saves counts once."""
        return self._pack(tensor)

    def _pack(self, tensor: torch.Tensor):
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key == 0 or key in self._params:
            return tensor
        entry = self._live.get(key)
        if entry is None:
            self._live[key] = [storage.nbytes(), 1, self._chunk]
            self._add(self._chunk, storage.nbytes())
        else:
            entry[1] += 1
        return _Saved(tensor, key, self)

    @staticmethod
    def _unpack(packed):
        return packed.tensor if isinstance(packed, _Saved) else packed

    def _release(self, key: int) -> None:
        entry = self._live[key]
        entry[1] -= 1
        if entry[1] == 0:
            del self._live[key]
            self._add(entry[2], -entry[0])

    @contextlib.contextmanager
    def track(self, chunk: int) -> Iterator[None]:
        """Count what autograd saves while chunk `chunk` runs (its forward, or the recompute
        inside its backward)."""
        previous, self._chunk = self._chunk, chunk
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            self._chunk = previous


@dataclass
class Timeline:
    """When each op of a stage ran: (stage, kind, chunk, recompute, start, end), times from
    `time.perf_counter()` (a monotonic clock that the processes of one machine share, so the
    stages' records line up once gathered)."""

    records: list[tuple[int, str, int, int, float, float]] = field(default_factory=list)

    def record(self, stage: int, kind: str, chunk: int, recompute: int, start: float, end: float) -> None:
        self.records.append((stage, kind, chunk, recompute, start, end))

    def clear(self) -> None:
        self.records.clear()


def attention_backward_bytes(heads: int, groups: int, head_dim: int, dtype: torch.dtype) -> tuple[float, float, float]:
    """(per (query, key) pair, per key, per query): what the chunk attention holds while one
    segment runs backward, beyond what it saved in forward, fitted exactly on a few small
    segments with and without a cached prefix."""
    rows, held = [], []
    for q_len, prefix in ((32, 0), (64, 0), (32, 64), (64, 128)):
        meter, cache = ActivationMeter([]), PrefixKVCache()
        cache.hold = meter.hold

        def qkv(n: int) -> tuple[torch.Tensor, ...]:
            return tuple(torch.randn(n, 1, h, head_dim, dtype=dtype, requires_grad=True) for h in (heads, groups, groups))

        with meter.track(0):
            if prefix:
                _SliceAttention.apply(*qkv(prefix), cache, (0, 0), 0, True, 1.0)
            out = _SliceAttention.apply(*qkv(q_len), cache, (0, 0), prefix, False, 1.0)
            before = meter.live_bytes
            meter.reset_peak()
            out.backward(torch.ones_like(out))
        rows.append([q_len * (prefix + q_len), prefix + q_len, q_len])
        held.append(meter.peak_bytes - before)
    pair, key, query = np.linalg.lstsq(np.array(rows, dtype=float), np.array(held, dtype=float), rcond=None)[0]
    return float(pair), float(key), float(query)


def fit_activation_bytes(model_chunks: list, context, cost, tokens: Sequence[int] = (192, 384, 768)):
    """`cost` with its activation terms fitted to this runtime (collective over the world):
    each stage runs the step's forward (and loss) on one whole sequence of T tokens with none,
    one and all of its layers recomputed (random input on later stages, no pipeline), and the
    meter's bytes held until backward give bytes/token of a kept layer, of a recomputed layer,
    and of the stage itself (its RoPE table; the output layer and loss on the last stage). The
    bytes still held when each layer's attention starts its backward give what a layer releases
    before it and what a recomputed layer's replay shares with its kept input; the attention's
    own backward transient is fitted on bare segments
    (`attention_backward_bytes`). Under sequence parallelism the token counts are rounded up to
    multiples of tp (the rows returned hold the rounded ones). Returns (model, fit details)."""
    if not tokens or any(int(t) < 1 for t in tokens):
        raise ValueError(f"dpp memory fit: token counts must be positive, got {list(tokens)}")
    model = model_chunks[0]
    config = get_model_config(model)
    tp = config.tensor_model_parallel_size
    # Under sequence parallelism a stage's input holds the chunk's tokens split over TP.
    sp = tp if config.sequence_parallel else 1
    tokens = [-(-int(t) // sp) * sp for t in tokens]
    first, last = parallel_state.is_pipeline_first_stage(), parallel_state.is_pipeline_last_stage()
    layers = len(get_attr_wrapped_model(model, "decoder").layers)
    meter = ActivationMeter(model_chunks)
    rows = []
    drops = {}  # (stage, T, recompute) -> per layer: bytes retained - bytes when its attention starts backward
    at_attention: dict[int, int] = {}  # layer -> bytes held when its attention starts backward

    def note_attention(layer: int):
        def hook(module, grad_output) -> None:
            at_attention.setdefault(layer, meter.live_bytes)
        return hook

    hooks = [layer.self_attention.core_attention.register_full_backward_pre_hook(note_attention(i))
             for i, layer in enumerate(get_attr_wrapped_model(model, "decoder").layers)]
    set_input = get_attr_wrapped_model(model, "set_input_tensor")
    recompute_before = config.recompute_num_layers
    # Megatron keeps the MoE aux-loss scale process-global, shaped by its first user; a backward
    # here (outside its schedules) would leave a shape the schedules cannot copy into.
    aux_scale_before = aux_loss_scale()
    try:  # the model leaves as it came, even when a forward raises: no input, recompute, grads
        for n_tokens in tokens:
            for recompute in sorted({0, 1, layers}):
                chunk = Chunk(0, "packed", (Segment(0, 0, n_tokens),))
                batch = chunk_inputs(chunk, [torch.zeros(n_tokens + 1, dtype=torch.long)])  # any tokens do
                set_input([None if first else torch.randn(n_tokens // sp, 1, config.hidden_size, dtype=config.params_dtype,
                                                          device=current_device(), requires_grad=True)])
                context.enter(chunk.segments, (n_tokens,))
                config.recompute_num_layers = recompute
                with meter.track(0):  # the step's own forward and loss (which saves the loss mask)
                    out, loss_of = forward_step(iter([batch]), model)
                    if last:
                        out = loss_of(out)[0]
                stage = parallel_state.get_pipeline_model_parallel_rank()
                rows.append((stage, n_tokens, recompute, layers, meter.live_bytes))
                at_attention.clear()
                with meter.track(0):  # a recomputed layer's replay saves its tensors in backward
                    out.backward(None if last else torch.randn_like(out))
                drops[stage, n_tokens, recompute] = [rows[-1][-1] - at_attention[i] for i in range(layers)]
                del out
                context.leave()
    finally:
        for hook in hooks:
            hook.remove()
        context.leave()
        set_input([None])
        config.recompute_num_layers = recompute_before
        set_aux_loss_scale(aux_scale_before)
        for m in model_chunks:
            m.zero_grad_buffer()
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (rows, drops))
    rows = [row for part, _ in gathered for row in part]
    drops = {key: value for _, part in gathered for key, value in part.items()}
    last_stage = max(r[0] for r in rows)
    # bytes = T * ((L - r) * kept layer + r * recomputed layer + [r > 0] * recomputed block +
    # head on the last stage), fitted on the first and the last stage. The recomputed block
    # keeps its inputs beside the hidden states (the RoPE table) once, however many layers it
    # holds; r = 1 tells it from the per-layer term (with L = 1 it is that term). The first
    # stage's own bytes (its RoPE table, the token ids) are spread over its layers: stages are
    # equally deep, so every (layers, recompute) combination stays exact there, middle stages
    # (which hold a little less) are over-counted, never under, and what is fitted is
    # determined by the rows (a separate stage term would not be: it trades off against the
    # per-layer terms). With one stage the head is spread over the layers too.
    ends = [row for row in rows if row[0] in (0, last_stage)]
    X = np.array([[t * (n - r), t * r, t * (r > 0 and n > 1), t * (0 < s == last_stage)]
                  for s, t, r, n, _ in ends], dtype=float)
    y = np.array([b for *_, b in ends], dtype=float)
    kept, recomputed, block, head = np.linalg.lstsq(X, y, rcond=None)[0]
    residual = float(np.max(np.abs(X @ [kept, recomputed, block, head] / y - 1)))
    # A TP rank's attention runs its own heads and K/V groups.
    heads, groups = config.num_attention_heads // tp, (config.num_query_groups or config.num_attention_heads) // tp
    kv_dim = config.kv_channels * groups
    # What a layer's backward releases before its attention's, per token (its output projection
    # and MLP): without recompute, layer l's drop is the layers above it, the head on the last
    # stage (counted apart) and this. The least over stages, lengths and layers, so that no
    # stage's transient is underestimated.
    plain = {key: drop for key, drop in drops.items() if key[2] == 0}
    released = min(drop[i] / t - (layers - 1 - i) * kept - (head if 0 < s == last_stage else 0.0)
                   for (s, t, _), drop in plain.items() for i in range(layers))
    # Of a recomputed layer's kept input, what its replay saves again as the very same storage
    # (nearly all of it in fp32; in half precision the norm saves an fp32 copy instead): a
    # recomputed layer's drop, less the one without recompute, is that shared part less a
    # whole layer, less what the recomputed layers above it keep less than whole ones.
    shared = min((drop[i] - plain[s, t, 0][i]) / t + kept + (r - i - 1) * (kept - recomputed)
                  for (s, t, r), drop in drops.items() for i in range(r))
    pair, key, query = attention_backward_bytes(heads, groups, config.kv_channels, config.params_dtype)
    fitted = dataclasses.replace(
        cost,
        act_bytes_token=kept,
        # The chunk attention saves no scores and reads a slice's prefix from the K/V cache
        # (counted by kv_bytes_token), not from a saved concatenation.
        act_bytes_attn=0.0,
        act_bytes_key=0.0,
        ckpt_bytes_token=recomputed,
        ckpt_block_bytes_token=block,
        ckpt_unshared_bytes_token=recomputed - shared,
        kv_bytes_token=2 * kv_dim * torch.finfo(config.params_dtype).bits // 8,
        head_bytes_token=head,
        attn_freed_bytes_token=released,
        attn_bwd_bytes_pair=pair,
        attn_bwd_bytes_key=key,
        attn_bwd_bytes_query=query,
    )
    return fitted, {"rows": rows, "kept_layer_bytes_token": kept, "recomputed_layer_bytes_token": recomputed,
                    "recomputed_block_bytes_token": block, "recomputed_shared_bytes_token": shared,
                    "head_bytes_token": head, "max_relative_residual": residual, "released_bytes_token": released,
                    "attention_backward": {"pair": pair, "key": key, "query": query}}


def state_bytes_per_param(precision: str, optimizer: str, distributed_optimizer: bool, dp: int) -> float:
    """Model-state bytes per parameter on a rank: the parameter, its fp32 gradient buffer
    (megatron's DDP reduces in fp32 here), and the optimizer's fp32 state (Adam's two moments or
    SGD's momentum, plus an fp32 master copy of half-precision parameters), sharded over the
    `dp` data-parallel ranks by the distributed optimizer."""
    moments = {"adam": 2, "sgd": 1}
    if optimizer not in moments:
        raise ValueError(f"dpp: no model-state size for optimizer {optimizer!r} (known: {sorted(moments)})")
    half = precision in ("bf16", "fp16")
    optimizer_bytes = 4 * moments[optimizer] + (4 if half else 0)
    return (2 if half else 4) + 4 + optimizer_bytes / (dp if distributed_optimizer else 1)


def fit_model_states(model_chunks: list, cost, bytes_per_param: float):
    """`cost` with its model-state terms counted on this run's model (collective over the
    world): the parameters of one decoder layer, and what the first and the last pipeline stage
    hold besides their layers (the embedding; the final norm, the output layer or a tied
    embedding's copy), as this rank holds them (its TP shards), at `bytes_per_param` each. With
    one stage everything beside the layers counts as its embedding."""
    layers = get_attr_wrapped_model(model_chunks[0], "decoder").layers
    params = {p.data_ptr(): p.numel() for chunk in model_chunks for p in chunk.parameters()}
    per_layer = sum(p.numel() for p in layers[0].parameters())
    mine = (parallel_state.get_pipeline_model_parallel_rank(), per_layer, sum(params.values()) - len(layers) * per_layer)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    last = max(stage for stage, _, _ in gathered)
    besides = lambda s: max(extra for stage, _, extra in gathered if stage == s)  # noqa: E731
    return dataclasses.replace(
        cost,
        layer_params=max(n for _, n, _ in gathered),
        embedding_params=besides(0),
        head_params=besides(last) if last > 0 else 0,
        state_bytes_param=bytes_per_param,
    )
