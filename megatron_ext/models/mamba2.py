"""A Mamba2 mixer in pure PyTorch with megatron-core's `MambaMixer` contract, for machines
without the `mamba_ssm` / `causal_conv1d` CUDA kernels.

Megatron-core 0.16's own mixer cannot even be imported there: `megatron.core.ssm.mamba_mixer`
imports `triton` at module level (through the inference tensor ops), and its constructor raises
without `mamba_ssm`. This mixer is built through the same ModuleSpec slot
(`MambaLayerSubmodules.mixer`), with the same constructor arguments, parameter names, shapes,
TP split and sharded-state-dict keys (`in_proj.weight.{z,x,B,C,dt}`, `conv1d.*.{x,B,C}`,
`A_log`, `dt_bias`, `D`, `norm.weight`, `out_proj.weight`), so a checkpoint trained with one
mixer loads into the other.

Per token: in_proj -> [z | x B C | dt]; a depthwise causal conv and SiLU over x B C; the
selective scan (`models.ssd`) with A = -exp(A_log), dt = softplus(dt + dt_bias) and a D skip;
a gated group RMSNorm (normalise y * silu(z) per group); out_proj. Under tensor parallelism each
rank holds whole groups of heads, so nothing but the two projections communicates.

Inference: with megatron's `StaticInferenceContext` the mixer keeps (conv state, SSM state) in
the context under its layer number, like megatron's mixer. The prefill is the full-sequence
path starting from zero states; each later token is one `ssd_step`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.nn.functional as F
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.utils import (
    ensure_metadata_has_dp_cp_group,
    make_sharded_tensors_for_checkpoint,
    sharded_state_dict_default,
)
from torch import nn

from megatron_ext.models.ssd import ssd_chunked, ssd_step

# Initial values of the state parameters (megatron's MambaMixer defaults): A uniform in
# [1, 16] (stored as log A), dt log-uniform in [0.001, 0.1] (stored as softplus^-1(dt)), and the
# depthwise conv like torch's default Conv1d (uniform within 1 / sqrt(kernel width)).
A_INIT_RANGE = (1.0, 16.0)
DT_RANGE = (0.001, 0.1)
DT_FLOOR = 1e-4
CONV_WIDTH = 4


@dataclass
class MixerSubmodules:
    """The two projections (megatron's `MambaMixerSubmodules`, which lives in a module that
    needs triton to import)."""

    in_proj: Union[ModuleSpec, type] = None
    out_proj: Union[ModuleSpec, type] = None


@dataclass(frozen=True)
class MambaShape:
    """Sizes of one mixer, global and per TP rank."""

    d_model: int
    heads: int
    head_dim: int
    groups: int
    d_state: int
    d_conv: int
    tp: int

    @property
    def d_inner(self) -> int:
        return self.heads * self.head_dim

    @property
    def local_heads(self) -> int:
        return self.heads // self.tp

    @property
    def local_groups(self) -> int:
        return self.groups // self.tp

    @property
    def local_d_inner(self) -> int:
        return self.local_heads * self.head_dim

    @property
    def local_bc(self) -> int:
        return self.local_groups * self.d_state

    @property
    def in_proj_parts(self) -> dict[str, int]:
        """The local rows of in_proj, in order (each part is its own TP-sharded tensor)."""
        return {
            "z": self.local_d_inner,
            "x": self.local_d_inner,
            "B": self.local_bc,
            "C": self.local_bc,
            "dt": self.local_heads,
        }

    @property
    def conv_parts(self) -> dict[str, int]:
        return {"x": self.local_d_inner, "B": self.local_bc, "C": self.local_bc}


def mamba_shape(config: TransformerConfig, d_model: int, tp: int, d_conv: int = CONV_WIDTH, expand: int = 2) -> MambaShape:
    """The mixer's sizes from megatron's config fields; a clear error for sizes that cannot be
    cut (megatron asserts the same rules)."""
    head_dim, groups = config.mamba_head_dim, config.mamba_num_groups
    heads = config.mamba_num_heads or expand * d_model // head_dim
    problems = []
    if heads % groups:
        problems.append(f"mamba heads ({heads}) must be divisible by mamba groups ({groups})")
    if groups % tp:
        problems.append(f"mamba groups ({groups}) must be divisible by tensor parallel size ({tp})")
    if problems:
        raise ValueError("; ".join(problems))
    return MambaShape(d_model, heads, head_dim, groups, config.mamba_state_dim, d_conv, tp)


class GatedGroupRMSNorm(nn.Module):
    """RMSNorm of y * silu(z), computed per group of channels (megatron's gated RMSNorm with
    norm_before_gate=False): each TP rank holds whole groups, so the statistics stay local."""

    def __init__(self, channels: int, groups: int, eps: float = 1e-5, dtype=torch.float32) -> None:
        super().__init__()
        self.groups = groups
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(channels, dtype=dtype))

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        gated = (y * F.silu(z)).float()
        grouped = gated.unflatten(-1, (self.groups, -1))
        normed = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed.flatten(-2) * self.weight).to(y.dtype)


def split_rows_factory(sharded: ShardedTensor, parts: dict[str, int]) -> ShardedTensorFactory:
    """Save a TP-sharded tensor whose local rows are the concatenation of several separately
    TP-sharded parts (e.g. in_proj = [z | x | B | C | dt] of this rank) as one logical tensor per
    part, `<key>.<part>`: what makes the checkpoint loadable under another TP size."""
    template = sharded.without_data()

    @torch.no_grad()
    def build(key, data, replica_id, flattened_range):
        whole = dataclasses.replace(
            template, key=key, data=data, dtype=data.dtype, replica_id=replica_id,
            flattened_range=flattened_range,
        )
        pieces, start = [], 0
        for name, rows in parts.items():
            for piece in whole.narrow(0, start, rows):
                piece.key = f"{key}.{name}"
                pieces.append(piece)
            start += rows
        return pieces

    @torch.no_grad()
    def merge(pieces):
        return torch.cat(pieces)

    return ShardedTensorFactory(sharded.key, sharded.data, build, merge, sharded.replica_id)




def initial_A_log(heads: int, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    return torch.empty(heads).uniform_(*A_INIT_RANGE, generator=generator).log()


def initial_dt_bias(heads: int, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    low, high = (math.log(v) for v in DT_RANGE)
    dt = torch.exp(torch.rand(heads, generator=generator) * (high - low) + low).clamp(min=DT_FLOOR)
    return dt + torch.log(-torch.expm1(-dt))  # softplus^-1(dt)


def initial_conv(shape: torch.Size, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    bound = 1.0 / math.sqrt(CONV_WIDTH)
    return torch.empty(shape).uniform_(-bound, bound, generator=generator)


def logical_init(key: str, shape: torch.Size, generator: torch.Generator, std: float) -> Optional[torch.Tensor]:
    """The initial value of a whole (logical) mixer tensor, by its checkpoint key, for
    `models.init`: in_proj parts are normal like other weights, conv and state parameters
    follow megatron's mixer. None for tensors that are not the mixer's or keep their
    constructed value (D, the norm weight)."""
    if ".mixer." not in key:
        return None
    leaf = key.rsplit(".mixer.", 1)[1]
    if leaf.startswith("in_proj.weight."):
        return torch.empty(shape).normal_(0.0, std, generator=generator)
    if leaf.startswith("conv1d."):
        return initial_conv(shape, generator)
    if leaf == "A_log":
        return initial_A_log(shape[0], generator)
    if leaf == "dt_bias":
        return initial_dt_bias(shape[0], generator)
    return None


MambaStates = tuple[torch.Tensor, torch.Tensor]  # (conv state [b, conv_dim, d_conv-1], ssm state)


class TorchMambaMixer(MegatronModule):
    """Mamba2 mixer: forward(hidden [s, b, h]) -> (out [s, b, h], bias or None)."""

    def __init__(
        self,
        config: TransformerConfig,
        submodules: MixerSubmodules,
        d_model: int,
        expand: int = 2,
        chunk_size: int = 64,
        layer_number: Optional[int] = None,
        pg_collection=None,
        pp_layer_offset: int = 0,
    ) -> None:
        super().__init__(config)
        if pg_collection is None:
            raise ValueError("TorchMambaMixer needs pg_collection (MambaLayer passes it)")
        self.tp_group = pg_collection.tp
        self.shape = s = mamba_shape(config, d_model, self.tp_group.size(), expand=expand)
        self.chunk_size = chunk_size
        self.layer_number = layer_number
        self.pp_layer_offset = pp_layer_offset
        dtype = config.params_dtype

        self.in_proj = build_module(
            submodules.in_proj,
            d_model,
            2 * s.d_inner + 2 * s.groups * s.d_state + s.heads,
            config=config,
            init_method=config.init_method,
            gather_output=False,
            bias=False,
            skip_bias_add=False,
            is_expert=False,
            tp_comm_buffer_name="fc1",
            tp_group=self.tp_group,
        )
        conv_dim = s.local_d_inner + 2 * s.local_bc
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, kernel_size=s.d_conv, groups=conv_dim, padding=s.d_conv - 1, dtype=dtype)
        with torch.no_grad():
            self.conv1d.weight.copy_(initial_conv(self.conv1d.weight.shape))
            self.conv1d.bias.copy_(initial_conv(self.conv1d.bias.shape))
        # The state parameters stay fp32 whatever the model's dtype (as in megatron).
        self.dt_bias = nn.Parameter(initial_dt_bias(s.local_heads))
        self.A_log = nn.Parameter(initial_A_log(s.local_heads))
        self.D = nn.Parameter(torch.ones(s.local_heads))
        self.norm = GatedGroupRMSNorm(s.local_d_inner, s.local_groups, dtype=dtype)
        for p in (self.conv1d.weight, self.conv1d.bias, self.dt_bias, self.A_log, self.D, self.norm.weight):
            p.tensor_model_parallel = True
            p.partition_dim = 0
        self.out_proj = build_module(
            submodules.out_proj,
            s.d_inner,
            d_model,
            config=config,
            init_method=config.output_layer_init_method,
            bias=False,
            input_is_parallel=True,
            skip_bias_add=True,
            is_expert=False,
            tp_comm_buffer_name="fc2",
            tp_group=self.tp_group,
        )

    # --- forward ---------------------------------------------------------------------------

    def forward(self, hidden_states, inference_context=None, *, inference_params=None, packed_seq_params=None):
        if packed_seq_params is not None:
            raise NotImplementedError("TorchMambaMixer: packed sequences are not supported")
        context = inference_context or inference_params
        cache = context is not None and not self.training
        states = self._cached_states(context, hidden_states.shape[1]) if cache else None
        zxbcdt, _ = self.in_proj(hidden_states)
        y, new_states = self.mix(zxbcdt, states)
        if cache:
            for old, new in zip(states, new_states):
                old.copy_(new)
        return self.out_proj(y)

    def mix(self, zxbcdt: torch.Tensor, states: Optional[MambaStates] = None) -> tuple[torch.Tensor, MambaStates]:
        """in_proj output [s, b, local in_proj rows] -> (out_proj input [s, b, local d_inner],
        states after the last token). `states`: the states before the first token (zero if None)."""
        s = self.shape
        length, batch, _ = zxbcdt.shape
        z, xbc, dt = torch.split(zxbcdt, [s.local_d_inner, s.local_d_inner + 2 * s.local_bc, s.local_heads], dim=-1)
        conv_state, ssm_state = states if states is not None else (None, None)
        xbc, conv_state = self._causal_conv(xbc.permute(1, 2, 0), conv_state)
        x, B, C = torch.split(xbc.transpose(1, 2), [s.local_d_inner, s.local_bc, s.local_bc], dim=-1)
        x = x.unflatten(-1, (s.local_heads, s.head_dim))
        B = B.unflatten(-1, (s.local_groups, s.d_state))
        C = C.unflatten(-1, (s.local_groups, s.d_state))
        dt = F.softplus(dt.transpose(0, 1).float() + self.dt_bias)
        A = -torch.exp(self.A_log.float())
        if length == 1 and ssm_state is not None:
            y, ssm_state = ssd_step(ssm_state, x[:, 0].float(), dt[:, 0], A, B[:, 0].float(), C[:, 0].float())
            y = y[:, None]
        else:
            y, ssm_state = ssd_chunked(x.float(), dt, A, B.float(), C.float(), self.chunk_size, ssm_state)
        y = (y + x * self.D[:, None]).to(zxbcdt.dtype)
        # Contiguous: torch's CPU matmul of a transposed view is not bitwise reproducible
        # between two weight tensors of equal values (observed), and an elastic slice of this
        # mixer must compute exactly what the exported smaller mixer computes.
        y = y.flatten(-2).transpose(0, 1).contiguous()  # [s, b, local d_inner]
        return self.norm(y, z), (conv_state, ssm_state)

    def _causal_conv(self, xbc: torch.Tensor, conv_state: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Depthwise causal conv + SiLU over [b, channels, s]; the last d_conv-1 inputs are the
        next call's state (zeros before the first token)."""
        keep = self.shape.d_conv - 1
        if conv_state is None:
            conv_state = xbc.new_zeros(*xbc.shape[:2], keep)
        window = torch.cat([conv_state, xbc], dim=-1)
        out = F.conv1d(window, self.conv1d.weight, self.conv1d.bias, groups=xbc.shape[1])
        return F.silu(out), window[..., window.shape[-1] - keep :]

    def _cached_states(self, context, batch: int) -> MambaStates:
        """This layer's states in megatron's inference context, zeroed at a new prefill."""
        memory = context.key_value_memory_dict
        cached = memory.get(self.layer_number)
        if cached is None or context.sequence_len_offset == 0 or cached[0].shape[0] != batch:
            s = self.shape
            weight = self.conv1d.weight
            cached = (
                weight.new_zeros(batch, weight.shape[0], s.d_conv - 1),
                torch.zeros(batch, s.local_heads, s.head_dim, s.d_state, device=weight.device),
            )
            memory[self.layer_number] = cached
        return cached

    # --- checkpoints -----------------------------------------------------------------------

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        """megatron's MambaMixer layout: every tensor TP-sharded on dim 0, in_proj and conv1d
        split into their parts."""
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        groups = dict(tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"])
        own = {name: p for name, p in self.named_parameters(recurse=False)}
        state = make_sharded_tensors_for_checkpoint(own, prefix, {k: 0 for k in own}, sharded_offsets, **groups)
        for name in ("conv1d", "norm"):
            tensors = getattr(self, name).state_dict(prefix="", keep_vars=True)
            state.update(
                make_sharded_tensors_for_checkpoint(tensors, f"{prefix}{name}.", {k: 0 for k in tensors}, sharded_offsets, **groups)
            )
        for name in ("in_proj", "out_proj"):
            state.update(
                sharded_state_dict_default(getattr(self, name), f"{prefix}{name}.", sharded_offsets, metadata, tp_group=self.tp_group)
            )
        state[f"{prefix}in_proj.weight"] = split_rows_factory(state[f"{prefix}in_proj.weight"], self.shape.in_proj_parts)
        for key in ("conv1d.weight", "conv1d.bias"):
            state[f"{prefix}{key}"] = split_rows_factory(state[f"{prefix}{key}"], self.shape.conv_parts)
        return state
