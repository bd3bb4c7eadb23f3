"""Without CUDA, megatron's small fused functions stay plain eager PyTorch.

megatron-core decorates its elementwise fusions (activations, bias + SwiGLU, the router's expert
bias, ...) with `megatron.core.jit.jit_fuser`, which is `torch.compile` on recent PyTorch. The
decoration runs when megatron is imported and loads TorchDynamo and Inductor: about 3 s of every
process's start on these CPUs (measured: importing the trainer took 6.5 s, 3.6 s without it),
for fusions the CPU configs do not compile anyway. megatron's own switch, `disable_jit_fuser()`,
only acts on modules imported after it, and `import megatron.core` already imports the fused
modules, so the switch is flipped from an import hook the moment `megatron.core.jit` has run.

The hook is installed when megatron_ext is imported (before megatron, in any process that imports
megatron_ext first) and removes itself at megatron's import; on a CUDA machine it changes nothing.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

JIT_MODULE = "megatron.core.jit"


class _EagerFusionsOnCpu(importlib.abc.MetaPathFinder):
    """Finds `megatron.core.jit` as usual and wraps its loader: after the module has run,
    `disable_jit_fuser()` if CUDA is not available."""

    def find_spec(self, name, path, target=None):
        if name != JIT_MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run_module = spec.loader.exec_module

        def exec_module(module) -> None:
            run_module(module)
            import torch  # torch: `import megatron_ext` installs this hook and stays torch-free

            if not torch.cuda.is_available():
                module.disable_jit_fuser()

        spec.loader.exec_module = exec_module
        return spec


def install() -> None:
    """Idempotent; a no-op once megatron is imported (its fusions are decorated by then)."""
    if JIT_MODULE in sys.modules or any(isinstance(f, _EagerFusionsOnCpu) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _EagerFusionsOnCpu())
