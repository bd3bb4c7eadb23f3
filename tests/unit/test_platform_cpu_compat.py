"""megatron_ext.platform.cpu_compat: every runtime fix, checked three ways.

Each fix has a scenario, a plain function that asserts its own right answer. It runs
  - on unpatched megatron-core in a fresh process: it must raise, at the line the fix is about;
  - here, after `cpu_compat.apply()`: it must pass;
  - on a copy of megatron-core with patches/*.diff applied and no runtime layer, in a fresh
    process: it must pass too (the upstream diffs make the runtime fix unnecessary).
`apply()` patches megatron for the life of a process, hence the fresh processes; they import this
file and call `report()`.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import traceback
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import pytest
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.dist_checkpointing import ShardedTensor
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import OptimizerConfig, clip_grads, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.module import Float16Module
from megatron.core.utils import GlobalMemoryBuffer, check_param_hashes_across_dp_replicas

from megatron_ext.platform import cpu_compat

REPO = Path(__file__).resolve().parents[2]
VOCAB, SEQ, MBS, SEED = 32, 8, 2, 123
REAL_CURRENT_DEVICE = torch.cuda.current_device  # apply() must never replace it


# --- a tiny GPT ------------------------------------------------------------------------------


def tiny_gpt(seed: int = 0, **config) -> GPTModel:
    config = TransformerConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        use_cpu_initialization=True,
        pipeline_dtype=torch.float32,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        **config,
    )
    torch.manual_seed(seed)
    spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts)
    return GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=SEQ)


def batch(i: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (MBS, SEQ), generator=torch.Generator().manual_seed(i))


def lm_loss(model, tokens: torch.Tensor) -> torch.Tensor:
    return model(tokens, torch.arange(SEQ).expand(MBS, SEQ), None, labels=tokens).mean()


def megatron_adam(model: GPTModel, distributed: bool = True):
    """Megatron DDP around `model` and the optimizer `get_megatron_optimizer` builds for it
    (without Apex/TE: torch's AdamW)."""
    bf16 = model.config.bf16
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=distributed, grad_reduce_in_fp32=True
    )
    # As Megatron training does: a 16-bit model gets fp32 inputs cast on the way in.
    module = Float16Module(model.config, model) if bf16 else model
    ddp = DistributedDataParallel(model.config, ddp_config, module)
    config = OptimizerConfig(
        optimizer="adam",
        lr=1e-2,
        weight_decay=0.1,
        bf16=bf16,
        use_distributed_optimizer=distributed,
    )
    # {}: one parameter group (no weight-decay exemptions), like a plain torch optimizer.
    return ddp, config, get_megatron_optimizer(config, [ddp], config_overrides={})


def train_step(ddp, optimizer, tokens: torch.Tensor):
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    lm_loss(ddp, tokens).backward()
    ddp.finish_grad_sync()
    assert optimizer.step()[0]  # the update succeeded


# --- one scenario per fix --------------------------------------------------------------------


def scenario_device_literals():
    """GlobalMemoryBuffer allocates on `torch.cuda.current_device()`."""
    buffer = GlobalMemoryBuffer().get_tensor((2, 3), torch.float32, "x")
    assert buffer.shape == (2, 3) and buffer.device.type == "cpu"


def scenario_pipeline_schedules():
    """Megatron's schedule (no pipelining at PP=1, its token counter is a "cuda" tensor) gives
    the loss and the gradients of plain autograd."""
    model = tiny_gpt()
    batches = [batch(i) for i in range(2)]

    def forward_step(data_iterator, model):
        tokens = next(data_iterator)
        losses = model(tokens, torch.arange(SEQ).expand(MBS, SEQ), None, labels=tokens)
        return losses, lambda out: (out.mean(), {"loss": out.mean().detach()})

    stats = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(batches),
        model=[model],
        num_microbatches=len(batches),
        seq_length=SEQ,
        micro_batch_size=MBS,
    )
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    reference = sum(lm_loss(model, tokens) for tokens in batches) / len(batches)
    reference.backward()
    assert torch.allclose(torch.stack([s["loss"] for s in stats]).mean(), reference, atol=1e-6)
    for name, p in model.named_parameters():
        assert torch.allclose(grads[name], p.grad, atol=1e-6), name


