"""Model builders on megatron-core, initialisation, and pretrained weights in and out."""
