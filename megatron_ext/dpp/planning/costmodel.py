"""Time and memory of a chunk on a pipeline stage (InfiniPipe's §III-A gives none: this is a working model).

Time of one layer's forward over a chunk whose segments have q_i new tokens and a KV prefix p_i:

    T_f = gamma + (alpha * sum q_i + beta * sum q_i p_i + beta_self * sum q_i^2 + pi * sum p_i) * (1 + t0 / sum q_i)

alpha is the per-token cost of the dense parts, beta the attention of a new token to its prefix,
beta_self the attention within the segment, pi (`prefix_s_token`) the work per prefix token
whatever the slice's length (the cached K/V joined to the slice's and, backward, its dK/dV
handed down; 0 unless calibrated), gamma a fixed per-layer overhead, and the last factor the
under-utilisation of small chunks (t0 = 0 turns it off). A causal kernel that skips
the masked half (flash attention) has beta_self = beta / 2, the default; a kernel that computes
the masked scores and discards them (SDPA with an explicit mask, as on CPU) has its own.
Backward is `bwd_ratio` times the forward, or the same form with its own coefficients; a
recomputed layer adds one more forward. The last stage adds the output layer and the loss,
`head_gamma + head_s_token * tokens` forward and the same form with `head_bwd_*` backward
(default: `bwd_ratio` times the forward). In a real step an op takes `runtime_*_scale` times
that plus the schedule loop's fixed seconds (`chunk_fwd_s`, `chunk_bwd_s`), every transfer
between stages `p2p_latency_s + p2p_s_token * tokens`, and every step `step_fixed_s` (gradient
finalisation); scales 1 and the rest 0 unless calibrated (`dpp/tools/overhead.py`).

Memory counts what autograd saves (the quantity the runtime measures with saved-tensor hooks):
per layer `act_bytes_token` per token, `act_bytes_attn` per (query, key) pair (dense masked
attention materialises its scores; 0 for flash attention) and `act_bytes_key` per prefix token
(the attention saves the K/V it attended to, prefix included). A recomputed layer keeps only its
input (`ckpt_bytes_token` per token) and, for a slice that later slices of its sequence attend
to, that slice's K/V (`kv_bytes_token` per token); the recomputed block keeps its other inputs
(the RoPE table) once (`ckpt_block_bytes_token` per token). Model states are `state_bytes_param` per
parameter, with the embedding on the first stage and the output layer on the last.

Backward adds transients on top of what the chunks keep. The output layer's bytes and, in the
top layer, `attn_freed_bytes_token` per token (output projection and MLP) are released before
that layer's attention runs backward, which then holds `attn_bwd_bytes_pair` per (query, key)
pair of one segment (a materialised mask or scores), `attn_bwd_bytes_key` per key and
`attn_bwd_bytes_query` per query; a chunk that recomputes every layer of its stage re-saves
its top layer first. A later slice hands dK/dV of its prefix (`kv_bytes_token` per token and
layer) down to the earlier slices, held until their backward.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from megatron_ext.dpp.planning.plan import Chunk, Segment


# The activation-memory model's stated error: with its terms fitted to the runtime
# (`memory.fit_activation_bytes`), a plan's predicted per-stage activation peak is within this
# fraction of the exact count (tests/distributed/test_dpp_runtime.py: at most 0.3% under at
# PP 2, 3 and 4; the measured benchmark). Planners keep this fraction of the activation budget
# free.
ACTIVATION_ERROR = 0.01


def usable_budget(budget_bytes: float, state_bytes: float) -> float:
    """The per-stage budget a plan may fill: `budget_bytes` less the model's stated error on
    the activations (the part above `state_bytes`; with the least states of any stage, every
    stage keeps at least that fraction of its own activation room free)."""
    return budget_bytes - ACTIVATION_ERROR * max(0.0, budget_bytes - state_bytes)


def budget_for(usable_bytes: float, state_bytes: float) -> float:
    """The budget whose usable part is `usable_bytes` (the inverse of `usable_budget`)."""
    return state_bytes + max(0.0, usable_bytes - state_bytes) / (1.0 - ACTIVATION_ERROR)


@dataclass(frozen=True)
class ModelShape:
    """A LLaMA-style decoder: SwiGLU MLP, grouped-query attention, untied output layer."""

    name: str
    num_layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    vocab: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def layer_params(self) -> int:
        qkv = self.hidden * self.head_dim * (self.heads + 2 * self.kv_heads)
        return qkv + self.hidden * self.hidden + 3 * self.hidden * self.ffn + 2 * self.hidden

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden


LLAMA_7B = ModelShape("llama-7b", num_layers=32, hidden=4096, ffn=11008, heads=32, kv_heads=32, vocab=32000)
LLAMA_13B = ModelShape("llama-13b", num_layers=40, hidden=5120, ffn=13824, heads=40, kv_heads=40, vocab=32000)
MODEL_SHAPES = {m.name: m for m in (LLAMA_7B, LLAMA_13B)}


def _attention_work(pair: float, self_pair: float | None, length: int, prefix: int) -> float:
    if self_pair is None:  # today's expression, so that older models give the same floats
        return pair * length * (prefix + length / 2)
    return pair * length * prefix + self_pair * length * length


@dataclass(frozen=True)
class CostModel:
    # time, seconds
    alpha: float
    beta: float
    gamma: float
    bwd_ratio: float = 2.0
    # Backward with its own coefficients (set by a CPU calibration, where attention's backward
    # does not scale like its forward); None: bwd_ratio times the forward.
    bwd_alpha: float | None = None
    bwd_beta: float | None = None
    bwd_gamma: float | None = None
    t0: float = 0.0
    head_s_token: float = 0.0  # output layer + loss forward, per token (last stage)
    # The q^2 coefficients of the attention (forward, backward); None: half of beta / bwd_beta,
    # a causal kernel that skips the masked half (every model written before they existed).
    beta_self: float | None = None
    bwd_beta_self: float | None = None
    # The head's fixed seconds per chunk (its small kernels and TP reductions); backward None:
    # bwd_ratio times the forward's.
    head_gamma: float = 0.0
    head_bwd_s_token: float | None = None
    head_bwd_gamma: float | None = None
    # pi of the forward and, with bwd_alpha, of the backward (else bwd_ratio times the forward)
    prefix_s_token: float = 0.0
    bwd_prefix_s_token: float = 0.0
    p2p_s_token: float = 0.0
    p2p_latency_s: float = 0.0
    # The schedule loop's own seconds per op on a stage (building the chunk's inputs, megatron's
    # forward_step / backward_step around the layers, posting the p2p send), and per step
    # outside the ops (gradient finalisation); 0: a model that times the layers only.
    chunk_fwd_s: float = 0.0
    chunk_bwd_s: float = 0.0
    step_fixed_s: float = 0.0
    # A stage's layers inside a pipelined step may take longer than the calibration's time: a
    # step runs each op once, and on a shared CPU one layer's time varies 1.3-1.4x between
    # rounds (against the best round an op takes 1.4-1.7x, against the median 1.0-1.1x). These
    # factors scale an op's layer and head time, fitted on real steps (`dpp/tools/overhead.py`); 1: as
    # timed alone.
    runtime_fwd_scale: float = 1.0
    runtime_bwd_scale: float = 1.0
    # The same factors per chunk size: at the token counts `runtime_scale_tokens` (increasing)
    # the factors `runtime_fwd_scales` / `runtime_bwd_scales`, linear in log(tokens) between
    # them and constant beyond; None: the single factors above.
    runtime_scale_tokens: tuple[int, ...] | None = None
    runtime_fwd_scales: tuple[float, ...] | None = None
    runtime_bwd_scales: tuple[float, ...] | None = None
    # memory, bytes
    act_bytes_token: float = 0.0
    act_bytes_attn: float = 0.0
    act_bytes_key: float = 0.0  # per prefix key: the prefix K/V concatenated and saved by attention
    ckpt_bytes_token: float = 0.0
    # a chunk's recomputed block keeps its other inputs (the RoPE table) once, whatever its depth
    ckpt_block_bytes_token: float = 0.0
    # of a recomputed layer's kept input, what its replay saves anew instead of sharing it (a
    # half-precision norm saves an fp32 copy of its input, not the input itself)
    ckpt_unshared_bytes_token: float = 0.0
    kv_bytes_token: float = 0.0
    head_bytes_token: float = 0.0
    attn_freed_bytes_token: float = 0.0
    attn_bwd_bytes_pair: float = 0.0
    attn_bwd_bytes_key: float = 0.0
    attn_bwd_bytes_query: float = 0.0
    state_bytes_param: float = 0.0
    layer_params: int = 0
    embedding_params: int = 0
    head_params: int = 0
    num_layers: int = 0

    def __post_init__(self) -> None:
        sized = (self.runtime_scale_tokens, self.runtime_fwd_scales, self.runtime_bwd_scales)
        if any(v is None for v in sized):
            if any(v is not None for v in sized):
                raise ValueError("dpp: runtime_scale_tokens, runtime_fwd_scales and runtime_bwd_scales go together")
            return
        knots = tuple(int(n) for n in self.runtime_scale_tokens)
        if not knots or any(b <= a for a, b in zip(knots, knots[1:])) or knots[0] < 1:
            raise ValueError(f"dpp: runtime_scale_tokens must be positive and increasing, got {knots}")
        if len(self.runtime_fwd_scales) != len(knots) or len(self.runtime_bwd_scales) != len(knots):
            raise ValueError(f"dpp: runtime_fwd_scales / runtime_bwd_scales need one factor per token count {knots}")
        # JSON gives lists; the model stays hashable
        object.__setattr__(self, "runtime_scale_tokens", knots)
        object.__setattr__(self, "runtime_fwd_scales", tuple(float(x) for x in self.runtime_fwd_scales))
        object.__setattr__(self, "runtime_bwd_scales", tuple(float(x) for x in self.runtime_bwd_scales))

    # --- time ---------------------------------------------------------------------------
    def runtime_scale(self, kind: str, tokens: int) -> float:
        """The in-step factor of an op's layer and head time ("F" or "B") for a chunk of
        `tokens` tokens."""
        if self.runtime_scale_tokens is None:
            return self.runtime_fwd_scale if kind == "F" else self.runtime_bwd_scale
        scales = self.runtime_fwd_scales if kind == "F" else self.runtime_bwd_scales
        return sum(w * f for w, f in zip(scale_weights(self.runtime_scale_tokens, tokens), scales))

    def segment_work(self, length: int, prefix: int) -> float:
        return self.alpha * length + _attention_work(self.beta, self.beta_self, length, prefix) + self.prefix_s_token * prefix

    def time_from_work(self, work: float, tokens: int) -> float:
        return self.gamma + work * (1.0 + self.t0 / max(tokens, 1))

    def layer_forward_s(self, chunk: Chunk) -> float:
        # Padding runs through the dense parts only (it attends to nothing).
        work = sum(self.segment_work(s.length, s.prefix) for s in chunk.segments) + self.alpha * chunk.padding
        return self.time_from_work(work, chunk.tokens)

    def slice_tokens(self, time_s: float, prefix: int) -> int:
        """The longest slice after `prefix` tokens whose layer forward, alone in a chunk,
        takes at most `time_s` (the time is a quadratic in the slice length)."""
        a = self.beta / 2 if self.beta_self is None else self.beta_self
        b = self.alpha + self.beta * prefix + a * self.t0
        # the prefix term is constant in the slice's length (exactly so for t0 = 0; otherwise the
        # steps below correct it)
        c = self.gamma + self.alpha * self.t0 + self.beta * self.t0 * prefix + self.prefix_s_token * prefix - time_s
        if c > 0:
            return 0
        q = int(-c / b if a == 0 else (-b + (b * b - 4 * a * c) ** 0.5) / (2 * a))
        # The closed form's rounding can land one token off the boundary that layer_forward_s
        # (a different order of operations) draws; step onto it.
        alone = lambda n: self.layer_forward_s(Chunk(0, "split", (Segment(0, prefix, n),)))  # noqa: E731
        while alone(q + 1) <= time_s:
            q += 1
        while q > 0 and alone(q) > time_s:
            q -= 1
        return q

    def layer_backward_s(self, chunk: Chunk) -> float:
        if self.bwd_alpha is None:
            return self.bwd_ratio * self.layer_forward_s(chunk)
        work = sum(self.bwd_alpha * s.length + _attention_work(self.bwd_beta, self.bwd_beta_self, s.length, s.prefix)
                   + self.bwd_prefix_s_token * s.prefix for s in chunk.segments) + self.bwd_alpha * chunk.padding
        return self.bwd_gamma + work * (1.0 + self.t0 / max(chunk.tokens, 1))

    def head_forward_s(self, tokens: int) -> float:
        return self.head_gamma + self.head_s_token * tokens

    def head_backward_s(self, tokens: int) -> float:
        fixed = self.bwd_ratio * self.head_gamma if self.head_bwd_gamma is None else self.head_bwd_gamma
        per_token = self.bwd_ratio * self.head_s_token if self.head_bwd_s_token is None else self.head_bwd_s_token
        return fixed + per_token * tokens

    def forward_s(self, chunk: Chunk, layers: int, last: bool) -> float:
        head = self.head_forward_s(chunk.tokens) if last else 0.0
        return self.runtime_scale("F", chunk.tokens) * (layers * self.layer_forward_s(chunk) + head) + self.chunk_fwd_s

    def backward_s(self, chunk: Chunk, layers: int, recompute: int, last: bool) -> float:
        head = self.head_backward_s(chunk.tokens) if last else 0.0
        work = layers * self.layer_backward_s(chunk) + head + recompute * self.layer_forward_s(chunk)
        return self.runtime_scale("B", chunk.tokens) * work + self.chunk_bwd_s

    def p2p_s(self, chunk: Chunk) -> float:
        return self.p2p_latency_s + self.p2p_s_token * chunk.tokens

    # --- memory -------------------------------------------------------------------------
    def layer_act_bytes(self, chunk: Chunk) -> float:
        """Saved bytes of one layer without recompute. Dense masked attention spans the whole
        chunk: every query of the chunk against every key of the chunk and of its prefix."""
        prefix = sum(s.prefix for s in chunk.segments)
        return (self.act_bytes_token * chunk.tokens + self.act_bytes_attn * chunk.tokens * (chunk.tokens + prefix)
                + self.act_bytes_key * prefix)

    def layer_ckpt_bytes(self, chunk: Chunk, seq_lengths: Sequence[int]) -> float:
        """Saved bytes of one recomputed layer: its input, and the K/V of slices that later
        slices of the same sequence still attend to."""
        continued = sum(s.length for s in chunk.segments if s.start + s.length < seq_lengths[s.seq])
        return self.ckpt_bytes_token * chunk.tokens + self.kv_bytes_token * continued

    def activation_bytes(self, chunk: Chunk, seq_lengths: Sequence[int], layers: int, recompute: int, last: bool) -> float:
        """Bytes chunk keeps on a stage between its forward and its backward: linear in
        `recompute` but for the recomputed block's own inputs, kept once (the ILP takes the
        slope of one recomputed layer, which counts them for every layer: an overestimate)."""
        full = self.layer_act_bytes(chunk)
        kept = (layers - recompute) * full + recompute * self.layer_ckpt_bytes(chunk, seq_lengths)
        block = self.ckpt_block_bytes_token * chunk.tokens if recompute else 0.0
        return kept + block + (self.head_bytes_token * chunk.tokens if last else 0.0)

    def attention_backward_bytes(self, chunk: Chunk) -> float:
        """The most one layer's attention backward holds at once: its segments run backward
        one after another, each with its own keys (prefix included)."""
        return max(self.attn_bwd_bytes_pair * s.length * (s.prefix + s.length) + self.attn_bwd_bytes_key * (s.prefix + s.length)
                   + self.attn_bwd_bytes_query * s.length for s in chunk.segments)

    def backward_transient_bytes(self, chunk: Chunk, seq_lengths: Sequence[int], layers: int, recompute: int,
                                 last: bool) -> float:
        """Bytes above what the chunk keeps (`activation_bytes`) at the peak of its backward on
        a stage. The output layer's bytes go first; then layer by layer from the top, a layer
        (re-saved over its kept input and cached K/V if recomputed) releases its post-attention
        bytes and runs its attention backward, while the layers above it are released and a
        last slice has handed its prefix's dK/dV down for each of them."""
        full = self.layer_act_bytes(chunk)
        kept = self.layer_ckpt_bytes(chunk, seq_lengths)
        shared = (self.ckpt_bytes_token - self.ckpt_unshared_bytes_token) * chunk.tokens
        attention = max(0.0, self.attention_backward_bytes(chunk) - self.attn_freed_bytes_token * chunk.tokens)
        # A middle slice adds to dK/dV buffers its later slices made; a last one makes new ones.
        handed = self.kv_bytes_token * sum(s.prefix for s in chunk.segments if s.start + s.length >= seq_lengths[s.seq])
        retained = self.activation_bytes(chunk, seq_lengths, layers, recompute, last)
        below, peak = retained - (self.head_bytes_token * chunk.tokens if last else 0.0), 0.0
        for layer in reversed(range(layers)):
            recomputed = layer < recompute
            below -= kept if recomputed else full
            own = kept + full - shared if recomputed else full
            peak = max(peak, below + own + attention + handed * (layers - 1 - layer))
        return max(0.0, peak - retained)

    def handed_grad_bytes(self, prefix: int, layers: int) -> float:
        """dK/dV a slice hands down for its `prefix` tokens, on every layer of a stage."""
        return self.kv_bytes_token * prefix * layers

    def model_state_bytes(self, layers: int, first: bool, last: bool) -> float:
        params = layers * self.layer_params
        params += self.embedding_params if first else 0
        params += self.head_params if last else 0
        return params * self.state_bytes_param

    # --- persistence --------------------------------------------------------------------
    def to_json(self, path: str | Path, **extra) -> None:
        Path(path).write_text(json.dumps({"cost_model": dataclasses.asdict(self), **extra}, indent=2))

    @classmethod
    def from_json(cls, path: str | Path) -> "CostModel":
        return cls(**json.loads(Path(path).read_text())["cost_model"])


