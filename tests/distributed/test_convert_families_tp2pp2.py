"""Every Hugging Face family at TP2 x PP2 (4 gloo ranks): the folder loaded as `model.pretrained`
gives transformers' logits (fp32, max |diff| 1e-5, same argmax), and the TP2 x PP2 megatron
checkpoint that `convert_checkpoint.py hf-to-megatron` writes (its worker run by these ranks, or
the script itself for an MoE family) exports through `convert_checkpoint.py megatron-to-hf` to the
same tensors, which transformers reloads with identical logits.

This file is also the worker script the ranks run.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.unit._hf_families import FAMILIES, SIZES, hf_logits, save_tiny  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.model]

TP, PP = 2, 2
# Imported by running convert_checkpoint.py itself (its own 4 workers); the others by its worker
# function, run by this file's ranks.
SCRIPTED = ("qwen3_moe_softmax",)
LOGITS_ATOL = 1e-5
SEQ = 128


def tokens() -> list[int]:
    return torch.randint(0, SIZES["vocab_size"], (SEQ,), generator=torch.Generator().manual_seed(1)).tolist()


def worker(root: str) -> None:
    """For each family under `root`: logits of the folder loaded as model.pretrained, then the
    import into `megatron/` (convert_checkpoint.py's own worker)."""
    import dataclasses

    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_ext.models import pretrained
    from megatron_ext.models.convert.checkpoint import save_imported
    from megatron_ext.models.convert.world import build_model, model_parallel_world
    from megatron_ext.models.gpt import padded_vocab_size
    from megatron_ext.platform.launch import join_world
    from tests.distributed.test_pretrained_smollm import pipeline_logits

    join_world()  # once: each conversion below sets megatron's parallel state in this world
    for name in FAMILIES:
        folder = Path(root, name)
        with model_parallel_world(TP, PP):
            cfg = dataclasses.replace(pretrained.source_config(str(folder / "hf")), pretrained=str(folder / "hf"))
            padded = padded_vocab_size(cfg.vocab_size, cfg, TP)
            chunks = build_model(cfg, padded)
            pretrained.load_into(chunks, cfg, padded)
            logits = pipeline_logits(chunks[0].eval(), tokens())
            if logits is not None and parallel_state.get_tensor_model_parallel_rank() == 0:
                torch.save(logits[:, : cfg.vocab_size], folder / "logits.pt")
        if name not in SCRIPTED:
            save_imported(str(folder / "hf"), str(folder / "megatron"), TP, PP)
    dist.destroy_process_group()


if __name__ == "__main__":
    worker(*sys.argv[1:])


# --- the test ----------------------------------------------------------------------------------


@pytest.mark.slow  # 30 s; every family converts at TP1 in the default suite (test_convert_families.py)
def test_families_at_tp2_pp2_match_transformers_and_round_trip(tmp_path, capsys):
    from safetensors.torch import load_file

    from megatron_ext.checkpointing import torch_dist as ckpt
    from tests.distributed._torchrun import torchrun
    from tests.distributed.test_pretrained_roundtrip import convert

    for name in FAMILIES:
        save_tiny(name, tmp_path / name / "hf")
    torchrun(__file__, TP * PP, str(tmp_path), timeout=600)
    for name in SCRIPTED:
        folder = tmp_path / name
        args = ("--hf-dir", str(folder / "hf"), "--out", str(folder / "megatron"), "--tp", str(TP), "--pp", str(PP))
        code, err = convert(capsys, "hf-to-megatron", *args)
        assert code == 0, err[-3000:]

    ids = torch.tensor([tokens()])
    for name in FAMILIES:
        folder = tmp_path / name
        expected = hf_logits(folder / "hf", ids)
        got = torch.load(folder / "logits.pt")
        diff = (got - expected).abs().max().item()
        with capsys.disabled():  # `convert` reads the captured output
            print(f"\n{name} TP{TP}xPP{PP}: max |logit diff| {diff:.2e}")
        assert diff < LOGITS_ATOL, (name, diff)
        assert torch.equal(got.argmax(-1), expected.argmax(-1)), name

        assert ckpt.load_common(folder / "megatron", 0)["layout"] == {"tp": TP, "pp": PP, "vpp": None}
        code, err = convert(capsys, "megatron-to-hf", "--load", str(folder / "megatron"), "--out", str(folder / "back"))
        assert code == 0, err[-3000:]
        original, exported = load_file(folder / "hf" / "model.safetensors"), load_file(folder / "back" / "model.safetensors")
        config = json.loads((folder / "back" / "config.json").read_text())
        assert set(exported) == set(original) - ({"lm_head.weight"} if config["tie_word_embeddings"] else set()), name
        assert all(torch.equal(exported[n], original[n]) for n in exported), name
        assert config["max_position_embeddings"] == 256
        assert torch.equal(hf_logits(folder / "back", ids), expected), name
