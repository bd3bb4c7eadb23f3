"""`python -m megatron_ext.generation`: see cli.py."""

from megatron_ext.generation.cli import main

main()
