"""Multi-latent attention's latent norms under tensor parallelism: their gradients not summed
over the TP ranks a second time.

With `qk_layernorm`, megatron-core 0.16's `finalize_model_grads` sums over the TP group the
gradient of every parameter whose name holds `q_layernorm` or `k_layernorm`: the QK-norms of
ordinary attention act on each rank's own heads, so each rank holds a part of their gradient.
MLA's `q_layernorm` (and `kv_layernorm`) normalise the whole compressed query (key/value),
which every TP rank holds, and the up-projection's ColumnParallelLinear already sums its input
gradient over TP: each rank's norm gradient is complete, and the sum multiplies the query
norm's by the TP size. (`kv_layernorm` escapes the name test.) Under sequence parallelism the
norms see a part of the tokens and their parameters carry `sequence_parallel`, which is summed
once, rightly; only the name rule is wrong for MLA. Not specific to CPU.
"""

from __future__ import annotations

import copy
import functools
import importlib

from megatron_ext.platform.versions import CHECKED

CHECKED_MEGATRON = CHECKED["mla_latent_norm_grads"]


def fix_mla_latent_norm_grads() -> None:
    import megatron.core  # heavy: megatron, off the launcher (platform/launch.py imports cpu_compat)

    if not CHECKED_MEGATRON.covers(megatron.core.__version__):
        return
    finalize = importlib.import_module("megatron.core.distributed.finalize_model_grads")
    original = finalize._allreduce_non_tensor_model_parallel_grads
    if getattr(original, "__mla_latent_norms__", False):
        return

    @functools.wraps(original)
    def allreduce_non_tensor_model_parallel_grads(model, config, tp_group=None):
        if config.multi_latent_attention and config.qk_layernorm:
            # The rule reads config.qk_layernorm only; the other reductions are kept.
            config = copy.copy(config)
            config.qk_layernorm = False
        return original(model, config, tp_group)

    allreduce_non_tensor_model_parallel_grads.__mla_latent_norms__ = True
    # finalize_model_grads calls it by its module-level name; the legacy alias is kept equal.
    finalize._allreduce_non_tensor_model_parallel_grads = allreduce_non_tensor_model_parallel_grads
    finalize._allreduce_layernorm_grads = allreduce_non_tensor_model_parallel_grads