def scale_weights(knots: Sequence[int], tokens: int) -> list[float]:
    """The weight of each knot's factor at `tokens`: piecewise linear in log(tokens) (a hat
    function per knot), all on the nearest knot outside their range; the weights sum to 1."""
    weights = [0.0] * len(knots)
    i = bisect.bisect_right(knots, tokens)
    if i == 0 or i == len(knots):
        weights[max(i - 1, 0)] = 1.0
        return weights
    right = math.log(tokens / knots[i - 1]) / math.log(knots[i] / knots[i - 1])
    weights[i - 1], weights[i] = 1.0 - right, right
    return weights


def stage_layers(num_layers: int, pp: int) -> tuple[int, ...]:
    if pp < 1 or num_layers % pp:
        raise ValueError(f"dpp: {num_layers} layers do not split evenly over pp={pp} stages")
    return (num_layers // pp,) * pp


def analytic_gpu(
    shape: ModelShape,
    peak_flops: float = 312e12,
    mfu: float = 0.55,
    t0: float = 1024.0,
    gamma: float = 50e-6,
    p2p_bytes_s: float = 25e9,
    zero_shards: int = 8,
) -> CostModel:
    """An A800/A100-80GB-like stage: bf16 at `mfu` of `peak_flops` for large chunks, half of it
    at `t0` tokens; flash attention (no score memory); activations per Korthikanti et al.
    (34 h bytes per token per layer, 2 h when recomputed); bf16 weights, fp32 grads, and fp32
    Adam state sharded over `zero_shards` data-parallel ranks (ZeRO-1)."""
    h, kv_dim = shape.hidden, shape.head_dim * shape.kv_heads
    flops_s = peak_flops * mfu
    return CostModel(
        alpha=2.0 * shape.layer_params / flops_s,
        beta=4.0 * h / flops_s,
        gamma=gamma,
        bwd_ratio=2.0,
        t0=t0,
        head_s_token=2.0 * h * shape.vocab / flops_s,
        p2p_s_token=2.0 * h / p2p_bytes_s,
        p2p_latency_s=20e-6,
        act_bytes_token=34.0 * h,
        act_bytes_attn=0.0,
        act_bytes_key=2.0 * 2.0 * kv_dim,
        ckpt_bytes_token=2.0 * h,
        kv_bytes_token=2.0 * 2.0 * kv_dim,
        head_bytes_token=2.0 * shape.vocab,  # bf16 logits, loss computed in place
        state_bytes_param=2.0 + 4.0 + 12.0 / zero_shards,
        layer_params=shape.layer_params,
        embedding_params=shape.embedding_params,
        head_params=shape.embedding_params,
        num_layers=shape.num_layers,
    )