def scenario_dist_checkpointing():
    """A ShardedTensor saved with torch_dist loads back equal."""
    saved = torch.arange(12.0).view(3, 4)
    with tempfile.TemporaryDirectory() as ckpt:
        dist_checkpointing.save({"w": ShardedTensor.from_rank_offsets("w", saved)}, ckpt)
        empty = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(3, 4))}
        assert torch.equal(dist_checkpointing.load(empty, ckpt)["w"], saved)


def scenario_tensor_cuda_method():
    """Megatron moves tensors with `.cuda()`, e.g. the parameter hashes it compares across
    data-parallel replicas (one replica here: they match)."""
    assert check_param_hashes_across_dp_replicas([torch.nn.Linear(2, 2)], cross_check=True)


def scenario_rng_tracker():
    """The tracker's streams are the seeded generators Megatron's offsets say (default: seed,
    tensor-parallel: seed + 2718 + tp_rank), and fork returns to where each stream was."""
    tensor_parallel.model_parallel_cuda_manual_seed(SEED)
    tracker = tensor_parallel.get_cuda_rng_tracker()
    default = torch.Generator().manual_seed(SEED)
    tensor_parallel_stream = torch.Generator().manual_seed(SEED + 2718)
    for _ in range(2):
        assert torch.equal(torch.rand(4), torch.rand(4, generator=default))
        with tracker.fork():
            assert torch.equal(torch.rand(4), torch.rand(4, generator=tensor_parallel_stream))


def scenario_optimizer_type_checks():
    """Megatron's clip by total norm (its grads must be 'torch.cuda.FloatTensor') scales the
    grads as torch.nn.utils.clip_grad_norm_ does."""
    generator = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(3, 4, generator=generator)) for _ in range(2)]
    for p in params:
        p.grad = 3 * torch.randn(p.shape, generator=generator)
    reference = [p.detach().clone().requires_grad_() for p in params]
    for r, p in zip(reference, params):
        r.grad = p.grad.clone()
    total_norm = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in params])).item()
    clip_grads.clip_grad_by_total_norm_fp32(params, max_norm=1.0, total_norm=total_norm)
    torch.nn.utils.clip_grad_norm_(reference, max_norm=1.0)
    for r, p in zip(reference, params):
        assert torch.allclose(r.grad, p.grad, atol=1e-7)


def scenario_te_general_gemm():
    """The MoE router's GEMM (without Transformer Engine: torch.mm) and its backward."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(5, 8, generator=generator, requires_grad=True)
    w = torch.randn(4, 8, generator=generator, requires_grad=True)
    logits = moe_utils.router_gating_linear(x, w, None, torch.float32)
    logits.sum().backward()
    assert torch.allclose(logits, x @ w.t())
    assert torch.allclose(x.grad, torch.ones(5, 4) @ w)
    assert torch.allclose(w.grad, torch.ones(4, 5) @ x)


def scenario_mla_without_te():
    """A GPT with megatron's local multi-latent-attention spec (core attention: megatron_ext's
    local one, which takes MLA's head sizes) builds without Transformer Engine and runs."""
    from megatron.core.transformer import MLATransformerConfig

    from megatron_ext.models.mla import MLACoreAttention

    config = MLATransformerConfig(
        num_layers=1, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
        pipeline_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0,
        q_lora_rank=16, kv_lora_rank=8, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=8, rope_type="rope",
    )
    spec = get_gpt_layer_local_spec(multi_latent_attention=True)
    spec.submodules.self_attention.submodules.core_attention = MLACoreAttention
    model = GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=SEQ, position_embedding_type="rope")
    assert torch.isfinite(lm_loss(model, batch(0)))


def adam_checkpoint(ddp, optimizer, is_loading: bool = False, sharding: str = "fully_reshardable") -> dict:
    """Model and distributed-optimizer state as megatron_ext checkpoints them (sharding
    "fully_reshardable"), or as Megatron-LM does by default ("dp_reshardable")."""
    model = ddp.module.sharded_state_dict()
    metadata = {"distrib_optim_sharding_type": sharding}
    optimizer_state = optimizer.sharded_state_dict(model, is_loading, metadata=metadata)
    return {"model": model, "optimizer": optimizer_state}


