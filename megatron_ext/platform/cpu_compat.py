"""Megatron-Core 0.16 on CPU: the CUDA assumptions it makes, mapped to CPU.

Megatron-Core writes `torch.cuda.current_device()`, `device="cuda"`, CUDA streams/events and the
CUDA RNG into code that is otherwise device-agnostic. On a machine without CUDA those calls can
only raise, so redirecting them to the CPU changes nothing that worked: the CPU fixes apply only
when `torch.cuda.is_available()` is False. The others are plain bugs of megatron-core (without
Transformer Engine/Apex, in its optimizers' checkpoints, in multi-latent attention under tensor
parallelism) and apply on every device (`cpu_only=False`).

Each fix is a named entry of `FIXES` with the upstream diff that would make it unnecessary
(`patches/NNNN-<name>.diff`, checked against megatron-core 0.16.1 by scripts/check_patches.py). The mechanism of most fixes
is the same: megatron modules that touch CUDA get a module-local `torch` (`TorchOnCPU`) whose
`cuda` namespace and tensor factories resolve to the CPU; the real `torch` module is untouched.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import threading
import types
import warnings
from dataclasses import dataclass
from typing import Callable

import torch

from megatron_ext.platform.adam_initial_state import materialise_initial_adam_state
from megatron_ext.platform.distributed_optimizer_mixed_groups import fix_distributed_optimizer_mixed_groups
from megatron_ext.platform.float16_optimizer_checkpoint import fix_float16_optimizer_checkpoint
from megatron_ext.platform.mla_latent_norm_grads import fix_mla_latent_norm_grads
from megatron_ext.platform.mla_rotary_key_grad import fix_mla_rotary_key_grad

CPU = torch.device("cpu")


def _is_cuda_device(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int)  # a bare int is a CUDA ordinal in torch's factories


def _on_cpu(fn: Callable) -> Callable:
    """A tensor factory whose `device="cuda"` means the CPU and whose pinning is dropped."""

    @functools.wraps(fn)
    def factory(*args, **kwargs):
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = CPU
        kwargs.pop("pin_memory", None)
        return fn(*args, **kwargs)

    return factory


class _NullStream:
    """Stands in for torch.cuda.Stream/Event: CPU work is already ordered."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def wait_stream(self, *args) -> None:
        pass

    def wait_event(self, *args) -> None:
        pass

    def record_event(self, *args):
        return _NullStream()

    def record(self, *args) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other) -> float:
        return 0.0


def _make_cuda_on_cpu() -> types.SimpleNamespace:
    """The parts of `torch.cuda` megatron-core calls, answered for the CPU."""
    return types.SimpleNamespace(
        is_available=torch.cuda.is_available,
        device_count=lambda: 0,
        current_device=lambda: CPU,
        synchronize=lambda *a, **k: None,
        empty_cache=lambda: None,
        memory_allocated=lambda *a, **k: 0,
        max_memory_allocated=lambda *a, **k: 0,
        reset_peak_memory_stats=lambda *a, **k: None,
        Stream=_NullStream,
        Event=_NullStream,
        stream=lambda s=None: contextlib.nullcontext(),
        current_stream=lambda *a, **k: _NullStream(),
        default_stream=lambda *a, **k: _NullStream(),
        get_rng_state=lambda *a, **k: torch.get_rng_state(),
        set_rng_state=lambda state, *a, **k: torch.set_rng_state(state),
        manual_seed=torch.manual_seed,
        manual_seed_all=torch.manual_seed,
        FloatTensor=torch.FloatTensor,
        HalfTensor=torch.HalfTensor,
        BFloat16Tensor=torch.BFloat16Tensor,
        nvtx=types.SimpleNamespace(
            range_push=lambda *a, **k: None,
            range_pop=lambda *a, **k: None,
            range=lambda *a, **k: contextlib.nullcontext(),
        ),
        amp=torch.amp,
    )


