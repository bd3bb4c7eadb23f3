from megatron_ext.generation.generate import SamplingConfig, generate

__all__ = ["SamplingConfig", "generate"]
