"""dpp: dynamic pipeline parallelism for long, skewed sequence lengths (InfiniPipe)."""