_FACTORIES = (
    "empty",
    "zeros",
    "ones",
    "full",
    "tensor",
    "arange",
    "rand",
    "randn",
    "randint",
    "empty_like",
    "zeros_like",
    "ones_like",
    "full_like",
    "as_tensor",
)


class TorchOnCPU(types.ModuleType):
    """A module-local `torch` for megatron modules: everything is the real torch, except that
    `torch.cuda.*` and `device="cuda"` in tensor factories mean the CPU."""

    def __init__(self) -> None:
        super().__init__("torch")
        self.cuda = _make_cuda_on_cpu()
        for name in _FACTORIES:
            setattr(self, name, _on_cpu(getattr(torch, name)))

    def __getattr__(self, name: str):
        return getattr(torch, name)


TORCH_ON_CPU = TorchOnCPU()


def _redirect_torch(*module_names: str) -> None:
    for name in module_names:
        module = importlib.import_module(name)
        if module.__dict__.get("torch") is torch:
            module.torch = TORCH_ON_CPU


# --- the fixes -------------------------------------------------------------------------------


def _fix_device_literals() -> None:
    """`torch.cuda.current_device()`, `device="cuda"`, streams, events and synchronize in the
    modules a GPT/MoE training step goes through (buffers, DDP, attention, RoPE and its CP index, router, MoE
    dispatch, optimizer, grad clipping, rerun machine, checkpoint exchange)."""
    _redirect_torch(
        "megatron.core.utils",
        "megatron.core.rerun_state_machine",
        "megatron.core.tensor_parallel.layers",
        "megatron.core.tensor_parallel.mappings",
        "megatron.core.tensor_parallel.data",
        "megatron.core.tensor_parallel.utils",
        "megatron.core.models.common.embeddings.rotary_pos_embedding",
        "megatron.core.models.common.embeddings.rope_utils",
        "megatron.core.models.common.embeddings.yarn_rotary_pos_embedding",
        "megatron.core.models.gpt.gpt_model",
        "megatron.core.transformer.dot_product_attention",
        "megatron.core.transformer.attention",
        "megatron.core.transformer.transformer_layer",
        "megatron.core.transformer.utils",
        "megatron.core.transformer.multi_token_prediction",
        "megatron.core.transformer.moe.router",
        "megatron.core.transformer.moe.moe_utils",
        "megatron.core.transformer.moe.experts",
        "megatron.core.transformer.moe.token_dispatcher",
        "megatron.core.distributed.param_and_grad_buffer",
        "megatron.core.distributed.distributed_data_parallel",
        "megatron.core.optimizer.optimizer",
        "megatron.core.optimizer.distrib_optimizer",
        "megatron.core.optimizer.clip_grads",
        "megatron.core.optimizer.grad_scaler",
    )


def _fix_dist_checkpointing() -> None:
    """dist_checkpointing's torch_dist save/load synchronizes CUDA before writing and stages
    tensors through CUDA in the exchange of fully-parallel load."""
    _redirect_torch(
        "megatron.core.dist_checkpointing.exchange_utils",
        "megatron.core.dist_checkpointing.tensor_aware_state_dict",
        "megatron.core.dist_checkpointing.strategies.async_utils",
        "megatron.core.dist_checkpointing.strategies.filesystem_async",
        "megatron.core.dist_checkpointing.strategies.fully_parallel",
        "megatron.core.dist_checkpointing.strategies.state_dict_saver",
        "megatron.core.dist_checkpointing.strategies.torch",
    )


def _fix_pipeline_schedules() -> None:
    """`device="cuda"` token counters in the schedules and CUDA receive buffers + synchronize in
    the point-to-point layer."""
    _redirect_torch(
        "megatron.core.pipeline_parallel.schedules",
        "megatron.core.pipeline_parallel.p2p_communication",
    )


