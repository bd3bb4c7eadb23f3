"""SmolLM2-135M-Instruct (GGUF, Q4_1) imported into megatron-core gives the logits of
transformers' LlamaForCausalLM loaded from the same file, in one process (TP1) and split over
TP3 (3 gloo processes; TP3 x PP2, 6 processes, with -m slow); its Hugging Face export loads in
transformers and reproduces them.

SmolLM2 has 9 query / 3 KV heads, so TP=2 cannot split it; TP=3 is the multi-process layout
here (tests/distributed/test_pretrained_roundtrip.py covers TP2 x PP2 on a tiny LLaMA).

This file is also the worker script torchrun starts for the model-parallel checks.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from megatron_ext.config.schema import ModelConfig

pytestmark = pytest.mark.model

TEXT = (
    "Water is a chemical compound made of hydrogen and oxygen. At room temperature it is a clear "
    "liquid with no taste or smell. It covers about seventy percent of the surface of the Earth, "
    "and all known forms of life need it to survive. Water freezes at zero degrees Celsius and "
    "boils at one hundred degrees Celsius."
)
# fp32 megatron vs fp32 transformers on identical weights: only the order of reductions differs.
LOGITS_ATOL = 1e-3


def pipeline_logits(model, ids: list[int]):
    """Full-vocabulary logits on the last pipeline stage (None elsewhere): each stage runs its
    layers and hands the hidden states to the next."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    tokens, positions = torch.tensor([ids]), torch.arange(len(ids))[None]
    if not parallel_state.is_pipeline_first_stage():
        hidden = torch.empty(len(ids), 1, model.config.hidden_size)
        dist.recv(hidden, src=parallel_state.get_pipeline_model_parallel_prev_rank())
        model.set_input_tensor(hidden)
    with torch.no_grad():
        out = model(tokens, positions, None, runtime_gather_output=True)
    if not parallel_state.is_pipeline_last_stage():
        dist.send(out.contiguous(), dst=parallel_state.get_pipeline_model_parallel_next_rank())
        return None
    return out[0]


def imported(path: str) -> tuple[list, ModelConfig]:
    """SmolLM2 loaded from the GGUF into this rank's stage; (model chunks, its config)."""
    from megatron.core import parallel_state

    from megatron_ext.models.convert.gguf import read_gguf
    from megatron_ext.models.convert.load import load_pretrained
    from megatron_ext.models.convert.world import build_model
    from megatron_ext.models.gpt import padded_vocab_size

    pretrained = read_gguf(path)
    cfg = pretrained.config
    padded = padded_vocab_size(cfg.vocab_size, cfg, parallel_state.get_tensor_model_parallel_world_size())
    chunks = build_model(cfg, padded)
    load_pretrained(chunks, pretrained, padded)
    for chunk in chunks:
        chunk.eval()
    return chunks, cfg


def worker(path: str, ids_file: str, out_dir: str, tp: str, pp: str) -> None:
    from megatron.core import parallel_state

    from megatron_ext.evaluation import perplexity
    from megatron_ext.models.convert.world import model_parallel_world

    ids = json.loads(Path(ids_file).read_text())
    with model_parallel_world(tp=int(tp), pp=int(pp)):
        chunks, cfg = imported(path)
        logits = pipeline_logits(chunks[0], ids)
        ppl = perplexity(chunks, ids, len(ids) - 1)
        if logits is not None and parallel_state.get_tensor_model_parallel_rank() == 0:
            torch.save({"logits": logits[:, : cfg.vocab_size], "perplexity": ppl}, Path(out_dir) / "result.pt")


if __name__ == "__main__":
    worker(*sys.argv[1:])


# --- the tests -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(smollm_gguf):
    from megatron_ext.data.gguf_tokenizer import GGUFTokenizer

    return GGUFTokenizer(str(smollm_gguf))


@pytest.fixture(scope="module")
def reference(smollm_hf_model, tokenizer) -> dict:
    """Token ids of TEXT, transformers' logits and perplexity on them."""
    ids = tokenizer.tokenize(TEXT)
    with torch.no_grad():
        out = smollm_hf_model(torch.tensor([ids]), labels=torch.tensor([ids]))
    return {"ids": ids, "logits": out.logits[0], "perplexity": torch.exp(out.loss).item()}


def assert_same_predictions(logits: torch.Tensor, reference: dict) -> float:
    diff = (logits - reference["logits"]).abs().max().item()
    assert diff < LOGITS_ATOL, diff
    assert torch.equal(logits.argmax(-1), reference["logits"].argmax(-1))
    return diff


def test_tp1_logits_perplexity_and_hf_export(one_rank_world, smollm_gguf, tokenizer, reference, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_ext.evaluation import perplexity
    from megatron_ext.models.convert.hf import write_hf
    from megatron_ext.models.convert.hf_config import hf_config_from_model
    from megatron_ext.models.convert.llama import logical_to_hf
    from megatron_ext.models.convert.load import gather_logical

    chunks, cfg = imported(str(smollm_gguf))
    ids, vocab = reference["ids"], cfg.vocab_size
    with torch.no_grad():
        logits = chunks[0](torch.tensor([ids]), torch.arange(len(ids))[None], None)[0, :, :vocab]
    diff = assert_same_predictions(logits, reference)
    ppl = perplexity(chunks, ids, len(ids) - 1)
    print(f"\nSmolLM2 TP1: max |logit diff| {diff:.2e}, perplexity {ppl:.3f} (transformers {reference['perplexity']:.3f})")
    assert ppl == pytest.approx(reference["perplexity"], rel=1e-4) and ppl < 20

    tokenizer_dir = tmp_path / "tokenizer"
    tokenizer.save_pretrained(str(tokenizer_dir))
    tensors = logical_to_hf(gather_logical(chunks), cfg, vocab)
    out = write_hf(tmp_path / "hf", tensors, hf_config_from_model(cfg, vocab), tokenizer_dir)
    assert json.loads((out / "config.json").read_text())["max_position_embeddings"] == 8192  # the GGUF's context
    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert AutoTokenizer.from_pretrained(out)(TEXT).input_ids == ids
    with torch.no_grad():
        assert torch.equal(exported(torch.tensor([ids])).logits[0], reference["logits"])


# TP=3 splits SmolLM2's 9 heads and 3 query groups unevenly by powers of two; the pipeline split
# of an imported model is also checked bitwise by test_pretrained_roundtrip (TP2 x PP2).
@pytest.mark.distributed
@pytest.mark.parametrize("tp, pp", [(3, 1), pytest.param(3, 2, marks=pytest.mark.slow)], ids=["tp3", "tp3_pp2"])
def test_model_parallel_logits_match_transformers(tp, pp, smollm_gguf, reference, tmp_path):
    ids_file = tmp_path / "ids.json"
    ids_file.write_text(json.dumps(reference["ids"]))
    from _torchrun import torchrun

    torchrun(__file__, tp * pp, str(smollm_gguf), str(ids_file), str(tmp_path), str(tp), str(pp), timeout=400)
    result = torch.load(tmp_path / "result.pt")
    diff = assert_same_predictions(result["logits"], reference)
    print(f"\nSmolLM2 TP{tp}xPP{pp}: max |logit diff| {diff:.2e}, perplexity {result['perplexity']:.3f}")
    assert result["perplexity"] == pytest.approx(reference["perplexity"], rel=1e-4)
