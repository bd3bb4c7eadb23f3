"""Packed multi-adapter LoRA fine-tuning on one frozen megatron-core base (PLoRA)."""