def _fix_rng_tracker() -> None:
    """The CUDA RNG tracker forks/gets/sets the CUDA generator; on CPU the CPU generator plays
    its part (model-parallel seeds, dropout in TP regions, expert-parallel RNG)."""
    random = importlib.import_module("megatron.core.tensor_parallel.random")
    random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    random._set_cuda_rng_state = lambda new_state, *a, **k: torch.set_rng_state(new_state)
    random._lazy_call = lambda fn, **kwargs: fn()
    random.torch = TORCH_ON_CPU
    # fork() warns when the CPU generator moved inside a forked region, to catch CPU draws in
    # GPU code; on the CPU the forked generator *is* the CPU one, so every draw would warn.
    logging.getLogger(random.__name__).addFilter(_drop_cpu_rng_warning)


def _drop_cpu_rng_warning(record: logging.LogRecord) -> bool:
    return record.getMessage() != "CPU RNG state changed within GPU RNG context"


_REAL_TENSOR_TYPE = torch.Tensor.type


class _CudaTypeNames(threading.local):
    """How deep this thread is in megatron code that should read CUDA type names."""

    depth = 0


class _OpenScopes:
    """The scopes open in all threads (`Tensor.type` is torch's own while there are none)."""

    lock = threading.Lock()
    count = 0


_CUDA_TYPE_NAMES = _CudaTypeNames()


def _tensor_type_with_cuda_names(self, *args, **kwargs):
    name = _REAL_TENSOR_TYPE(self, *args, **kwargs)
    if _CUDA_TYPE_NAMES.depth and not args and not kwargs and isinstance(name, str) and self.device.type == "cpu":
        return name.replace("torch.", "torch.cuda.", 1)
    return name


@contextlib.contextmanager
def _cpu_tensors_report_cuda_types():
    """Inside megatron's optimizer set-up and grad clipping, `param.type()` of a CPU tensor
    reads as its CUDA twin: the optimizers sort params by comparing against
    'torch.cuda.FloatTensor' etc. Only in the calling thread: a reshard builds an optimizer in
    a background thread while the training thread clips its grads, and one thread's scope must
    neither end the other's nor rename the other's tensors. `Tensor.type` is torch's own while no
    scope is open."""
    with _OpenScopes.lock:
        _OpenScopes.count += 1
        torch.Tensor.type = _tensor_type_with_cuda_names
    _CUDA_TYPE_NAMES.depth += 1
    try:
        yield
    finally:
        _CUDA_TYPE_NAMES.depth -= 1
        with _OpenScopes.lock:
            _OpenScopes.count -= 1
            if not _OpenScopes.count:
                torch.Tensor.type = _REAL_TENSOR_TYPE