def scenario_torch_adam_checkpointing():
    """Resuming the distributed optimizer over torch's AdamW from a checkpoint into a fresh one
    (whose state dict is the load template) continues exactly: the next step equals that of
    the optimizer that was saved. In megatron_ext's format and in Megatron-LM's default one."""
    for sharding in ("fully_reshardable", "dp_reshardable"):
        (ddp, _, saved), (resumed_ddp, _, resumed) = [megatron_adam(tiny_gpt(s)) for s in (0, 1)]
        train_step(ddp, saved, batch(0))
        with tempfile.TemporaryDirectory() as ckpt:
            dist_checkpointing.save(adam_checkpoint(ddp, saved, sharding=sharding), ckpt)
            template = adam_checkpoint(resumed_ddp, resumed, is_loading=True, sharding=sharding)
            loaded = dist_checkpointing.load(template, ckpt)
        resumed_ddp.module.load_state_dict(loaded["model"])
        resumed.load_state_dict(loaded["optimizer"])
        train_step(ddp, saved, batch(1))
        train_step(resumed_ddp, resumed, batch(1))
        for p, q in zip(ddp.parameters(), resumed_ddp.parameters()):
            assert torch.equal(p, q), sharding


def tempered_step(ddp, optimizer, tokens: torch.Tensor):
    """`train_step` with the loss times the model's fp32 `temperature`."""
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    (lm_loss(ddp, tokens) * ddp.module.module.temperature).sum().backward()
    ddp.finish_grad_sync()
    assert optimizer.step()[0]


def scenario_float16_optimizer_checkpoint():
    """A bf16 model with an fp32 parameter among its bf16 ones (megatron_ext keeps its norms in
    fp32) under megatron's Float16 optimizer (no distributed optimizer), saved after a step
    and loaded into a fresh one: the next step equals that of the optimizer that was saved."""
    runs = []
    for seed in (0, 1):
        model = tiny_gpt(seed, bf16=True)
        module = Float16Module(model.config, model)  # casts the model to bf16
        model.register_parameter("temperature", torch.nn.Parameter(torch.ones(1)))  # stays fp32
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True)
        ddp = DistributedDataParallel(model.config, ddp_config, module)
        config = OptimizerConfig(optimizer="adam", lr=1e-2, bf16=True)
        runs.append((ddp, get_megatron_optimizer(config, [ddp], config_overrides={})))
    (ddp, saved), (resumed_ddp, resumed) = runs
    tempered_step(ddp, saved, batch(0))
    with tempfile.TemporaryDirectory() as ckpt:
        dist_checkpointing.save(adam_checkpoint(ddp, saved), ckpt)
        template = adam_checkpoint(resumed_ddp, resumed, is_loading=True)
        loaded = dist_checkpointing.load(template, ckpt)
    resumed_ddp.module.load_state_dict(loaded["model"])
    resumed.load_state_dict(loaded["optimizer"])
    tempered_step(ddp, saved, batch(1))
    tempered_step(resumed_ddp, resumed, batch(1))
    for p, q in zip(ddp.parameters(), resumed_ddp.parameters()):
        assert torch.equal(p, q)


def scenario_distributed_optimizer_mixed_groups():
    """A bf16 model under the distributed optimizer whose no-weight-decay group holds an fp32
    `temperature` beside the bf16 norms. Each parameter's place in the optimizer's groups, which
    checkpointing reads main params and Adam moments at, holds that parameter's own main copy."""
    model = tiny_gpt(0, bf16=True)
    module = Float16Module(model.config, model)
    # On the model's last module: DDP meets the bf16 parameters first, so their buffer (and
    # their places in the gradient-buffer order) come before the fp32 one's.
    model.output_layer.register_parameter("temperature", torch.nn.Parameter(torch.ones(1)))
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True)
    ddp = DistributedDataParallel(model.config, ddp_config, module)
    config = OptimizerConfig(optimizer="adam", lr=1e-2, bf16=True, use_distributed_optimizer=True)
    optimizer = get_megatron_optimizer(config, [ddp], config_overrides={}).chained_optimizers[0]
    for param in ddp.parameters():
        group, order = optimizer.model_param_group_index_map[param]
        held = optimizer.optimizer.param_groups[group]["params"][order]
        main = param if param.dtype == torch.float32 else param.main_param
        # One rank: a shard is the whole parameter (an fp32 one's view of it, or its main copy).
        assert held.data_ptr() == main.data_ptr() and held.numel() == main.numel(), "another param's place"


