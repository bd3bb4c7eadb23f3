"""`python -m megatron_ext.evaluation`: see cli.py."""

from megatron_ext.evaluation.cli import main

main()
