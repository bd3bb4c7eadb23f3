"""Hugging Face -> megatron (TP2 x PP2, 4 workers) -> Hugging Face is bitwise exact, for a tiny
random GQA LLaMA with and without tied embeddings, through scripts/convert_checkpoint.py."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megatron_ext.checkpointing import torch_dist as ckpt

pytestmark = [pytest.mark.distributed, pytest.mark.model]

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "convert_checkpoint.py"


def load_script():
    spec = importlib.util.spec_from_file_location("convert_checkpoint", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def convert(capsys, *args: str) -> tuple[int, str]:
    """Run the script's main in this process (its workers are started processes anyway);
    returns (exit code, stderr)."""
    try:
        load_script().main(list(args))
        code = 0
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err


def tiny_llama(folder: Path, tied: bool) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=100, max_position_embeddings=256, rope_theta=5000.0,
        tie_word_embeddings=tied,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # norms of ones would hide a swapped norm
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(folder)
    (folder / "tokenizer_config.json").write_text('{"model_max_length": 256}')


# SmolLM2 ties its embeddings; the untied case runs with -m slow (the suite's time).
@pytest.mark.parametrize("tied", [pytest.param(False, marks=pytest.mark.slow), True], ids=["untied", "tied"])
def test_round_trip_through_tp2_pp2_is_bitwise(tmp_path, capsys, tied):
    from transformers import LlamaForCausalLM

    hf, megatron, back = tmp_path / "hf", tmp_path / "megatron", tmp_path / "back"
    tiny_llama(hf, tied)

    code, err = convert(capsys, "hf-to-megatron", "--hf-dir", str(hf), "--out", str(megatron), "--tp", "2", "--pp", "2")
    assert code == 0, err[-3000:]
    common = ckpt.load_common(megatron, 0)
    assert ckpt.latest_iteration(megatron) == 0
    assert (common["iteration"], common["consumed_samples"], common["padded_vocab_size"]) == (0, 0, 128)
    assert common["layout"] == {"tp": 2, "pp": 2, "vpp": None}
    assert common["config"]["model"]["tie_embeddings"] is tied

    code, err = convert(capsys, "megatron-to-hf", "--load", str(megatron), "--out", str(back))
    assert code == 0, err[-3000:]
    original, exported = load_file(hf / "model.safetensors"), load_file(back / "model.safetensors")
    assert set(exported) == set(original) - ({"lm_head.weight"} if tied else set())
    assert all(torch.equal(exported[n], original[n]) for n in exported)
    assert json.loads((back / "tokenizer_config.json").read_text()) == {"model_max_length": 256}

    tokens = torch.randint(0, 100, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = LlamaForCausalLM.from_pretrained(hf).eval()(tokens).logits
        got = LlamaForCausalLM.from_pretrained(back).eval()(tokens).logits
    assert torch.equal(got, expected)


def test_bad_requests_are_refused_before_writing(tmp_path, capsys):
    hf, out = tmp_path / "hf", tmp_path / "out"
    tiny_llama(hf, tied=False)
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    code, err = convert(capsys, "hf-to-megatron", "--hf-dir", str(hf), "--out", str(out), "--tp", "2")
    assert code == 2 and "already exists" in err
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    code, err = convert(capsys, "hf-to-megatron", "--hf-dir", str(hf), "--out", str(tmp_path / "x"), "--tp", "3")
    assert code == 2 and "parallel.tp: model.num_attention_heads (4)" in err, err
    code, err = convert(capsys, "megatron-to-hf", "--load", str(tmp_path / "none"), "--out", str(tmp_path / "y"))
    assert code == 2 and "no checkpoint" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "out"]
