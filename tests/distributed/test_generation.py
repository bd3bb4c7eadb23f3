"""Generation with megatron's KV cache equals recomputing the whole sequence every step."""

from __future__ import annotations

import pytest

from megatron_ext.config.schema import ModelConfig, ParallelConfig
from megatron_ext.generation import SamplingConfig, generate
from megatron_ext.models.gpt import build_gpt_model, layer_spec, transformer_config
from megatron_ext.models.init import init_weights_layout_independent

VOCAB = 258


@pytest.fixture
def tiny_model(one_rank_world):
    model_cfg = ModelConfig(num_query_groups=2, seq_length=64)
    config = transformer_config(model_cfg, ParallelConfig(), on_cpu=True)
    model = build_gpt_model(model_cfg, config, layer_spec(model_cfg, False), 384, True, True)
    init_weights_layout_independent([model], config, seed=7)
    return model


SAMPLING = {
    "greedy": SamplingConfig(max_new_tokens=20),
    "temperature": SamplingConfig(max_new_tokens=20, temperature=0.9, seed=3),
    "top_k_top_p": SamplingConfig(max_new_tokens=20, temperature=1.0, top_k=20, top_p=0.9, seed=5),
}


@pytest.mark.parametrize("name", list(SAMPLING))
def test_cache_matches_recompute(tiny_model, name):
    prompt = list(b"def main():\n    ")
    with_cache = generate(tiny_model, prompt, VOCAB, SAMPLING[name])
    without = generate(tiny_model, prompt, VOCAB, SamplingConfig(**{**SAMPLING[name].__dict__, "use_cache": False}))
    assert with_cache == without
    assert len(with_cache) == 20 and all(0 <= t < VOCAB for t in with_cache)


def test_stop_token_ends_generation(tiny_model):
    prompt = list(b"abc")
    free = generate(tiny_model, prompt, VOCAB, SamplingConfig(max_new_tokens=10))
    stop = free[3]
    stopped = generate(tiny_model, prompt, VOCAB, SamplingConfig(max_new_tokens=10, stop_token_ids=(stop,)))
    assert stopped == free[: free.index(stop) + 1]


def test_prompt_too_long_is_refused(tiny_model):
    with pytest.raises(ValueError, match="sequence length"):
        generate(tiny_model, [1] * 60, VOCAB, SamplingConfig(max_new_tokens=10))
