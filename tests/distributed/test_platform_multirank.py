"""megatron-core on CPU across two gloo ranks: the fixes that only show with several processes.

- pipeline_schedules (+ tensor_cuda_method): a PP=2 1F1B step with megatron's schedule (p2p shape
  and receive buffers on the current device; the tied embedding/output weight set up with
  `.cuda()`) gives the loss and the gradients of the same GPT run in one piece, in one process.
- dist_checkpointing (+ tensor_cuda_method): a tensor sharded over the two ranks, saved with the
  fully parallel torch_dist strategy, loads back into the same layout and, replicated, into a
  full copy on each rank (the fully parallel load exchanges shards between the ranks).
- tensor_cuda_method: the parameter-hash check across data-parallel replicas tells equal
  replicas from different ones.
- uneven_tp_collectives: megatron's tensor-parallel gather (and its backward) and
  reduce-scatter in unequal parts, as the all-to-all MoE dispatcher calls them at TP > 1.
- mla_rotary_key_grad, mla_latent_norm_grads: a GPT with multi-latent attention (megatron's
  local spec, latent norms on) at TP=2 gives, after megatron DDP's `finalize_model_grads`, the
  gradients of every parameter of the same GPT at TP=1.

Each check runs with the runtime layer (`cpu_compat.apply()`) and, without it, on megatron-core
with patches/*.diff applied. This file is also the worker script `torchrun` starts; megatron is
imported inside the worker because dist_checkpointing's spawned writer re-imports this module.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
VOCAB, SEQ, MBS, MICROBATCHES, SEED = 32, 8, 2, 4, 123
TOLERANCE = 1e-5
# Relative to a parameter's largest gradient: fp32 reduction order only.
MLA_TOLERANCE = 1e-5


# --- the worker (two ranks) ------------------------------------------------------------------


def tiny_gpt(pp: int, pre_process: bool = True, post_process: bool = True):
    import torch
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        use_cpu_initialization=True,
        pipeline_dtype=torch.float32,
        pipeline_model_parallel_size=pp,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    torch.manual_seed(0)
    return GPTModel(
        config,
        get_gpt_layer_local_spec(),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=True,
    )


def name_in_whole_model(name: str, stage: int) -> str:
    """A stage's parameter name -> the same parameter's name in the unsplit GPT (one layer per
    stage; the last stage's output layer is the tied word embedding)."""
    if name == "output_layer.weight":
        return "embedding.word_embeddings.weight"
    prefix = "decoder.layers."
    if name.startswith(prefix):
        index, rest = name[len(prefix) :].split(".", 1)
        return f"{prefix}{int(index) + stage}.{rest}"
    return name


def pipeline_check() -> dict:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.pipeline_parallel import get_forward_backward_func

    positions = torch.arange(SEQ).expand(MBS, SEQ)
    batches = [
        torch.randint(0, VOCAB, (MBS, SEQ), generator=torch.Generator().manual_seed(i))
        for i in range(MICROBATCHES)
    ]

    # Reference: the whole model in this process, plain autograd over the microbatches.
    parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(SEED)
    whole = tiny_gpt(pp=1)
    reference = sum(whole(t, positions, None, labels=t).mean() for t in batches) / MICROBATCHES
    reference.backward()
    whole_params = dict(whole.named_parameters())
    parallel_state.destroy_model_parallel()

    # PP=2: this rank holds one stage, with the reference's weights.
    parallel_state.initialize_model_parallel(1, 2)
    tensor_parallel.model_parallel_cuda_manual_seed(SEED)
    stage = parallel_state.get_pipeline_model_parallel_rank()
    part = tiny_gpt(pp=2, pre_process=stage == 0, post_process=stage == 1)
    with torch.no_grad():
        for name, p in part.named_parameters():
            p.copy_(whole_params[name_in_whole_model(name, stage)])

    def forward_step(data_iterator, model):
        tokens = next(data_iterator)
        losses = model(tokens, positions, None, labels=tokens)
        return losses, lambda out: (out.mean(), {"loss": out.mean().detach()})

    stats = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(batches),
        model=[part],
        num_microbatches=MICROBATCHES,
        seq_length=SEQ,
        micro_batch_size=MBS,
    )
    # As finalize_model_grads does: the tied weight's grad is the sum over its two copies.
    dist.all_reduce(
        part.shared_embedding_or_output_weight().grad, group=parallel_state.get_embedding_group()
    )
    grad_diffs = {}  # keyed by the name in the whole model
    for name, p in part.named_parameters():
        whole_name = name_in_whole_model(name, stage)
        grad_diffs[whole_name] = (p.grad - whole_params[whole_name].grad).abs().max().item()
    parallel_state.destroy_model_parallel()
    return {
        "stage": stage,
        "loss": torch.stack([s["loss"] for s in stats]).mean().item() if stats else None,
        "reference_loss": reference.item(),
        "grad_diffs": grad_diffs,
        "whole_model_params": sorted(whole_params),
    }


