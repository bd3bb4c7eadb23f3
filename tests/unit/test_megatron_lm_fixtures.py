"""The checkpoints Megatron-LM wrote (tests/fixtures/megatron_lm, by make_fixtures.py there) are
what they claim: a torch_dist save of Megatron-LM's training loop with its common state, its
RNG state among the sharded objects, and the distributed optimizer's sharding type named in
the content metadata. Reads files only: no Megatron-LM source, no workers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import megatron.core  # noqa: F401  its safe globals: common.pt holds an argparse.Namespace
from megatron.core.dist_checkpointing import load_content_metadata
from torch.distributed.checkpoint import FileSystemReader

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "megatron_lm"

# layout: the distributed optimizer's sharding type (None: no distributed optimizer)
LAYOUTS = {"tp2pp2_dp_reshardable": "dp_reshardable", "tp2pp2_fully_reshardable": "fully_reshardable", "tp1_bf16": None}

NAMES = [f"{family}_{layout}" for family in ("gpt3", "llama") for layout in LAYOUTS]


def iteration_dir(name: str) -> Path:
    root = FIXTURES / name
    iteration = int((root / "latest_checkpointed_iteration.txt").read_text())
    return root / f"iter_{iteration:07d}"


@pytest.mark.parametrize("name", NAMES)
def test_common_state(name):
    record = json.loads((FIXTURES / name / "command.json").read_text())
    folder = iteration_dir(name)
    assert {".metadata", "common.pt", "metadata.json"} <= {p.name for p in folder.iterdir()}
    assert any(p.suffix == ".distcp" for p in folder.iterdir())
    assert json.loads((folder / "metadata.json").read_text())["sharded_backend"] == "torch_dist"

    common = torch.load(folder / "common.pt", map_location="cpu")  # weights_only: megatron's safe globals
    assert {"args", "checkpoint_version", "iteration", "opt_param_scheduler", "num_floating_point_operations_so_far"} <= (
        common.keys()
    )
    assert common["checkpoint_version"] == 3.0
    saved = record["saved"]
    assert common["iteration"] == saved["iteration"] == 3
    assert common["num_floating_point_operations_so_far"] == saved["num_floating_point_operations_so_far"] > 0
    assert common["opt_param_scheduler"]["num_steps"] == saved["scheduler_num_steps"]
    assert common["opt_param_scheduler"]["lr_decay_style"] == "cosine"
    args = common["args"]
    assert args.consumed_train_samples == saved["consumed_train_samples"] == 3 * args.global_batch_size
    assert args.world_size == record["world_size"]
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) == ((2, 2) if "tp2pp2" in name else (1, 1))
    assert args.ckpt_format == "torch_dist"
    assert args.bf16 == name.endswith("bf16")
    assert args.use_distributed_optimizer == ("tp2pp2" in name)
    llama = name.startswith("llama")
    assert args.normalization == ("RMSNorm" if llama else "LayerNorm")
    assert args.position_embedding_type == ("rope" if llama else "learned_absolute")
    assert (args.swiglu, args.untie_embeddings_and_output_weights, args.add_bias_linear) == (llama, llama, not llama)
    assert args.group_query_attention == llama
    if llama:
        assert args.num_query_groups == 2


@pytest.mark.parametrize("name", NAMES)
def test_sharded_metadata(name):
    folder = iteration_dir(name)
    keys = FileSystemReader(str(folder)).read_metadata().state_dict_metadata.keys()
    assert any(key.startswith("rng_state") for key in keys)
    assert any(key.startswith("optimizer.") for key in keys)
    assert "embedding.word_embeddings.weight" in keys
    assert ("output_layer.weight" in keys) == name.startswith("llama")  # untied in the LLaMA ones

    metadata = load_content_metadata(str(folder))
    assert metadata.get("distrib_optim_sharding_type") == LAYOUTS[name.split("_", 1)[1]]


def test_fixtures_stay_small():
    total = sum(p.stat().st_size for p in FIXTURES.rglob("*") if p.is_file())
    assert total < 10 * 2**20, f"{total / 2**20:.1f} MiB of fixtures"