def scenario_alltoall_split_sizes():
    """The all-to-all dispatcher's split sizes, brought to the host as it does, serve as the
    split sizes of torch's all_to_all_single (one rank here: the tokens come back)."""
    splits = moe_utils.maybe_move_tensor_to_cpu(torch.tensor([3]), as_numpy=True)
    tokens = torch.arange(6.0).view(3, 2)
    received = torch.empty_like(tokens)
    dist.all_to_all_single(received, tokens, output_split_sizes=splits, input_split_sizes=splits)
    assert torch.equal(received, tokens)


def scenario_single_rank_collectives():
    """At DP = 1 DDP's gradient reduce-scatter and the distributed optimizer's parameter
    all-gather run no collective (gloo copies the whole buffer through a temporary for each):
    the gradients stay as the backward left them and the parameters as the step wrote them
    (test_megatron_adam_step_equals_torch_adamw checks the step against torch's AdamW)."""
    ddp, _, optimizer = megatron_adam(tiny_gpt())
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    lm_loss(ddp, batch(0)).backward()
    grads = [buffer.grad_data.clone() for buffer in ddp.buffers]
    with torch.profiler.profile() as profile:
        ddp.finish_grad_sync()
        assert all(torch.equal(b.grad_data, g) for b, g in zip(ddp.buffers, grads))
        before = [p.detach().clone() for p in ddp.parameters()]
        assert optimizer.step()[0]
    ran = sorted({e.name for e in profile.events() if "gather" in e.name or "scatter" in e.name})
    assert ran == [], f"collectives over one rank: {ran}"
    assert all(not torch.equal(p, b) for p, b in zip(ddp.parameters(), before))


@dataclass(frozen=True)
class Case:
    # None: the fix shows only with several ranks (checked in tests/distributed).
    scenario: Callable[[], None] | None
    # Where unpatched megatron-core raises: the file and the text of the line.
    raises_in: str
    raises_at: str
    # On CPU the scenario reaches that line only once the other fixes are in.
    after_other_fixes: bool = False


CASES = {
    "device_literals": Case(
        scenario_device_literals, "megatron/core/utils.py", "device=torch.cuda.current_device()"
    ),
    "pipeline_schedules": Case(
        scenario_pipeline_schedules,
        "megatron/core/pipeline_parallel/schedules.py",
        'device="cuda"',
    ),
    "dist_checkpointing": Case(
        scenario_dist_checkpointing,
        "megatron/core/dist_checkpointing/strategies/filesystem_async.py",
        "torch.cuda.synchronize()",
    ),
    "tensor_cuda_method": Case(
        scenario_tensor_cuda_method,
        "megatron/core/utils.py",
        "torch.stack(local_param_hashes).cuda()",
    ),
    "rng_tracker": Case(
        scenario_rng_tracker,
        "megatron/core/tensor_parallel/random.py",
        "torch.cuda.get_rng_state()",
    ),
    "optimizer_type_checks": Case(
        scenario_optimizer_type_checks,
        "megatron/core/optimizer/clip_grads.py",
        "param.grad.type() == 'torch.cuda.FloatTensor'",
    ),
    "te_general_gemm": Case(
        scenario_te_general_gemm,
        "megatron/core/transformer/moe/moe_utils.py",
        "if te_general_gemm is not None",
    ),
    "torch_adam_checkpointing": Case(
        scenario_torch_adam_checkpointing,
        "megatron/core/optimizer/distrib_optimizer.py",
        "assert len(steps) == 1",
        after_other_fixes=True,
    ),
    "float16_optimizer_checkpoint": Case(
        scenario_float16_optimizer_checkpoint,
        "megatron/core/dist_checkpointing/optimizer.py",
        "assert tuple(optim_param.shape) == model_param.local_shape",
        after_other_fixes=True,
    ),
    "alltoall_split_sizes": Case(
        scenario_alltoall_split_sizes,
        "tests/unit/test_platform_cpu_compat.py",
        "dist.all_to_all_single(received, tokens",
    ),
    # Needs two ranks (one rank bypasses the collectives): tests/distributed/test_platform_multirank.py.
    "uneven_tp_collectives": Case(None, "megatron/core/tensor_parallel/mappings.py", "all_gather"),
    # On unpatched megatron-core the rotary embedding's device literal is reached first.
    "mla_without_te": Case(
        scenario_mla_without_te,
        "megatron/core/transformer/multi_latent_attention.py",
        "and isinstance(self.linear_proj, TELinear)",
        after_other_fixes=True,
    ),
    "distributed_optimizer_mixed_groups": Case(
        scenario_distributed_optimizer_mixed_groups,
        "tests/unit/test_platform_cpu_compat.py",
        "another param's place",
        after_other_fixes=True,
    ),
    # Tensor parallelism (TP = 2 against TP = 1): tests/distributed/test_platform_multirank.py. No
    # error is raised: the gradients are wrong.
    "mla_rotary_key_grad": Case(
        None, "megatron/core/transformer/multi_latent_attention.py", "gather_from_tensor_model_parallel_region(kv"
    ),
    "mla_latent_norm_grads": Case(
        None, "megatron/core/distributed/finalize_model_grads.py", 'config.qk_layernorm and ("q_layernorm" in name'
    ),
    "single_rank_collectives": Case(
        scenario_single_rank_collectives,
        "tests/unit/test_platform_cpu_compat.py",
        'assert ran == [], f"collectives over one rank: {ran}"',
        after_other_fixes=True,
    ),
}


