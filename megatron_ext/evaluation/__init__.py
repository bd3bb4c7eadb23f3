from megatron_ext.evaluation.loss import forward_only_loss, perplexity, text_windows

__all__ = ["forward_only_loss", "perplexity", "text_windows"]