def _with_cuda_type_names(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with _cpu_tensors_report_cuda_types():
            return fn(*args, **kwargs)

    wrapped.__wrapped_for_cpu__ = True
    return wrapped


def _fix_optimizer_type_checks() -> None:
    """`Tensor.type() == 'torch.cuda.FloatTensor'` in Float16/Distributed optimizers and
    grad clipping."""
    optimizer = importlib.import_module("megatron.core.optimizer.optimizer")
    distrib = importlib.import_module("megatron.core.optimizer.distrib_optimizer")
    clip = importlib.import_module("megatron.core.optimizer.clip_grads")
    for owner, attr in (
        (optimizer.Float16OptimizerWithFloat16Params, "__init__"),
        (distrib.DistributedOptimizer, "__init__"),
        (distrib.DistributedOptimizer, "_build_model_and_main_param_groups"),
        (clip, "clip_grad_by_total_norm_fp32"),
    ):
        fn = owner.__dict__[attr]
        raw = fn.__func__ if isinstance(fn, (staticmethod, classmethod)) else fn
        if getattr(raw, "__wrapped_for_cpu__", False):
            continue
        wrapped = _with_cuda_type_names(raw)
        if isinstance(fn, staticmethod):
            wrapped = staticmethod(wrapped)
        elif isinstance(fn, classmethod):
            wrapped = classmethod(wrapped)
        setattr(owner, attr, wrapped)
    # Callers bound the function by name at import time.
    for module in (optimizer, distrib):
        if hasattr(module, "clip_grad_by_total_norm_fp32"):
            module.clip_grad_by_total_norm_fp32 = clip.clip_grad_by_total_norm_fp32


def _fix_tensor_cuda_method() -> None:
    """`tensor.cuda()` (tied-embedding set-up under PP, optimizer state loading, batch
    broadcast): on a machine without CUDA the only tensors are CPU tensors, so `.cuda()` keeps
    them where they are. The one global change: `Tensor.cuda` can only raise without CUDA."""
    if not getattr(torch.Tensor.cuda, "__cpu_identity__", False):

        def cuda(self, *args, **kwargs):
            return self

        cuda.__cpu_identity__ = True
        torch.Tensor.cuda = cuda


def _fix_te_general_gemm() -> None:
    """moe_utils reads `te_general_gemm` unconditionally but defines it only when Transformer
    Engine imports: without TE the MoE router GEMM raises NameError. Not CPU-specific."""
    moe_utils = importlib.import_module("megatron.core.transformer.moe.moe_utils")
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _fix_mla_without_te() -> None:
    """multi_latent_attention sets HAVE_TE when importing megatron's TE extension succeeds, which
    it always does (without TE the extension builds its classes on a MagicMock), so MLA's
    constructor calls `isinstance(..., TELinear)` with a mock and raises TypeError: the local
    MLA spec cannot be built without TE. Take the extension's own HAVE_TE. Not CPU-specific."""
    extension = importlib.import_module("megatron.core.extensions.transformer_engine")
    mla = importlib.import_module("megatron.core.transformer.multi_latent_attention")
    if not extension.HAVE_TE:
        mla.HAVE_TE = False


def _fix_torch_adam_checkpointing() -> None:
    """Without TE/Apex the distributed optimizer wraps torch's Adam, whose `step` lives in the
    per-parameter state, and its checkpoint paths trip over that. Not CPU-specific.

    - `state_dict()` of a fresh optimizer (the template of a resume) asserts on an empty step
      set, because torch creates Adam's state only in the first step. Materialise torch's own
      initial state (step 0, zero moments) first: the next step runs exactly as from empty.
    - Loading the per-parameter state copies every key of torch's state from the loaded
      tensors, but `step` is saved per param group and restored from there before: a "fully
      reshardable" checkpoint has no per-parameter `step` (KeyError), and a "dp_reshardable"
      one hands back the load template's own `step` (a non-persistent object: the fresh
      optimizer's 0), which would undo the restore. Copy every key but `step`.
    - That restore puts one `step` tensor object into every parameter's state, and torch's
      Adam increments each parameter's step in place, so a shared tensor would count once per
      parameter: give each parameter its own.
    - The main copy of an fp32 parameter is a view of that parameter, which requires grad, and
      the "dp_reshardable" loader (unlike its siblings) copies into it with autograd on:
      RuntimeError. Copy without autograd.
    """
    distrib = importlib.import_module("megatron.core.optimizer.distrib_optimizer")
    cls = distrib.DistributedOptimizer
    if distrib.HAVE_APEX_OR_TE or getattr(cls.state_dict, "__torch_adam_fix__", False):
        return
    original_state_dict = cls.state_dict
    original_load_state_dict = cls.load_state_dict
    original_set_states = cls._set_main_param_and_optimizer_states

    @functools.wraps(original_state_dict)
    def state_dict(self):
        if isinstance(self.optimizer, (torch.optim.Adam, torch.optim.AdamW)):
            materialise_initial_adam_state(self.optimizer)
        return original_state_dict(self)

    @functools.wraps(original_set_states)
    @torch.no_grad()
    def set_main_param_and_optimizer_states(self, model_param, tensors):
        if self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            return original_set_states(self, model_param, tensors)
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        destination = {"param": main_param, **self.optimizer.state[main_param]}
        for key, tensor in destination.items():
            if key != "step":  # restored from the param groups
                tensor.copy_(tensors[key])

    @functools.wraps(original_load_state_dict)
    def load_state_dict(self, state_dict):
        original_load_state_dict(self, state_dict)
        for state in self.optimizer.state.values():
            if "step" in state:
                state["step"] = state["step"].clone()

    state_dict.__torch_adam_fix__ = True
    cls.state_dict = state_dict
    cls.load_state_dict = load_state_dict
    cls._set_main_param_and_optimizer_states = set_main_param_and_optimizer_states


def _fix_alltoall_split_sizes() -> None:
    """The all-to-all token dispatcher copies its split sizes to the host as numpy arrays with
    `maybe_move_tensor_to_cpu(..., as_numpy=True)`, which converts only CUDA tensors: on the CPU
    they stay tensors, and torch's `all_to_all_single` refuses a tensor as split sizes. Its
    other CUDA uses (the device-to-host side stream, its event) are answered by
    `device_literals`."""
    moe_utils = importlib.import_module("megatron.core.transformer.moe.moe_utils")
    dispatcher = importlib.import_module("megatron.core.transformer.moe.token_dispatcher")
    original = moe_utils.maybe_move_tensor_to_cpu
    if getattr(original, "__cpu_numpy__", False):
        return

    @functools.wraps(original)
    def maybe_move_tensor_to_cpu(tensor, as_numpy: bool = False, record_stream: bool = False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    maybe_move_tensor_to_cpu.__cpu_numpy__ = True
    # The dispatcher bound the function by name at import time.
    moe_utils.maybe_move_tensor_to_cpu = dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


def _fix_uneven_tp_collectives() -> None:
    """The all-to-all dispatcher at TP > 1 gathers and reduce-scatters the routed tokens over
    the tensor-parallel ranks in unequal parts (`output_split_sizes` / `input_split_sizes`),
    with a list `all_gather` / `reduce_scatter` that NCCL runs unevenly but gloo refuses
    ("invalid tensor size"). On the CPU the gather pads each part to the largest and gathers
    evenly, and the reduce-scatter all-reduces the whole tensor and keeps this rank's part."""
    mappings = importlib.import_module("megatron.core.tensor_parallel.mappings")
    gather, reduce_scatter = mappings._gather_along_first_dim, mappings._reduce_scatter_along_first_dim
    if getattr(gather, "__uneven_on_cpu__", False):
        return

    @functools.wraps(gather)
    def gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1:
            return gather(input_, group, output_split_sizes, use_global_buffer)
        longest = max(output_split_sizes)
        padded = torch.nn.functional.pad(input_, (0, 0) * (input_.dim() - 1) + (0, longest - input_.shape[0]))
        parts = gather(padded.contiguous(), group).split(longest)
        return torch.cat([part[:size] for part, size in zip(parts, output_split_sizes)])

    @functools.wraps(reduce_scatter)
    def reduce_scatter_along_first_dim(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or group.size() == 1:
            return reduce_scatter(input_, group, input_split_sizes, use_global_buffer)
        summed = input_.clone()
        torch.distributed.all_reduce(summed, group=group)
        return summed.split(list(input_split_sizes))[group.rank()].contiguous()

    gather_along_first_dim.__uneven_on_cpu__ = True
    mappings._gather_along_first_dim = gather_along_first_dim
    mappings._reduce_scatter_along_first_dim = reduce_scatter_along_first_dim


def _fix_single_rank_collectives() -> None:
    """A reduce-scatter or all-gather over a group of one process changes nothing, yet gloo runs it
    through a temporary copy of the whole buffer. At DP = 1 DDP's gradient reduce-scatter and the
    distributed optimizer's parameter all-gather are such collectives on every step: for
    SmolLM2-135M (135M fp32 values) each took ~0.35 s and raised peak memory by 0.53 GB. Over one
    process the synchronous ones become what they mean: nothing where output and input are the
    same memory (megatron's in-place shards), else a copy."""
    buffers = importlib.import_module("megatron.core.distributed.param_and_grad_buffer")
    if getattr(buffers.dist_reduce_scatter_func, "__identity_on_one_rank__", False):
        return
    buffers.dist_reduce_scatter_func = _identity_on_one_rank(buffers.dist_reduce_scatter_func)
    buffers.dist_all_gather_func = _identity_on_one_rank(buffers.dist_all_gather_func)


# Reductions whose result over one process is its own input (not PREMUL_SUM, which scales it).
_IDENTITY_OPS = (torch.distributed.ReduceOp.SUM, torch.distributed.ReduceOp.AVG,
                 torch.distributed.ReduceOp.MAX, torch.distributed.ReduceOp.MIN)


def _identity_on_one_rank(collective: Callable) -> Callable:
    """`collective(output, input, ..., group=, async_op=)` (all_gather_into_tensor /
    reduce_scatter_tensor) as a copy when `group` has one process and the call is synchronous (an
    asynchronous one returns a handle its caller waits on later)."""

    @functools.wraps(collective)
    def run(output, input_, *args, group=None, async_op=False, **kwargs):
        op = kwargs.get("op", args[0] if args else torch.distributed.ReduceOp.SUM)
        if async_op or op not in _IDENTITY_OPS or torch.distributed.get_world_size(group) != 1:
            return collective(output, input_, *args, group=group, async_op=async_op, **kwargs)
        if output.data_ptr() != input_.data_ptr():
            output.copy_(input_.view_as(output))
        return None

    run.__identity_on_one_rank__ = True
    return run


@dataclass(frozen=True)
class Fix:
    name: str
    apply: Callable[[], None]
    # Needed on CPU only (False: a plain bug, fixed on every device).
    cpu_only: bool = True


FIXES: tuple[Fix, ...] = (
    Fix("device_literals", _fix_device_literals),
    Fix("pipeline_schedules", _fix_pipeline_schedules),
    Fix("dist_checkpointing", _fix_dist_checkpointing),
    Fix("tensor_cuda_method", _fix_tensor_cuda_method),
    Fix("rng_tracker", _fix_rng_tracker),
    Fix("optimizer_type_checks", _fix_optimizer_type_checks),
    Fix("te_general_gemm", _fix_te_general_gemm, cpu_only=False),
    Fix("torch_adam_checkpointing", _fix_torch_adam_checkpointing, cpu_only=False),
    Fix("float16_optimizer_checkpoint", fix_float16_optimizer_checkpoint, cpu_only=False),
    Fix("alltoall_split_sizes", _fix_alltoall_split_sizes),
    Fix("uneven_tp_collectives", _fix_uneven_tp_collectives),
    Fix("mla_without_te", _fix_mla_without_te, cpu_only=False),
    Fix("distributed_optimizer_mixed_groups", fix_distributed_optimizer_mixed_groups, cpu_only=False),
    Fix("mla_rotary_key_grad", fix_mla_rotary_key_grad, cpu_only=False),
    Fix("mla_latent_norm_grads", fix_mla_latent_norm_grads, cpu_only=False),
    Fix("single_rank_collectives", _fix_single_rank_collectives),
)

_applied: list[str] = []


def apply(on_cpu: bool | None = None) -> list[str]:
    """Apply the fixes this process needs (idempotent); returns the names applied so far.

    `on_cpu` defaults to "CUDA is not available"; passing True on a CUDA machine is refused,
    because the redirections would send megatron's CUDA tensors to the CPU.
    """
    if on_cpu is None:
        on_cpu = not torch.cuda.is_available()
    if on_cpu and torch.cuda.is_available():
        raise RuntimeError(
            "megatron_ext's CPU compatibility layer is for machines without CUDA; "
            "hide the GPUs (CUDA_VISIBLE_DEVICES='') to train on the CPU here"
        )
    if on_cpu:
        # Advice for CUDA's connection scheduling, printed by every TP layer; moot on the CPU.
        warnings.filterwarnings("ignore", message=r"When using async grad allreduce")
    for fix in FIXES:
        if fix.name in _applied or (fix.cpu_only and not on_cpu):
            continue
        fix.apply()
        _applied.append(fix.name)
    return list(_applied)


def applied() -> list[str]:
    return list(_applied)