ONE_RANK_CASES = {name: case for name, case in CASES.items() if case.scenario is not None}


# --- fresh processes -------------------------------------------------------------------------


def init_world(store: str, seed_rng: bool = True) -> None:
    """A world of one gloo rank with megatron's parallel state (TP = PP = 1), and the
    model-parallel RNG seeded as training does before building a model (which unpatched
    megatron-core cannot do on CPU: the rng_tracker scenario shows that)."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    if seed_rng:
        tensor_parallel.model_parallel_cuda_manual_seed(SEED)


def raised_at(error: BaseException) -> dict:
    """The innermost frame in megatron-core or in this file: where a scenario failed."""
    frames = [
        f
        for f in traceback.extract_tb(error.__traceback__)
        if "megatron/core/" in f.filename or f.filename == __file__
    ]
    return {"file": frames[-1].filename, "line": frames[-1].line, "error": repr(error)[:300]}


def outcome(scenario) -> dict | None:
    try:
        scenario()
    except Exception as e:  # the outcome under test
        return raised_at(e)
    return None


def report(out: str, unpatched: bool) -> None:
    """Entry point of the fresh processes: run every scenario without the runtime layer (on
    unpatched megatron-core, those marked `after_other_fixes` with the other fixes applied);
    write the outcomes and where megatron-core came from as JSON to `out`."""
    import megatron.core

    init_world(out + ".store", seed_rng=not unpatched)
    outcomes = {"megatron_core": megatron.core.__file__}
    deferred = [n for n, case in CASES.items() if case.after_other_fixes and unpatched]
    for name, case in ONE_RANK_CASES.items():
        if name not in deferred:
            outcomes[name] = outcome(case.scenario)
    if deferred:
        for fix in cpu_compat.FIXES:
            if fix.name not in deferred:
                fix.apply()
        tensor_parallel.model_parallel_cuda_manual_seed(SEED)
        for name in deferred:
            outcomes[name] = outcome(CASES[name].scenario)
    Path(out).write_text(json.dumps(outcomes))


def start_report(out: Path, megatron_root: Path | None) -> tuple[subprocess.Popen, Path]:
    """`report()` in a fresh process, on the installed megatron-core or on the one under
    `megatron_root`."""
    path = [str(REPO), str(Path(__file__).parent)] + ([str(megatron_root)] if megatron_root else [])
    code = (
        f"import sys; sys.path[:0] = {path!r}; import {Path(__file__).stem} as t; "
        f"t.report({str(out)!r}, unpatched={megatron_root is None})"
    )
    with open(out.with_suffix(".log"), "w") as log:
        process = subprocess.Popen(
            [sys.executable, "-W", "ignore", "-c", code],
            env=dict(os.environ, OMP_NUM_THREADS="1"),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    return process, out


def finish_report(started: tuple[subprocess.Popen, Path]) -> dict:
    process, out = started
    assert process.wait(timeout=180) == 0, out.with_suffix(".log").read_text()[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> dict:
    """Outcomes of the scenarios on unpatched megatron-core and on megatron-core with
    patches/*.diff applied, both without the runtime layer (run side by side: they spend much
    of their time starting dist_checkpointing's writer processes)."""
    tmp = tmp_path_factory.mktemp("reports")
    unpatched = start_report(tmp / "unpatched.json", None)
    tree = tmp / "patched"
    built = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "check_patches.py"), "--keep", str(tree)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    patched = start_report(tmp / "patched.json", tree) if built.returncode == 0 else None
    outcomes = {"unpatched": finish_report(unpatched)}
    assert patched, built.stdout + built.stderr
    outcomes["patched"] = finish_report(patched)
    assert outcomes["patched"]["megatron_core"].startswith(str(tree))
    outcomes["check_patches"] = built.stdout
    return outcomes


# --- this process, with the runtime layer ----------------------------------------------------


@pytest.fixture(scope="module")
def applied(tmp_path_factory):
    names = cpu_compat.apply()
    init_world(str(tmp_path_factory.mktemp("world") / "store"))
    yield names
    # Other tests start their own worlds (some in forked children of this process).
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def test_every_patch_applies_compiles_and_imports(reports):
    """scripts/check_patches.py, as the reports fixture ran it to build the patched copy."""
    for patch in sorted((REPO / "patches").glob("*.diff")):
        assert f"OK     {patch.name}" in reports["check_patches"]
    assert re.search(r"OK     import of the \d+ patched modules", reports["check_patches"])


def test_every_fix_has_a_case():
    assert [fix.name for fix in cpu_compat.FIXES] == list(CASES)


@pytest.mark.parametrize("fix", list(ONE_RANK_CASES))
def test_fix_is_needed_and_works(fix, reports, applied):
    case = CASES[fix]
    failure = reports["unpatched"][fix]
    assert failure is not None, f"{case.scenario.__name__} passed on unpatched megatron-core"
    assert failure["file"].endswith(case.raises_in) and case.raises_at in failure["line"], failure
    case.scenario()  # with the runtime fix (raises on a wrong answer)
    assert reports["patched"][fix] is None, reports["patched"][fix]  # the upstream diffs suffice


def test_apply_names_every_fix_once_and_is_idempotent(applied):
    distrib = sys.modules["megatron.core.optimizer.distrib_optimizer"]
    wrapped_init = distrib.DistributedOptimizer.__init__
    assert wrapped_init.__wrapped_for_cpu__
    assert applied == [fix.name for fix in cpu_compat.FIXES]
    assert cpu_compat.apply() == applied == cpu_compat.applied()
    assert distrib.DistributedOptimizer.__init__ is wrapped_init  # not wrapped twice


def test_redirection_is_local_to_megatron_modules(applied):
    megatron_torch = sys.modules["megatron.core.utils"].torch
    assert megatron_torch is cpu_compat.TORCH_ON_CPU
    assert megatron_torch.cuda.current_device() == torch.device("cpu")
    assert torch.cuda.current_device is REAL_CURRENT_DEVICE
    with pytest.raises((AssertionError, RuntimeError)):  # no CUDA here, and torch still says so
        torch.cuda.current_device()
    tensor = torch.arange(3.0)
    assert tensor.cuda() is tensor  # the one global change: `.cuda()` could only raise here


def test_apply_refuses_cpu_mode_where_cuda_is_available(applied, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(RuntimeError, match="CUDA_VISIBLE_DEVICES"):
        cpu_compat.apply(on_cpu=True)


def test_with_cuda_only_the_plain_bug_fixes_apply(monkeypatch):
    """Which fixes apply() runs where CUDA is available (recorded, not run: this process has
    applied them all already)."""
    ran = []
    recorded = tuple(
        replace(fix, apply=lambda name=fix.name: ran.append(name)) for fix in cpu_compat.FIXES
    )
    monkeypatch.setattr(cpu_compat, "FIXES", recorded)
    monkeypatch.setattr(cpu_compat, "_applied", [])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert cpu_compat.apply() == ran == [
        "te_general_gemm", "torch_adam_checkpointing", "float16_optimizer_checkpoint", "mla_without_te",
        "distributed_optimizer_mixed_groups", "mla_rotary_key_grad", "mla_latent_norm_grads",
    ]
    assert cpu_compat.apply(on_cpu=False) == ran  # idempotent here too


def test_fork_does_not_warn_that_the_cpu_rng_changed(applied, caplog):
    with tensor_parallel.get_cuda_rng_tracker().fork():
        torch.rand(1)  # e.g. dropout in a tensor-parallel region
    assert "CPU RNG state changed" not in caplog.text


# --- whole training pieces, with the runtime layer -------------------------------------------


def adamw_reference(params, grads, config: OptimizerConfig) -> list[torch.Tensor]:
    reference = [p.detach().clone().float().requires_grad_() for p in params]
    for r, g in zip(reference, grads):
        r.grad = g.float()
    torch.nn.utils.clip_grad_norm_(reference, config.clip_grad)
    torch.optim.AdamW(
        reference,
        lr=config.lr,
        weight_decay=config.weight_decay,
        betas=(config.adam_beta1, config.adam_beta2),
        eps=config.adam_eps,
    ).step()
    return reference


def test_cuda_type_names_are_scoped_to_the_calling_thread():
    """A reshard builds an optimizer in a background thread while the training thread clips its
    grads: each thread reads CUDA type names inside its own scope only, and one scope ending
    does not end another's."""
    inside, outside_left, names = threading.Event(), threading.Event(), {}
    cpu = torch.zeros(1)

    def long_scope():
        with cpu_compat._cpu_tensors_report_cuda_types():
            names["first, before"] = cpu.type()
            inside.set()
            outside_left.wait()
            names["first, after the other scope ended"] = cpu.type()

    first = threading.Thread(target=long_scope)
    first.start()
    inside.wait()
    names["another thread, meanwhile"] = cpu.type()
    with cpu_compat._cpu_tensors_report_cuda_types():
        names["second scope"] = cpu.type()
    outside_left.set()
    first.join()
    assert names == {
        "first, before": "torch.cuda.FloatTensor",
        "another thread, meanwhile": "torch.FloatTensor",
        "second scope": "torch.cuda.FloatTensor",
        "first, after the other scope ended": "torch.cuda.FloatTensor",
    }
    assert torch.Tensor.type is cpu_compat._REAL_TENSOR_TYPE


@pytest.mark.parametrize(
    "dtype, distributed",
    [(torch.float32, True), (torch.bfloat16, False)],
    ids=["fp32-DistributedOptimizer", "bf16-Float16Optimizer"],
)
def test_megatron_adam_step_equals_torch_adamw(applied, dtype, distributed):
    """Megatron's Adam is decoupled-weight-decay AdamW after clipping the grad norm to
    clip_grad; with bf16 params it steps fp32 main params and copies them back."""
    model = tiny_gpt(params_dtype=dtype, bf16=dtype == torch.bfloat16)
    ddp, config, optimizer = megatron_adam(model, distributed)
    assert torch.Tensor.type is cpu_compat._REAL_TENSOR_TYPE  # the type-name shim was scoped
    params = list(model.parameters())
    before = [p.detach().clone() for p in params]
    train_step(ddp, optimizer, batch(0))
    reference = adamw_reference(before, [p.main_grad for p in params], config)
    for p, r in zip(params, reference):
        assert torch.allclose(p.float(), r.to(dtype).float(), atol=1e-6)


def test_moe_gpt_with_allgather_dispatcher_trains(applied):
    model = tiny_gpt(
        num_moe_experts=4,
        moe_router_topk=2,
        moe_token_dispatcher_type="allgather",
        moe_aux_loss_coeff=0.01,
        moe_router_load_balancing_type="aux_loss",
        add_bias_linear=False,
    )
    loss = lm_loss(model, batch(0))
    loss.backward()
    assert torch.isfinite(loss)
    router = model.decoder.layers[0].mlp.router
    assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0