def checkpoint_check(ckpt_dir: str) -> dict:
    import torch
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.serialization import (
        get_default_load_sharded_strategy,
        get_default_save_sharded_strategy,
    )
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelLoadStrategyWrapper,
        FullyParallelSaveStrategyWrapper,
    )

    parallel_state.initialize_model_parallel(1, 1)  # data parallel over both ranks
    group = parallel_state.get_data_parallel_group()
    rank = group.rank()
    full = torch.arange(24.0).view(4, 6)
    rows = slice(2 * rank, 2 * rank + 2)

    def sharded(tensor):
        return {"w": ShardedTensor.from_rank_offsets("w", tensor, (0, rank, 2))}

    save = FullyParallelSaveStrategyWrapper(get_default_save_sharded_strategy(), group)
    dist_checkpointing.save(sharded(full[rows].clone()), ckpt_dir, save)
    load = FullyParallelLoadStrategyWrapper(get_default_load_sharded_strategy(ckpt_dir), group)
    same_layout = dist_checkpointing.load(sharded(torch.zeros(2, 6)), ckpt_dir, load)["w"]
    replicated = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(4, 6), replica_id=rank)}
    replicated = dist_checkpointing.load(replicated, ckpt_dir, load)["w"]
    parallel_state.destroy_model_parallel()
    return {
        "same_layout_equal": torch.equal(same_layout, full[rows]),
        "replicated_equal": torch.equal(replicated, full),
    }


def param_hash_check() -> dict:
    import torch
    from megatron.core import parallel_state
    from megatron.core.utils import check_param_hashes_across_dp_replicas

    parallel_state.initialize_model_parallel(1, 1)
    torch.manual_seed(0)
    replica = torch.nn.Linear(2, 2)
    equal = check_param_hashes_across_dp_replicas([replica], cross_check=True)
    with torch.no_grad():
        replica.weight[0, 0] += parallel_state.get_data_parallel_rank()
    differing = check_param_hashes_across_dp_replicas([replica], cross_check=True)
    parallel_state.destroy_model_parallel()
    return {"equal_replicas_match": equal, "different_replicas_match": differing}


def uneven_tp_check() -> dict:
    """The all-to-all MoE dispatcher's tensor-parallel gather and reduce-scatter of unequal
    parts (gloo gathers equal ones only): rank 0 holds row 0 of a 3-row tensor, rank 1 rows 1-2."""
    import torch
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import mappings

    parallel_state.initialize_model_parallel(2, 1)
    group = parallel_state.get_tensor_model_parallel_group()
    rank = group.rank()
    splits, rows = [1, 2], slice(rank, 2 * rank + 1)
    whole = torch.arange(12.0).view(3, 4)
    weights = whole + 1  # the same on both ranks: each rank's gradient of the gathered tensor
    part = whole[rows].clone().requires_grad_()
    gathered = mappings.gather_from_sequence_parallel_region(part, group=group, output_split_sizes=splits)
    (gathered * weights).sum().backward()  # backward: reduce-scatter of both ranks' gradients
    scattered = mappings.reduce_scatter_to_sequence_parallel_region(
        whole * (rank + 1), group=group, input_split_sizes=splits
    )
    parallel_state.destroy_model_parallel()
    return {
        "uneven_gather_equal": torch.equal(gathered.detach(), whole),
        "uneven_gather_grad_equal": torch.equal(part.grad, 2 * weights[rows]),
        "uneven_reduce_scatter_equal": torch.equal(scattered, 3 * whole[rows]),
    }


def tiny_mla_gpt(tp: int):
    """A one-layer MLA GPT (megatron's local spec; core attention: megatron_ext's local one,
    which takes MLA's head sizes), wrapped in megatron's DDP."""
    import torch
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import MLATransformerConfig

    from megatron_ext.models.mla import MLACoreAttention

    config = MLATransformerConfig(
        num_layers=1, hidden_size=32, num_attention_heads=4, tensor_model_parallel_size=tp,
        use_cpu_initialization=True, pipeline_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0,
        q_lora_rank=16, kv_lora_rank=8, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=8, rope_type="rope",
        qk_layernorm=True,
    )
    spec = get_gpt_layer_local_spec(multi_latent_attention=True, qk_layernorm=True)
    spec.submodules.self_attention.submodules.core_attention = MLACoreAttention
    model = GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=SEQ, position_embedding_type="rope")
    return DistributedDataParallel(config, DistributedDataParallelConfig(), model)


