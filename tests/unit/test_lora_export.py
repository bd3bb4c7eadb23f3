"""Adapters leave the packed runtime in PEFT format and come back.

The reference is `peft` itself: our exported base in `transformers`' LlamaForCausalLM, with the
exported adapter loaded by `PeftModel`, must give the logits our model gives with that adapter
in its slot. The round trips (PEFT, megatron checkpoint) must put back identical tensors.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_ext.lora.export import from_peft, load_megatron, load_peft, save_megatron, save_peft, to_peft
from megatron_ext.lora.job import LoraJob
from megatron_ext.lora.runtime.base import build_base
from megatron_ext.lora.runtime.batching import SyntheticData, pack
from megatron_ext.lora.runtime.layers import install_job, logical_weights

from test_lora_packed import MODEL, VOCAB, random_weights

# Odd sizes on purpose: 3 query groups of 2 heads makes the qkv split order matter.
LLAMA = dataclasses.replace(MODEL, num_attention_heads=6, num_query_groups=3, hidden_size=48, ffn_hidden_size=96)
# Both models are fp64, but megatron keeps parts of RoPE in fp32: the bases alone already differ by
# 5e-8 (measured), the adapted models by 2.3e-7. A wrong q/k/v or gate/up split is off by the
# adapter's whole effect (checked > 1e-3).
LOGITS_ATOL = 1e-6
JOB = LoraJob("x", rank=5, alpha=7.0, seq_length=12)
PARTIAL = LoraJob("y", rank=3, alpha=3.0, seq_length=12, target_modules=("linear_qkv", "linear_fc1"))


def our_logits(model, routing, mb, slot: int) -> torch.Tensor:
    batch = pack([(slot, mb)])
    routing.segments = batch.segments
    with torch.no_grad():
        return model(batch.tokens, batch.position_ids, None)[..., :VOCAB]


@pytest.mark.parametrize("job", [JOB, pytest.param(PARTIAL, marks=pytest.mark.slow)], ids=["all-targets", "qkv-fc1"])
def test_peft_loads_our_adapter_with_the_same_logits(one_rank_world, tmp_path, job):
    pytest.importorskip("peft")
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from megatron_ext.models.convert.hf import write_hf
    from megatron_ext.models.convert.hf_config import hf_config_from_model
    from megatron_ext.models.convert.llama import logical_to_hf
    from megatron_ext.models.convert.load import gather_logical

    model, wrappers, routing = build_base(LLAMA, VOCAB, dtype=torch.float64)
    weights = {k: v for k, v in random_weights(wrappers, job.rank, 7).items() if k[1] in job.target_modules}
    install_job(wrappers, 2, job, weights)
    mb = next(SyntheticData(job, VOCAB).train())
    ours = our_logits(model, routing, mb, slot=2)

    hf_dir = write_hf(tmp_path / "hf", logical_to_hf(gather_logical([model]), LLAMA, VOCAB), hf_config_from_model(LLAMA, VOCAB))
    save_peft(tmp_path / "adapter", job, logical_weights(wrappers, 2), LLAMA, base_model=str(hf_dir))
    base = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float64).eval()
    with torch.no_grad():
        plain = base(mb.tokens).logits
        theirs = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()(mb.tokens).logits
    assert (plain - theirs).abs().max() > 1e-3, "the adapter changes nothing: the check would be empty"
    torch.testing.assert_close(theirs, ours, rtol=0, atol=LOGITS_ATOL)


def test_peft_round_trip_and_reload_into_another_slot(one_rank_world, tmp_path):
    model, wrappers, routing = build_base(LLAMA, VOCAB, dtype=torch.float64)
    install_job(wrappers, 0, JOB, random_weights(wrappers, JOB.rank, 3))
    saved = logical_weights(wrappers, 0)
    assert {k: tuple(map(torch.Tensor.clone, v)) for k, v in from_peft(to_peft(saved, LLAMA), LLAMA).items()}.keys() == saved.keys()
    save_peft(tmp_path, JOB, saved, LLAMA)
    job, loaded = load_peft(tmp_path, LLAMA, LoraJob("again", seq_length=12))
    assert (job.rank, job.alpha, set(job.target_modules)) == (JOB.rank, JOB.alpha, set(JOB.target_modules))
    assert all(torch.equal(loaded[k][i], saved[k][i]) for k in saved for i in (0, 1))
    mb = next(SyntheticData(JOB, VOCAB).train())
    first = our_logits(model, routing, mb, slot=0)
    install_job(wrappers, 1, job, loaded)
    assert torch.equal(our_logits(model, routing, mb, slot=1), first)


def test_independent_peft_adapters_fuse_exactly(one_rank_world):
    """q/k/v (and gate/up) adapters trained apart have their own A: fused at the summed rank."""
    tensors = to_peft({(1, "linear_qkv"): (torch.randn(2, 48, dtype=torch.float64), torch.randn(48 + 2 * 24, 2, dtype=torch.float64))}, LLAMA)
    for name in tensors:
        if "k_proj.lora_A" in name:
            tensors[name] = torch.randn_like(tensors[name])
    (a, b), = from_peft(tensors, LLAMA).values()
    assert a.shape == (6, 48)
    x = torch.randn(4, 48, dtype=torch.float64)
    prefix = "base_model.model.model.layers.0.self_attn"
    per_projection = [x @ tensors[f"{prefix}.{p}.lora_A.weight"].t() @ tensors[f"{prefix}.{p}.lora_B.weight"].t() for p in ("q_proj", "k_proj", "v_proj")]
    from megatron_ext.models.convert.llama import fuse_qkv

    torch.testing.assert_close(x @ a.t() @ b.t(), fuse_qkv(*(y.t() for y in per_projection), LLAMA).t(), rtol=0, atol=1e-12)


@pytest.mark.slow  # dist_checkpointing's save takes seconds; the sweep test covers it too
def test_megatron_checkpoint_round_trip(one_rank_world, tmp_path):
    model, wrappers, routing = build_base(LLAMA, VOCAB, dtype=torch.float64)
    install_job(wrappers, 0, PARTIAL, {k: v for k, v in random_weights(wrappers, PARTIAL.rank, 1).items() if k[1] in PARTIAL.target_modules})
    saved = logical_weights(wrappers, 0)
    save_megatron(tmp_path / "ckpt", PARTIAL, saved)
    job, loaded = load_megatron(tmp_path / "ckpt")
    assert job == PARTIAL and loaded.keys() == saved.keys()
    assert all(torch.equal(loaded[k][i], saved[k][i]) for k in saved for i in (0, 1))


def test_partial_fused_adapter_is_refused(one_rank_world):
    tensors = to_peft({(1, "linear_fc1"): (torch.randn(2, 48), torch.randn(192, 2))}, LLAMA)
    tensors = {k: v for k, v in tensors.items() if "up_proj" not in k}
    with pytest.raises(ValueError, match="gate_proj.*up_proj"):
        from_peft(tensors, LLAMA)