def mla_grads(tp: int, weights: dict | None) -> tuple[list, list]:
    """(weight shards, gradient shards) of the MLA GPT at `tp` after one forward-backward and
    `finalize_model_grads`, from `weights` (whole tensors by logical name; None: its own)."""
    import torch
    from _logical_shards import grad_shards, weight_shards
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.distributed import finalize_model_grads

    from megatron_ext.models.logical import fill_from_logical

    parallel_state.initialize_model_parallel(tp, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(SEED)
    model = tiny_mla_gpt(tp)
    if weights is not None:
        fill_from_logical([model], lambda name, shape: weights[(name.key, name.index)])
    tokens = torch.randint(0, VOCAB, (MBS, SEQ), generator=torch.Generator().manual_seed(0))
    model(tokens, torch.arange(SEQ).expand(MBS, SEQ), None, labels=tokens).mean().backward()
    finalize_model_grads([model])
    found = weight_shards([model]), grad_shards([model])
    parallel_state.destroy_model_parallel()
    return found


def mla_check() -> dict:
    """Per parameter, the largest |gradient difference| between TP=2 and TP=1 relative to its
    largest TP=1 gradient (each rank runs both; at TP=1 the two ranks are data-parallel
    replicas of one batch)."""
    from _logical_shards import whole

    weights, reference = mla_grads(1, None)
    weights, reference = whole([weights], "TP=1 weights"), whole([reference], "TP=1 gradients")
    _, shards = mla_grads(2, weights)
    diffs = {}
    for name, _, box, grad in shards:
        expected = reference[name][tuple(slice(a, b) for a, b in box)]
        relative = ((grad - expected).abs().max() / reference[name].abs().max()).item()
        diffs[name[0]] = max(diffs.get(name[0], 0.0), relative)
    return {"mla_grad_diffs": diffs}


def worker(out_dir: str, runtime_layer: str) -> None:
    import megatron.core
    import torch.distributed as dist

    if runtime_layer == "yes":
        from megatron_ext.platform import cpu_compat

        cpu_compat.apply()
    dist.init_process_group("gloo")
    results = {"megatron_core": megatron.core.__file__, **pipeline_check(), **param_hash_check()}
    results.update(uneven_tp_check())
    results.update(mla_check())
    results.update(checkpoint_check(str(Path(out_dir) / "ckpt")))
    Path(out_dir, f"rank{dist.get_rank()}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    worker(*sys.argv[1:])


# --- the test --------------------------------------------------------------------------------


def patched_megatron(tmp: Path) -> Path:
    tree = tmp / "patched"
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "check_patches.py"), "--keep", str(tree)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return tree


@pytest.mark.distributed
# The upstream diffs at two ranks beside the default suite (-m slow): tests/unit/
# test_platform_cpu_compat.py applies them at one rank there.
@pytest.mark.parametrize(
    "runtime_layer",
    [pytest.param(True, id="runtime-layer"), pytest.param(False, id="upstream-diffs", marks=pytest.mark.slow)],
)
def test_two_ranks(runtime_layer, tmp_path):
    megatron_root = None if runtime_layer else patched_megatron(tmp_path)
    from _torchrun import rank_reports, torchrun

    (tmp_path / "ckpt").mkdir()
    extra = [str(megatron_root)] if megatron_root else []
    torchrun(__file__, 2, str(tmp_path), "yes" if runtime_layer else "no", extra_path=extra, timeout=300)
    ranks = rank_reports(tmp_path, 2)

    for rank in ranks:
        if megatron_root:
            assert rank["megatron_core"].startswith(str(megatron_root))
        assert max(rank["grad_diffs"].values()) < TOLERANCE, rank["grad_diffs"]
        assert rank["equal_replicas_match"] and not rank["different_replicas_match"]
        assert rank["same_layout_equal"] and rank["replicated_equal"]
        assert rank["uneven_gather_equal"] and rank["uneven_gather_grad_equal"], rank
        assert rank["uneven_reduce_scatter_equal"], rank
        assert max(rank["mla_grad_diffs"].values()) < MLA_TOLERANCE, rank["mla_grad_diffs"]
    first, last = sorted(ranks, key=lambda r: r["stage"])
    assert first["stage"] == 0 and last["stage"] == 1
    assert abs(last["loss"] - last["reference_loss"]) < TOLERANCE
    # Every parameter of the whole model was compared on one stage or the other.
    assert set(first["grad_diffs"]) | set(last["grad_diffs"]) == set(first["whole_model_params"])
